"""CSA attention over each query's own keys, as Triton kernels on a GPU.

A CSA query sees its `window` keys and its k indexer picks (512 of S / 4 compressed entries in the release). The
dense blocks of `window_attention.py` score a chunk's queries against every entry complete so far and mask all but
the picks: O(S x S / 4) work and fp32 scores written and read back, most of a long row's step. Here one program
takes one query: its heads are the rows of the products (all heads read the one shared K = V head), and it walks
the query's keys in blocks of rows gathered from kv (window rows, then picked entry rows), with an online softmax
that starts from the sink logit (probability mass without a value, so the running maximum is never -inf). Work and
reads are O(S x (window + k)); the compressed entries (C x D, 16 MiB at 65536 tokens) stay in the L2 cache.

The backward recomputes the scores from the saved log-sum-exp, as flash kernels do, and each program adds its keys'
gradients into an fp32 kv gradient with atomic adds: a key row is read by many queries (the window's by `window`
of them, a popular entry by most), and no other order of the sum avoids reading each query's heads once per key.
Rounding follows the dense path: fp32 scores and softmax, probabilities and score gradients rounded to the inputs'
dtype for the products with the keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from modelzoo.deepseek_v4.model.hc_kernels import INTERPRETED
from modelzoo.layers.recompute import ATTENTION_OUTPUT, kept_for_recompute

# key rows per block (the candidates timed on a GPU, the first one under the interpreter) and warps per program
KEY_BLOCKS = [16, 32, 64]


def _tuned(kernel):
    """Autotuned on first use per head count and head_dim, outside any CUDA graph capture; not under the interpreter
    (which cannot time kernels). The backward's atomic adds make a timed run change its output: each candidate
    timing starts from the zeroed gradient (`reset_to_zero`)."""
    if INTERPRETED:
        return kernel
    configs = [triton.Config({"BLOCK_N": rows}, num_warps=warps) for rows in KEY_BLOCKS for warps in (4, 8)]
    reset = ["kv_grad_ptr"] if "kv_grad_ptr" in kernel.arg_names else None
    return triton.autotune(configs, key=["HEADS", "D"], reset_to_zero=reset)(kernel)


def applies(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the kernels take these inputs: CUDA tensors, a power-of-two head_dim of at least 16 (tl.dot's
    smallest), at most 64 heads (a program's rows)."""
    dim = q.shape[-1]
    return q.is_cuda and kv.is_cuda and dim >= 16 and dim & (dim - 1) == 0 and q.shape[2] <= 64


