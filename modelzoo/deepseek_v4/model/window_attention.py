"""DeepSeek-V4's sink attention as dense blocks of batched GEMMs (`attention="fast"`).

Every query sees at most `window` keys of the sliding window plus C compressed entries (CSA: the
indexer's top-k of S / 4; HCA: the S / 128 complete windows; sliding layers: none), and all query
heads read one shared K = V head. So the work is small dense blocks, not a sparse pattern:

    queries of block i (W = window rows)  x  keys of blocks i-1 and i (2W)    window part
    every query                           x  the C compressed entries         compressed part

and because the K = V head is shared, the heads fold into the GEMMs' rows ([W * heads, D] x [D, 2W]
per block; [S * heads, D] x [D, C]), which cuBLAS runs near its peak at V4's head_dim 512 (flex_attention's
Triton kernels spilled at that width: 55 ms of the large benchmark's 184 ms step went to their backward).

The scores are accumulated and kept in fp32 (bf16 inputs, fp32 GEMM output), the softmax is fp32, and
probabilities are rounded to the input dtype only to multiply the values, as flash kernels do. Like them
the backward recomputes the scores from the saved log-sum-exp instead of saving the probabilities;
queries run in chunks of blocks so the transient scores stay under `SCORE_BUDGET` elements at any length.

The sink is one more logit per head that takes probability mass and adds no value:
softmax([s, sink]) . v, and d(sink) = -sum over queries of p_sink * (dO . O).
"""

from __future__ import annotations

import torch

from modelzoo.fused import fused

SCORE_BUDGET = 2**27   # score elements per chunk of queries (512 MiB in fp32)


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a @ b accumulated and returned in fp32 (on CUDA without fp32 copies of bf16 inputs)."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


@fused
def _probabilities(window_scores, compressed_scores, window_visible, compressed_visible, sinks, scale: float,
                   dtype: torch.dtype):
    """Scores [B, n, W, h, keys] (fp32, unscaled) -> window and compressed probabilities (`dtype`), lse [B, n, W, h]."""
    window_scores = (window_scores * scale).masked_fill(~window_visible, float("-inf"))
    sink = sinks.float()
    peak = torch.maximum(window_scores.amax(-1), sink)
    total = torch.exp(window_scores - peak.unsqueeze(-1)).sum(-1) + torch.exp(sink - peak)
    if compressed_scores is not None:
        compressed_scores = (compressed_scores * scale).masked_fill(~compressed_visible, float("-inf"))
        peak_compressed = torch.maximum(peak, compressed_scores.amax(-1))
        total = total * torch.exp(peak - peak_compressed) + torch.exp(
            compressed_scores - peak_compressed.unsqueeze(-1)).sum(-1)
        peak = peak_compressed
    lse = peak + torch.log(total)
    window_probs = torch.exp(window_scores - lse.unsqueeze(-1)).to(dtype)
    if compressed_scores is None:
        return window_probs, None, lse
    return window_probs, torch.exp(compressed_scores - lse.unsqueeze(-1)).to(dtype), lse


@fused
def _score_gradients(scores, visible, lse, value_grads, delta, scale: float, dtype: torch.dtype):
    """-> d(loss)/d(unscaled score) = scale * p * (dO . v - dO . O) and p, both in `dtype` for the GEMMs.

    p is recomputed from the scores and the saved log-sum-exp (fp32), as in the forward.
    """
    probs = torch.exp((scores * scale).masked_fill(~visible, float("-inf")) - lse.unsqueeze(-1))
    return (scale * probs * (value_grads - delta.unsqueeze(-1))).to(dtype), probs.to(dtype)


