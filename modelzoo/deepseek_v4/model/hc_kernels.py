"""Triton kernels for the hyper-connections' passes over the streams, on a GPU.

The streams [tokens, N, hidden] are the largest activations of a DeepSeek-V4 layer, and each block
touches them in three places: the map (a GEMM and the RMS statistic), the collapse into the block's
input, and the residual that mixes them with the block's output. With autograd composing those, the
streams' gradient is three tensors that autograd sums in two more passes, and the reductions of the
backward (the collapse and mixer weights' gradients) each reread the streams.

Here each place is one autograd Function with one kernel each way, and they are chained by handing
the streams on as an alias output (`streams.view_as(streams)`): the map returns the streams the
collapse takes, the collapse returns those the residual takes. Each alias has one consumer, so
autograd sums nothing: the residual's streams gradient arrives as the collapse's output gradient,
whose kernel adds its own term and passes the sum on to the map's kernel, which adds the GEMM's and the
RMS statistic's terms and writes the streams' gradient once. All sums over the streams are fp32, rounded
once to the streams' dtype.

Between map and collapse, the Sinkhorn iterations on the [tokens, N, N] mixers are one kernel each way
too (`Sinkhorn`; compiled, they ran ~147 kernels of ~1 us per block); the sigmoids before
them stay compiled (`mixing_weights`). On CPU none of this runs: `hyper_connection.py` composes the
plain ops there, which the parity tests compare against transformers, and the GPU tests compare these
kernels against (tests/deepseek_v4/test_hc_kernels.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from modelzoo.deepseek_v4.model.layers import inverse_rms, linear_fp32, linear_fp32_weight_grad
from modelzoo.layers.fused import fused

BLOCK_HIDDEN = 512     # hidden columns per program of the per-token kernels
BLOCK_MATRICES = 16    # tokens' N x N matrices per program of the Sinkhorn kernels
# token rows x flattened stream columns per tile of the map's gradient kernel: the candidates timed on
# a GPU, the first one under the interpreter
MAP_TILES = [dict(BLOCK_T=t, BLOCK_C=c) for t, c in ((32, 128), (64, 128), (32, 256))]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _tuned(key: str, tiles: list[dict] | None = None):
    """Triton's autotune over the warps per program (and `tiles`), timed on first use per `key` value,
    outside any CUDA graph capture (the model's graphs are captured after warm-up steps). Not under
    Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests), which cannot time kernels. Every
    candidate is compiled on first use, so they are few."""
    def wrap(kernel):
        if INTERPRETED:
            return kernel
        configs = [triton.Config(tile, num_warps=warps) for tile in tiles or [{}] for warps in (2, 4, 8)]
        return triton.autotune(configs, key=[key])(kernel)
    return wrap


@_tuned("hidden")
@triton.jit
def _residual_forward(streams, block_output, post, comb, out, hidden, N: tl.constexpr, BLOCK: tl.constexpr):
    """out[n] = post[n] * block_output + sum_j comb[j, n] * streams[j] for one token and BLOCK columns."""
    token, columns = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.arange(0, N)
    mask = columns < hidden
    row = token * N * hidden + columns
    # the coefficients are rounded to the streams' dtype first, like the plain ops' `.to(dtype)`
    weights = tl.load(post + token * N + n).to(out.dtype.element_ty).to(tl.float32)             # [N]
    y = tl.load(block_output + token * hidden + columns, mask=mask, other=0.0).to(tl.float32)    # [BLOCK]
    total = weights[:, None] * y[None, :]                                                        # [N, BLOCK]
    for j in tl.static_range(N):
        x = tl.load(streams + row + j * hidden, mask=mask, other=0.0).to(tl.float32)
        mixer = tl.load(comb + token * N * N + j * N + n).to(out.dtype.element_ty).to(tl.float32)  # comb[j, :]
        total += mixer[:, None] * x[None, :]
    tl.store(out + row[None, :] + n[:, None] * hidden, total.to(out.dtype.element_ty), mask=mask[None, :])


@_tuned("hidden")
@triton.jit
def _residual_backward(grad, streams, block_output, post, comb, grad_streams, grad_block_output, post_partial,
                       comb_partial, hidden, chunks, N: tl.constexpr, BLOCK: tl.constexpr):
    """One token and BLOCK columns: the streams' and block output's gradients, and this chunk's part of
    the sums over hidden that are post's and comb's gradients.

    Rows are [1, BLOCK] tensors and the sums over the N streams run as loops: a reduction along the
    [N, BLOCK] tiles' first axis crosses warps, and made this kernel 6x slower on the H200.
    """
    token, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    columns = chunk * BLOCK + tl.arange(0, BLOCK)[None, :]                                       # [1, BLOCK]
    n = tl.arange(0, N)[:, None]                                                                 # [N, 1]
    mask = columns < hidden
    row = token * N * hidden + columns
    partial = (token * chunks + chunk) * N
    grads = tl.load(grad + row + n * hidden, mask=mask, other=0.0).to(tl.float32)                # [N(n), BLOCK]
    y = tl.load(block_output + token * hidden + columns, mask=mask, other=0.0).to(tl.float32)    # [1, BLOCK]
    tl.store(post_partial + partial + n, tl.sum(grads * y, axis=1, keep_dims=True))
    grad_y = tl.zeros([1, BLOCK], dtype=tl.float32)
    for i in tl.static_range(N):
        g = tl.load(grad + row + i * hidden, mask=mask, other=0.0).to(tl.float32)                # row i: cached
        grad_y += tl.load(post + token * N + i).to(grad_streams.dtype.element_ty).to(tl.float32) * g
    tl.store(grad_block_output + token * hidden + columns, grad_y.to(grad_block_output.dtype.element_ty), mask=mask)
    for j in tl.static_range(N):
        x = tl.load(streams + row + j * hidden, mask=mask, other=0.0).to(tl.float32)             # [1, BLOCK]
        tl.store(comb_partial + (partial + j) * N + n, tl.sum(grads * x, axis=1, keep_dims=True))
        total = tl.zeros([1, BLOCK], dtype=tl.float32)
        for i in tl.static_range(N):
            g = tl.load(grad + row + i * hidden, mask=mask, other=0.0).to(tl.float32)
            mixer = tl.load(comb + token * N * N + j * N + i).to(grad_streams.dtype.element_ty).to(tl.float32)
            total += mixer * g
        tl.store(grad_streams + row + j * hidden, total.to(grad_streams.dtype.element_ty), mask=mask)


@_tuned("hidden")
@triton.jit
def _collapse_forward(streams, pre, out, hidden, N: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum_n pre[n] * streams[n] for one token and BLOCK columns (fp32 sum, one rounding)."""
    token, columns = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(N):
        x = tl.load(streams + token * N * hidden + i * hidden + columns, mask=mask, other=0.0).to(tl.float32)
        total += tl.load(pre + token * N + i) * x
    tl.store(out + token * hidden + columns, total.to(out.dtype.element_ty), mask=mask)


