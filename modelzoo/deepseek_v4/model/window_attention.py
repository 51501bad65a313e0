"""DeepSeek-V4's sink attention as dense blocks of batched GEMMs (`attention="fast"`).

Every query sees at most `window` keys of the sliding window plus C compressed entries (CSA: the
indexer's top-k of S / 4; HCA: the S / 128 complete windows; sliding layers: none), and all query
heads read one shared K = V head. So the work is small dense blocks, not a sparse pattern: the W
queries of block i against their keys

    [keys of blocks i-1 and i (2W) ; the C compressed entries]        masked per query

and because the K = V head is shared, the heads fold into the GEMMs' rows: per block one
[W * heads, D] x [D, 2W + C] product, which cuBLAS runs near its peak at V4's head_dim 512
(flex_attention's Triton kernels did not: 55 ms of the large benchmark's 184 ms step went to their backward).

Scores are accumulated and kept in fp32 (bf16 inputs, fp32 GEMM output) and the softmax is fp32;
probabilities are rounded to the input dtype only to multiply the values, as flash kernels do. Like
them the backward recomputes the scores from the saved log-sum-exp instead of saving probabilities,
and queries run in chunks of blocks so the transient scores stay under `SCORE_BUDGET` elements.

The sink is one more logit per head that takes probability mass and adds no value:
softmax([s, sink]) . v, and d(sink) = -sum over queries of p_sink * (dO . O).
"""

from __future__ import annotations

import torch

from modelzoo.attention import in_window
from modelzoo.deepseek_v4.model.layers import matmul_fp32
from modelzoo.fused import fused

SCORE_BUDGET = 2**27   # score elements per chunk of queries (512 MiB in fp32)


def _logits(scores, visible, scale: float):
    """Unscaled fp32 scores -> the softmax's logits: scaled, -inf where not visible (forward and backward alike)."""
    return (scores * scale).masked_fill(~visible, float("-inf"))


@fused
def _probabilities(scores, visible, sinks, scale: float, dtype: torch.dtype):
    """Scores [B, n, W, h, keys] (fp32, unscaled) -> probabilities (`dtype`) and log-sum-exp [B, n, W, h] (fp32)."""
    scores = _logits(scores, visible, scale)
    sink = sinks.float()
    peak = torch.maximum(scores.amax(-1), sink)
    lse = peak + torch.log(torch.exp(scores - peak.unsqueeze(-1)).sum(-1) + torch.exp(sink - peak))
    return torch.exp(scores - lse.unsqueeze(-1)).to(dtype), lse


@fused
def _output_terms(out_grad, out, lse, sinks):
    """dO . O per row [B, n, W, h] and the sinks' gradient over these rows, -sum p_sink * (dO . O) [h]."""
    delta = (out_grad.float() * out.float()).sum(-1).view(lse.shape)
    return delta, -(torch.exp(sinks.float() - lse) * delta).flatten(0, -2).sum(0)


@fused
def _score_gradients(scores, visible, lse, value_grads, delta, scale: float, dtype: torch.dtype):
    """-> d(loss)/d(unscaled score) = scale * p * (dO . v - dO . O) and p, both in `dtype` for the GEMMs.

    p is recomputed from the scores and the saved log-sum-exp, in fp32 as in the forward.
    """
    probs = torch.exp(_logits(scores, visible, scale) - lse.unsqueeze(-1))
    return (scale * probs * (value_grads - delta.unsqueeze(-1))).to(dtype), probs.to(dtype)


class _Chunk:
    """Query blocks [first, last) of one call: their query rows, keys and mask.

    q is [B, S, h, D] with S a multiple of W; kv is [B, W + S, D], padded with W zero rows in front so
    that block i's window keys are its rows iW .. iW + 2W; compressed is [B, C, D] or None.
    """

    def __init__(self, q, kv, compressed, compressed_visible, window, first, last):
        batch, _, heads, dim = q.shape
        self.batch, self.heads, self.blocks, self.window = batch, heads, last - first, window
        self.rows_slice = slice(first * window, last * window)
        self.q_rows = self.rows(q)                                                         # [B * n, W * h, D]
        blocks = kv[:, first * window:(last + 1) * window].unfold(1, 2 * window, window).transpose(-1, -2)
        query = torch.arange(first * window, last * window, device=q.device).view(-1, window, 1)
        key = query[:, :1] - window + torch.arange(2 * window, device=q.device)            # [n, 1, 2W]
        visible = (in_window(query, key, window) & (key >= 0)).view(1, self.blocks, window, 1, -1)
        if compressed is not None:
            blocks = torch.cat([blocks, compressed.unsqueeze(1).expand(-1, self.blocks, -1, -1)], dim=2)
            compressed_visible = compressed_visible[:, self.rows_slice].view(-1, self.blocks, window, 1,
                                                                              compressed.shape[1])
            visible = torch.cat([visible.expand(compressed_visible.shape[0], -1, -1, -1, -1), compressed_visible], -1)
        self.keys = blocks.reshape(batch * self.blocks, -1, dim)                           # [B * n, 2W + C, D]
        self.visible = visible

    def rows(self, tensor):
        """[B, S, h, D] -> this chunk's [B * n, W * h, D] (heads folded into the rows)."""
        return tensor[:, self.rows_slice].reshape(self.batch * self.blocks, self.window * self.heads, -1)

    def per_query(self, tensor):
        """[B, S, h] -> this chunk's [B, n, W, h]."""
        return tensor[:, self.rows_slice].view(self.batch, self.blocks, self.window, self.heads)

    def blocked(self, tensor):
        """[B * n, W * h, ...] -> [B, n, W, h, ...]."""
        return tensor.view(self.batch, self.blocks, self.window, self.heads, *tensor.shape[2:])

    def scores(self):
        return self.blocked(matmul_fp32(self.q_rows, self.keys.transpose(1, 2)))

    def add_key_grads(self, kv_grad, compressed_grad, keys_grad):
        """keys_grad [B * n, 2W + C, D]: overlap-add the window halves into kv's rows, sum the compressed over blocks."""
        window = self.window
        keys_grad = keys_grad.view(self.batch, self.blocks, -1, keys_grad.shape[-1])
        start, stop = self.rows_slice.start, self.rows_slice.stop
        kv_grad[:, start:stop] += keys_grad[:, :, :window].flatten(1, 2)
        kv_grad[:, start + window:stop + window] += keys_grad[:, :, window:2 * window].flatten(1, 2)
        if compressed_grad is not None:
            compressed_grad += keys_grad[:, :, 2 * window:].sum(1)