class _WindowSinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, compressed, compressed_visible, sinks, scale, window):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for chunk in _chunks(q, kv, compressed, compressed_visible, window):
            window_probs, compressed_probs, lse_chunk = _probabilities(
                *chunk.scores(), chunk.window_visible, chunk.compressed_visible, sinks, scale, q.dtype)
            chunk.store(out, chunk.values(window_probs, compressed_probs, q.dtype))
            chunk.store(lse, lse_chunk)
        ctx.save_for_backward(q, kv, compressed, compressed_visible, sinks, out, lse)
        ctx.scale, ctx.window = scale, window
        return out

    @staticmethod
    def backward(ctx, out_grad):
        q, kv, compressed, compressed_visible, sinks, out, lse = ctx.saved_tensors
        scale, dtype = ctx.scale, q.dtype
        q_grad = torch.empty_like(q)
        kv_grad = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        compressed_grad = None if compressed is None else torch.zeros(
            compressed.shape, dtype=torch.float32, device=q.device)
        sinks_grad = torch.zeros_like(sinks, dtype=torch.float32)
        out_grad = out_grad.contiguous()
        for chunk in _chunks(q, kv, compressed, compressed_visible, ctx.window):
            window_scores, compressed_scores = chunk.scores()
            lse_chunk = chunk.take(lse)
            rows_grad = chunk.rows(out_grad)
            delta = (rows_grad.float() * chunk.rows(out).float()).sum(-1).view(lse_chunk.shape)
            sinks_grad -= (torch.exp(sinks.float() - lse_chunk) * delta).flatten(0, -2).sum(0)
            window_dscores, window_probs = _score_gradients(
                window_scores, chunk.window_visible, lse_chunk, chunk.window_value_grads(rows_grad), delta, scale,
                dtype)
            q_rows_grad, kv_blocks_grad = chunk.window_grads(window_dscores, window_probs, rows_grad)
            if compressed is not None:
                compressed_dscores, compressed_probs = _score_gradients(
                    compressed_scores, chunk.compressed_visible, lse_chunk,
                    chunk.compressed_value_grads(rows_grad), delta, scale, dtype)
                q_rows_grad += chunk.compressed_query_grads(compressed_dscores)
                compressed_grad += chunk.compressed_grads(compressed_dscores, compressed_probs, rows_grad)
            chunk.store(q_grad, q_rows_grad.to(dtype))
            chunk.add_window_grads(kv_grad, kv_blocks_grad)
        compressed_grad = None if compressed is None else compressed_grad.to(compressed.dtype)
        return q_grad, kv_grad.to(kv.dtype), compressed_grad, None, sinks_grad.to(sinks.dtype), None, None