@_tuned("hidden")
@triton.jit
def _collapse_backward(grad, streams, pre, grad_after, grad_streams, pre_partial, hidden, chunks,
                       HAS_AFTER: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    """One token and BLOCK columns: streams' gradient = pre[n] * grad (+ the gradient from the streams'
    later use), and this chunk's part of pre's gradient, the sum over hidden of grad * streams[n]."""
    token, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    columns = chunk * BLOCK + tl.arange(0, BLOCK)
    n = tl.arange(0, N)
    mask = columns < hidden
    rows = token * N * hidden + n[:, None] * hidden + columns[None, :]
    g = tl.load(grad + token * hidden + columns, mask=mask, other=0.0).to(tl.float32)           # [BLOCK]
    x = tl.load(streams + rows, mask=mask[None, :], other=0.0).to(tl.float32)                   # [N, BLOCK]
    total = tl.load(pre + token * N + n)[:, None] * g[None, :]
    if HAS_AFTER:
        total += tl.load(grad_after + rows, mask=mask[None, :], other=0.0).to(tl.float32)
    tl.store(grad_streams + rows, total.to(grad_streams.dtype.element_ty), mask=mask[None, :])
    tl.store(pre_partial + (token * chunks + chunk) * N + n, tl.sum(x * g[None, :], axis=1))


@_tuned("columns_total", MAP_TILES)
@triton.jit
def _map_backward(grad_after, grad_projected, weight, scale, streams, grad_streams, tokens, width, columns_total,
                  HAS_AFTER: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """A tile of the streams' gradient through the map: grad_after + grad_projected @ weight + scale * streams.

    grad_projected [tokens, width] fp32, weight [width, columns]; `scale` [tokens] is the RMS statistic's
    term (a multiple of the streams themselves). The product is an fp32 dot (width 24: no tensor cores needed).
    """
    tokens_tile = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    columns = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, WIDTH)
    token_mask, column_mask = tokens_tile < tokens, columns < columns_total
    mask = token_mask[:, None] & column_mask[None, :]
    g = tl.load(grad_projected + tokens_tile[:, None].to(tl.int64) * width + k[None, :],
                mask=token_mask[:, None] & (k[None, :] < width), other=0.0)
    w = tl.load(weight + k[:, None] * columns_total + columns[None, :], mask=(k[:, None] < width) & column_mask[None, :],
                other=0.0).to(tl.float32)
    rows = tokens_tile[:, None].to(tl.int64) * columns_total + columns[None, :]
    x = tl.load(streams + rows, mask=mask, other=0.0).to(tl.float32)
    total = tl.dot(g, w, input_precision="ieee") + tl.load(scale + tokens_tile, mask=token_mask, other=0.0)[:, None] * x
    if HAS_AFTER:
        total += tl.load(grad_after + rows, mask=mask, other=0.0).to(tl.float32)
    tl.store(grad_streams + rows, total.to(grad_streams.dtype.element_ty), mask=mask)


@fused
def _scaled_map(flat_streams: torch.Tensor, projected: torch.Tensor, norm_eps: float):
    """(the map of the RMS-normalised streams, the 1 / RMS it used): one pass over the streams."""
    inverse = inverse_rms(flat_streams, norm_eps)
    return projected * inverse, inverse


@fused
def _map_gradient_terms(grad_mixes: torch.Tensor, projected: torch.Tensor, inverse: torch.Tensor, count: int):
    """mixes = projected * r with r = (sum(x^2) / count + eps)^-1/2, so dr/dx = -r^3 x / count:
    (the gradient of projected, the multiple of x that is x's gradient through r)."""
    return grad_mixes * inverse, -(grad_mixes * projected).sum(-1, keepdim=True) * inverse ** 3 / count


def _token_rows(streams: torch.Tensor) -> tuple[int, int, int]:
    *_, hc, hidden = streams.shape
    return streams.numel() // (hc * hidden), hc, hidden


class StreamsMap(torch.autograd.Function):
    """(streams [.., N, hidden], weight [width, N * hidden]) -> (the map of the RMS-normalised flattened
    streams [.., width] fp32, the streams as an alias for the collapse)."""

    @staticmethod
    def forward(ctx, streams, weight, norm_eps):
        flat = streams.flatten(-2)
        projected = linear_fp32(flat, weight)
        mixes, inverse = _scaled_map(flat, projected, norm_eps)
        ctx.save_for_backward(streams, weight, projected, inverse)
        return mixes, streams.view_as(streams)

    @staticmethod
    def backward(ctx, grad_mixes, grad_after):
        streams, weight, projected, inverse = ctx.saved_tensors
        tokens, hc, hidden = _token_rows(streams)
        grad_projected, scale = _map_gradient_terms(grad_mixes, projected, inverse, hc * hidden)
        grad_projected, scale = grad_projected.contiguous(), scale.contiguous()
        grad_streams = torch.empty_like(streams)
        has_after = grad_after is not None
        width = weight.shape[0]

        def grid(tile):
            return triton.cdiv(tokens, tile["BLOCK_T"]), triton.cdiv(hc * hidden, tile["BLOCK_C"])
        _map_backward[grid](grad_after.contiguous() if has_after else streams, grad_projected, weight.contiguous(),
                            scale, streams, grad_streams, tokens, width, hc * hidden, HAS_AFTER=has_after,
                            WIDTH=max(16, triton.next_power_of_2(width)), **(MAP_TILES[0] if INTERPRETED else {}))
        return grad_streams, linear_fp32_weight_grad(grad_projected, streams.flatten(-2), weight), None


class Collapse(torch.autograd.Function):
    """(streams [.., N, hidden], pre [.., N] fp32) -> (sum_n pre[n] streams[n] in the streams' dtype,
    the streams as an alias for the residual)."""

    @staticmethod
    def forward(ctx, streams, pre):
        tokens, hc, hidden = _token_rows(streams)
        pre = pre.contiguous()
        collapsed = streams.new_empty(*streams.shape[:-2], hidden)
        _collapse_forward[(tokens, triton.cdiv(hidden, BLOCK_HIDDEN))](streams, pre, collapsed, hidden, N=hc,
                                                                        BLOCK=BLOCK_HIDDEN)
        ctx.save_for_backward(streams, pre)
        return collapsed, streams.view_as(streams)

    @staticmethod
    def backward(ctx, grad, grad_after):
        streams, pre = ctx.saved_tensors
        tokens, hc, hidden = _token_rows(streams)
        chunks = triton.cdiv(hidden, BLOCK_HIDDEN)
        grad_streams = torch.empty_like(streams)
        pre_partial = pre.new_empty(*pre.shape[:-1], chunks, hc)
        has_after = grad_after is not None
        _collapse_backward[(tokens, chunks)](grad.contiguous(), streams, pre,
                                             grad_after.contiguous() if has_after else streams, grad_streams,
                                             pre_partial, hidden, chunks, HAS_AFTER=has_after, N=hc, BLOCK=BLOCK_HIDDEN)
        return grad_streams, pre_partial.sum(-2)


class Residual(torch.autograd.Function):
    """New streams post[n] * block_output + sum_j comb[j, n] * streams[j] (`hc_residual`'s formula)."""

    @staticmethod
    def forward(ctx, post, comb, block_output, streams):
        tokens, hc, hidden = _token_rows(streams)
        post, comb, block_output = post.contiguous(), comb.contiguous(), block_output.contiguous()
        out = torch.empty_like(streams)
        _residual_forward[(tokens, triton.cdiv(hidden, BLOCK_HIDDEN))](streams, block_output, post, comb, out, hidden,
                                                                       N=hc, BLOCK=BLOCK_HIDDEN)
        ctx.save_for_backward(post, comb, block_output, streams)
        return out

    @staticmethod
    def backward(ctx, grad):
        post, comb, block_output, streams = ctx.saved_tensors
        tokens, hc, hidden = _token_rows(streams)
        chunks = triton.cdiv(hidden, BLOCK_HIDDEN)
        grad_streams, grad_block_output = torch.empty_like(streams), torch.empty_like(block_output)
        post_partial = post.new_empty(*post.shape[:-1], chunks, hc)
        comb_partial = comb.new_empty(*comb.shape[:-2], chunks, hc, hc)
        _residual_backward[(tokens, chunks)](grad.contiguous(), streams, block_output, post, comb, grad_streams,
                                             grad_block_output, post_partial, comb_partial, hidden, chunks, N=hc,
                                             BLOCK=BLOCK_HIDDEN)
        return post_partial.sum(-2), comb_partial.sum(-3), grad_block_output, grad_streams


@triton.jit
def _matrices(tokens, N: tl.constexpr, BLOCK_T: tl.constexpr):
    """Offsets and mask of BLOCK_T tokens' N x N matrices, as [BLOCK_T, N, N]."""
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i, j = tl.arange(0, N), tl.arange(0, N)
    offsets = token[:, None, None].to(tl.int64) * N * N + i[None, :, None] * N + j[None, None, :]
    return offsets, (token < tokens)[:, None, None]


@triton.jit
def _softmax_rows(logits):
    exp = tl.exp(logits - tl.max(logits, axis=2, keep_dims=True))
    return exp / tl.sum(exp, axis=2, keep_dims=True)


@_tuned("tokens")
@triton.jit
def _sinkhorn_forward(logits, out, iterates, tokens, iters, eps, N: tl.constexpr, BLOCK_T: tl.constexpr):
    """softmax over rows + eps, then normalise columns, (rows, columns) x (iters - 1); the input of each
    normalisation is kept in `iterates` [2 iters - 1, tokens, N, N] for the backward."""
    offsets, mask = _matrices(tokens, N, BLOCK_T)
    step = tokens.to(tl.int64) * N * N
    comb = _softmax_rows(tl.load(logits + offsets, mask=mask, other=0.0)) + eps
    tl.store(iterates + offsets, comb, mask=mask)
    comb = comb / (tl.sum(comb, axis=1, keep_dims=True) + eps)
    for k in range(1, iters):
        tl.store(iterates + (2 * k - 1) * step + offsets, comb, mask=mask)
        comb = comb / (tl.sum(comb, axis=2, keep_dims=True) + eps)
        tl.store(iterates + 2 * k * step + offsets, comb, mask=mask)
        comb = comb / (tl.sum(comb, axis=1, keep_dims=True) + eps)
    tl.store(out + offsets, comb, mask=mask)


@triton.jit
def _normalise_backward(grad, comb, eps, AXIS: tl.constexpr):
    """Gradient of comb / (sum(comb, AXIS) + eps) with respect to comb."""
    total = tl.sum(comb, axis=AXIS, keep_dims=True) + eps
    return grad / total - tl.sum(grad * comb, axis=AXIS, keep_dims=True) / (total * total)


@_tuned("tokens")
@triton.jit
def _sinkhorn_backward(grad, logits, iterates, grad_logits, tokens, iters, eps, N: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    offsets, mask = _matrices(tokens, N, BLOCK_T)
    step = tokens.to(tl.int64) * N * N
    g = tl.load(grad + offsets, mask=mask, other=0.0)
    for back in range(0, iters - 1):
        k = iters - 1 - back
        g = _normalise_backward(g, tl.load(iterates + 2 * k * step + offsets, mask=mask, other=1.0), eps, 1)
        g = _normalise_backward(g, tl.load(iterates + (2 * k - 1) * step + offsets, mask=mask, other=1.0), eps, 2)
    g = _normalise_backward(g, tl.load(iterates + offsets, mask=mask, other=1.0), eps, 1)
    probabilities = _softmax_rows(tl.load(logits + offsets, mask=mask, other=0.0))
    tl.store(grad_logits + offsets, probabilities * (g - tl.sum(g * probabilities, axis=2, keep_dims=True)),
             mask=mask)



class Sinkhorn(torch.autograd.Function):
    """`plain_sinkhorn` (hyper_connection.py) of logits [.., N, N] fp32: one kernel each way instead of
    a few per iteration (compiled, the iterations ran ~147 kernels of ~1 us per block, ~153 us: the profile
    in docs/performance.md)."""

    @staticmethod
    def forward(ctx, logits, iters, eps):
        logits = logits.contiguous()
        hc = logits.shape[-1]
        tokens = logits.numel() // (hc * hc)
        out = torch.empty_like(logits)
        iterates = logits.new_empty(2 * iters - 1, *logits.shape)
        _sinkhorn_forward[(triton.cdiv(tokens, BLOCK_MATRICES),)](logits, out, iterates, tokens, iters, eps, N=hc,
                                                                 BLOCK_T=BLOCK_MATRICES)
        ctx.save_for_backward(logits, iterates)
        ctx.iters, ctx.eps = iters, eps
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, iterates = ctx.saved_tensors
        hc = logits.shape[-1]
        tokens = logits.numel() // (hc * hc)
        grad_logits = torch.empty_like(logits)
        _sinkhorn_backward[(triton.cdiv(tokens, BLOCK_MATRICES),)](grad.contiguous(), logits, iterates, grad_logits,
                                                                  tokens, ctx.iters, ctx.eps, N=hc,
                                                                  BLOCK_T=BLOCK_MATRICES)
        return grad_logits, None, None