@triton.jit
def _key_rows(query, t, block, seq_len, window, halo, picks_ptr, picks_per_query, BLOCK_N: tl.constexpr):
    """Rows of kv (int64) and whether each is a key, for block `block` of query t's keys: the window's blocks first
    (key positions t - window + 1 .. t at or after -halo: row halo + position), then the picks' (row
    halo + S + entry)."""
    window_blocks = tl.cdiv(window, BLOCK_N)
    in_window = block < window_blocks
    offset = block * BLOCK_N + tl.arange(0, BLOCK_N)
    position = t - window + 1 + offset
    slot = (block - window_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    pick = tl.load(picks_ptr + query * picks_per_query + slot, mask=(slot >= 0) & (slot < picks_per_query),
                   other=-1).to(tl.int64)
    rows = tl.where(in_window, halo + position, halo + seq_len + pick)
    return rows, tl.where(in_window, (offset < window) & (position >= -halo), pick >= 0)


@_tuned
@triton.jit
def _forward(q_ptr, kv_ptr, picks_ptr, sinks_ptr, out_ptr, lse_ptr, seq_len, kv_len, picks_per_query, window, halo,
             scale, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
             BLOCK_N: tl.constexpr):
    query = tl.program_id(0).to(tl.int64)   # batch * seq_len + t
    t = query % seq_len
    kv_rows = kv_ptr + (query // seq_len) * kv_len * D
    heads, dims = tl.arange(0, BLOCK_H), tl.arange(0, D)
    is_head = heads < HEADS
    q = tl.load(q_ptr + (query * HEADS + heads[:, None]) * D + dims[None, :], mask=is_head[:, None], other=0.0)
    peak = tl.load(sinks_ptr + heads, mask=is_head, other=0.0).to(tl.float32)    # the sink is the first logit
    total = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    blocks = tl.cdiv(window, BLOCK_N) + tl.cdiv(picks_per_query, BLOCK_N)
    for block in range(blocks):
        rows, is_key = _key_rows(query, t, block, seq_len, window, halo, picks_ptr, picks_per_query, BLOCK_N)
        keys = tl.load(kv_rows + rows[:, None] * D + dims[None, :], mask=is_key[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale                   # [H, N] fp32
        scores = tl.where(is_key[None, :], scores, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, 1))
        rescale = tl.exp(peak - new_peak)
        probs = tl.exp(scores - new_peak[:, None])
        total = total * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(keys.dtype), keys, input_precision=PRECISION)
        peak = new_peak
    out = acc / total[:, None]
    tl.store(out_ptr + (query * HEADS + heads[:, None]) * D + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=is_head[:, None])
    tl.store(lse_ptr + query * HEADS + heads, peak + tl.log(total), mask=is_head)


@_tuned
@triton.jit
def _backward(q_ptr, kv_ptr, picks_ptr, out_grad_ptr, lse_ptr, delta_ptr, q_grad_ptr, kv_grad_ptr, seq_len, kv_len,
              picks_per_query, window, halo, scale, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    query = tl.program_id(0).to(tl.int64)
    t = query % seq_len
    kv_rows = kv_ptr + (query // seq_len) * kv_len * D
    kv_grad_rows = kv_grad_ptr + (query // seq_len) * kv_len * D
    heads, dims = tl.arange(0, BLOCK_H), tl.arange(0, D)
    is_head = heads < HEADS
    head_rows = (query * HEADS + heads[:, None]) * D + dims[None, :]
    q = tl.load(q_ptr + head_rows, mask=is_head[:, None], other=0.0)
    out_grad = tl.load(out_grad_ptr + head_rows, mask=is_head[:, None], other=0.0)
    lse = tl.load(lse_ptr + query * HEADS + heads, mask=is_head, other=float("inf"))   # padded heads: p = 0
    delta = tl.load(delta_ptr + query * HEADS + heads, mask=is_head, other=0.0)
    q_grad = tl.zeros([BLOCK_H, D], tl.float32)
    blocks = tl.cdiv(window, BLOCK_N) + tl.cdiv(picks_per_query, BLOCK_N)
    for block in range(blocks):
        rows, is_key = _key_rows(query, t, block, seq_len, window, halo, picks_ptr, picks_per_query, BLOCK_N)
        key_offsets = rows[:, None] * D + dims[None, :]
        keys = tl.load(kv_rows + key_offsets, mask=is_key[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
        probs = tl.where(is_key[None, :], tl.exp(scores - lse[:, None]), 0.0)              # [H, N]
        value_grads = tl.dot(out_grad, tl.trans(keys), input_precision=PRECISION)              # dO . v [H, N]
        score_grads = (scale * probs * (value_grads - delta[:, None])).to(keys.dtype)
        q_grad += tl.dot(score_grads, keys, input_precision=PRECISION)
        key_grads = (tl.dot(tl.trans(score_grads), q, input_precision=PRECISION)
                     + tl.dot(tl.trans(probs.to(keys.dtype)), out_grad, input_precision=PRECISION))   # [N, D]
        tl.atomic_add(kv_grad_rows + key_offsets, key_grads, mask=is_key[:, None], sem="relaxed")
    tl.store(q_grad_ptr + head_rows, q_grad.to(q_grad_ptr.dtype.element_ty), mask=is_head[:, None])


def _launch_shape(q: torch.Tensor) -> dict:
    batch, seq_len, heads, dim = q.shape
    # fp32 inputs multiply in fp32 (tl.dot's default on a GPU rounds them to tf32)
    return dict(grid=(batch * seq_len,), HEADS=heads, BLOCK_H=max(16, triton.next_power_of_2(heads)), D=dim,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _attend(q, kv, picks, sinks, scale: float, window: int, halo: int):
    """The forward kernel: output [B, S, h, D] and log-sum-exp [B, S, h] (fp32)."""
    shape = _launch_shape(q)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    extra = {"BLOCK_N": KEY_BLOCKS[0]} if INTERPRETED else {}
    _forward[shape.pop("grid")](q, kv, picks, sinks, out, lse, q.shape[1], kv.shape[1], picks.shape[-1], window, halo,
                                scale, **shape, **extra)
    return out, lse


class SparseSinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, picks, sinks, scale: float, window: int, halo: int):
        # a region that keeps attention outputs gives its recompute the forward's, not another run
        out, lse = kept_for_recompute(lambda: _attend(q, kv, picks, sinks, scale, window, halo), kind=ATTENTION_OUTPUT)
        ctx.save_for_backward(q, kv, picks, sinks, out, lse)
        ctx.scale, ctx.window, ctx.halo = scale, window, halo
        return out

    @staticmethod
    def backward(ctx, out_grad):
        q, kv, picks, sinks, out, lse = ctx.saved_tensors
        out_grad = out_grad.contiguous()
        delta = (out_grad.float() * out.float()).sum(-1)                                  # dO . O [B, S, h]
        sinks_grad = -(torch.exp(sinks.float() - lse) * delta).flatten(0, -2).sum(0)
        q_grad = torch.empty_like(q)
        kv_grad = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        shape = _launch_shape(q)
        extra = {"BLOCK_N": KEY_BLOCKS[0]} if INTERPRETED else {}
        _backward[shape.pop("grid")](q, kv, picks, out_grad, lse, delta, q_grad, kv_grad, q.shape[1], kv.shape[1],
                                     picks.shape[-1], ctx.window, ctx.halo, ctx.scale, **shape, **extra)
        return q_grad, kv_grad.to(kv.dtype), None, sinks_grad.to(sinks.dtype), None, None, None


def sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, scale: float, window: int,
                          picks: torch.Tensor, halo: int = 0) -> torch.Tensor:
    """`window_sink_attention` with picks: q [B, S, h, D] over kv [B, halo + S + C, D] (K = V), each query's window
    keys and its picks [B, S, k] (entry ids, -1 for none) -> [B, S, h, D]."""
    return SparseSinkAttention.apply(q.contiguous(), kv.contiguous(), picks.to(torch.int32).contiguous(),
                                     sinks.float().contiguous(), scale, window, halo)