class _Chunk:
    """Query blocks [first, last) of one call: their rows, key blocks and masks, and the GEMMs on them.

    q is [B, S, h, D] with S a multiple of W; kv is [B, W + S, D], padded with W zero rows in front so
    that block i's keys are rows iW .. iW + 2W of it.
    """

    def __init__(self, q, kv, compressed, compressed_visible, window, first, last):
        batch, _, heads, dim = q.shape
        self.batch, self.heads, self.blocks, self.window = batch, heads, last - first, window
        self.first_row, self.last_row = first * window, last * window
        self.q_rows = self.rows(q)                                                         # [B * n, W * h, D]
        # key block j = rows (first + j) W .. (first + j + 2) W of the padded kv: [B * n, 2W, D]
        self.key_blocks = kv[:, self.first_row:self.last_row + window].unfold(1, 2 * window, window) \
            .transpose(-1, -2).reshape(-1, 2 * window, dim)
        self.compressed = compressed
        query = torch.arange(self.first_row, self.last_row, device=q.device).view(-1, window, 1)
        key = (query[:, :1] - window + torch.arange(2 * window, device=q.device))            # [n, 1, 2W]
        visible = (key <= query) & (key > query - window) & (key >= 0)
        self.window_visible = visible.view(1, self.blocks, window, 1, 2 * window)
        if compressed is not None:
            self.compressed_visible = compressed_visible[:, self.first_row:self.last_row].view(
                compressed_visible.shape[0], self.blocks, window, 1, -1)
        else:
            self.compressed_visible = None

    def rows(self, tensor):
        """[B, S, h, D] -> this chunk's [B * n, W * h, D] (heads folded into the rows)."""
        return tensor[:, self.first_row:self.last_row].reshape(self.batch * self.blocks, -1, tensor.shape[-1])

    def _per_sequence(self, rows):
        return rows.view(self.batch, -1, rows.shape[-1])                                  # [B, n * W * h, D]

    def _score_shape(self, scores):
        return scores.view(self.batch, self.blocks, self.window, self.heads, -1)

    def take(self, tensor):
        return tensor[:, self.first_row:self.last_row].view(self.batch, self.blocks, self.window, self.heads)

    def store(self, target, value):
        target[:, self.first_row:self.last_row] = value.reshape(target[:, self.first_row:self.last_row].shape)

    def scores(self):
        window_scores = self._score_shape(_mm32(self.q_rows, self.key_blocks.transpose(1, 2)))
        if self.compressed is None:
            return window_scores, None
        compressed_scores = _mm32(self._per_sequence(self.q_rows), self.compressed.transpose(1, 2))
        return window_scores, self._score_shape(compressed_scores)

    def values(self, window_probs, compressed_probs, dtype):
        out = _mm32(window_probs.reshape(self.batch * self.blocks, -1, 2 * self.window), self.key_blocks)
        if compressed_probs is not None:
            out = self._per_sequence(out) + _mm32(
                compressed_probs.reshape(self.batch, -1, self.compressed.shape[1]), self.compressed)
        return out.to(dtype)

    def window_value_grads(self, rows_grad):
        return self._score_shape(_mm32(rows_grad, self.key_blocks.transpose(1, 2)))

    def compressed_value_grads(self, rows_grad):
        return self._score_shape(_mm32(self._per_sequence(rows_grad), self.compressed.transpose(1, 2)))

    def window_grads(self, dscores, probs, rows_grad):
        """-> d(q rows) [B, n * W * h, D] fp32 and d(key blocks) [B * n, 2W, D] fp32 (K = V: both uses)."""
        dscores = dscores.view(self.batch * self.blocks, -1, 2 * self.window)
        probs = probs.view(self.batch * self.blocks, -1, 2 * self.window)
        q_grad = self._per_sequence(_mm32(dscores, self.key_blocks))
        key_grad = _mm32(dscores.transpose(1, 2), self.q_rows) + _mm32(probs.transpose(1, 2), rows_grad)
        return q_grad, key_grad

    def compressed_query_grads(self, dscores):
        return _mm32(dscores.view(self.batch, -1, self.compressed.shape[1]), self.compressed)

    def compressed_grads(self, dscores, probs, rows_grad):
        dscores = dscores.view(self.batch, -1, self.compressed.shape[1])
        probs = probs.view(self.batch, -1, self.compressed.shape[1])
        return (_mm32(dscores.transpose(1, 2), self._per_sequence(self.q_rows))
                + _mm32(probs.transpose(1, 2), self._per_sequence(rows_grad)))

    def add_window_grads(self, kv_grad, key_grad):
        """Overlap-add the key blocks' gradients into the padded kv's: block j's halves are rows (first + j) W and + W."""
        halves = key_grad.view(self.batch, self.blocks, 2, self.window, -1)
        kv_grad[:, self.first_row:self.last_row] += halves[:, :, 0].flatten(1, 2)
        kv_grad[:, self.first_row + self.window:self.last_row + self.window] += halves[:, :, 1].flatten(1, 2)


def _chunks(q, kv, compressed, compressed_visible, window):
    blocks = q.shape[1] // window
    keys = 2 * window + (0 if compressed is None else compressed.shape[1])
    per_chunk = max(1, SCORE_BUDGET // (q.shape[0] * window * q.shape[2] * keys))
    for first in range(0, blocks, per_chunk):
        yield _Chunk(q, kv, compressed, compressed_visible, window, first, min(first + per_chunk, blocks))


def window_sink_attention(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, scale: float, window: int,
                          compressed_visible: torch.Tensor | None = None) -> torch.Tensor:
    """Sink attention of q [B, h, S, D] over kv [B, 1, S + C, D] (K = V) -> [B, S, h, D].

    Query t sees window keys t - window < s <= t and the compressed entries c (kv row S + c) where
    `compressed_visible` [B or 1, S, C] is True. The same result as `eager_sink_attention`.
    """
    batch, heads, seq_len, dim = q.shape
    compressed_len = kv.shape[2] - seq_len
    padded_len = -(-seq_len // window) * window
    pad = padded_len - seq_len
    # padded queries are zeros whose outputs are dropped; padded keys follow every real query
    q = torch.nn.functional.pad(q.transpose(1, 2), (0, 0, 0, 0, 0, pad))          # [B, S', h, D]
    window_kv = torch.nn.functional.pad(kv[:, 0, :seq_len], (0, 0, window, pad))  # [B, W + S', D]
    compressed = None
    if compressed_len:
        compressed = kv[:, 0, seq_len:]
        compressed_visible = torch.nn.functional.pad(compressed_visible, (0, 0, 0, pad))
    out = _WindowSinkAttention.apply(q, window_kv, compressed, compressed_visible, sinks, scale, window)
    return out[:, :seq_len]