def _chunks(q, kv, compressed, compressed_visible, window):
    blocks = q.shape[1] // window
    keys = 2 * window + (0 if compressed is None else compressed.shape[1])
    per_chunk = max(1, SCORE_BUDGET // (q.shape[0] * window * q.shape[2] * keys))
    for first in range(0, blocks, per_chunk):
        yield _Chunk(q, kv, compressed, compressed_visible, window, first, min(first + per_chunk, blocks))


class _WindowSinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, compressed, compressed_visible, sinks, scale, window):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for chunk in _chunks(q, kv, compressed, compressed_visible, window):
            probs, lse_chunk = _probabilities(chunk.scores(), chunk.visible, sinks, scale, q.dtype)
            out[:, chunk.rows_slice] = chunk.blocked(torch.bmm(probs.flatten(0, 1).flatten(1, 2), chunk.keys)).flatten(1, 2)
            lse[:, chunk.rows_slice] = lse_chunk.flatten(1, 2)
        ctx.save_for_backward(q, kv, compressed, compressed_visible, sinks, out, lse)
        ctx.scale, ctx.window = scale, window
        return out

    @staticmethod
    def backward(ctx, out_grad):
        q, kv, compressed, compressed_visible, sinks, out, lse = ctx.saved_tensors
        scale, dtype = ctx.scale, q.dtype
        out_grad = out_grad.contiguous()
        q_grad = torch.empty_like(q)
        kv_grad = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        compressed_grad = None if compressed is None else torch.zeros(
            compressed.shape, dtype=torch.float32, device=q.device)
        sinks_grad = torch.zeros_like(sinks, dtype=torch.float32)
        for chunk in _chunks(q, kv, compressed, compressed_visible, ctx.window):
            lse_chunk = chunk.per_query(lse)
            rows_grad = chunk.rows(out_grad)
            delta, sinks_grad_chunk = _output_terms(rows_grad, chunk.rows(out), lse_chunk, sinks)
            sinks_grad += sinks_grad_chunk
            value_grads = chunk.blocked(matmul_fp32(rows_grad, chunk.keys.transpose(1, 2)))
            dscores, probs = _score_gradients(chunk.scores(), chunk.visible, lse_chunk, value_grads, delta, scale, dtype)
            dscores, probs = dscores.flatten(0, 1).flatten(1, 2), probs.flatten(0, 1).flatten(1, 2)
            q_grad[:, chunk.rows_slice] = chunk.blocked(torch.bmm(dscores, chunk.keys)).flatten(1, 2)
            keys_grad = matmul_fp32(dscores.transpose(1, 2), chunk.q_rows) + matmul_fp32(probs.transpose(1, 2), rows_grad)
            chunk.add_key_grads(kv_grad, compressed_grad, keys_grad)
        compressed_grad = None if compressed is None else compressed_grad.to(compressed.dtype)
        return q_grad, kv_grad.to(kv.dtype), compressed_grad, None, sinks_grad.to(sinks.dtype), None, None


def window_sink_attention(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, scale: float, window: int,
                          compressed_visible: torch.Tensor | None = None) -> torch.Tensor:
    """Sink attention of q [B, S, h, D] over kv [B, S + C, D] (K = V) -> [B, S, h, D].

    Query t sees window keys t - window < s <= t and the compressed entries c (kv row S + c) where
    `compressed_visible` [B or 1, S, C] is True. The same result as `eager_sink_attention`.
    """
    seq_len = q.shape[1]
    pad = -seq_len % window
    compressed = None
    if kv.shape[1] > seq_len:
        compressed = kv[:, seq_len:]
        if pad:
            compressed_visible = torch.nn.functional.pad(compressed_visible, (0, 0, 0, pad))
    if pad:  # padded queries are zeros whose outputs are dropped; padded keys follow every real query
        q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad))
    window_kv = torch.nn.functional.pad(kv[:, :seq_len], (0, 0, window, pad))               # [B, W + S', D]
    out = _WindowSinkAttention.apply(q.contiguous(), window_kv, compressed, compressed_visible, sinks, scale, window)
    return out[:, :seq_len]
