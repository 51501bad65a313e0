"""DeepSeek-V4's sink attention as dense blocks of batched GEMMs (`attention="fast"`).

Every query sees at most `window` keys of the sliding window plus some compressed entries: on CSA layers the
indexer's top-k picks (k of S / 4), on HCA layers every complete window before it (S / 128), on sliding layers
none. All query heads read one shared K = V head, so the heads fold into the GEMMs' rows:

    window keys    the W queries of block i against the keys of blocks i-1 and i (2W): per block one
                   [W * heads, D] x [D, 2W] product, which cuBLAS runs near its peak at V4's head_dim 512
                   (flex_attention's Triton kernels did not: 55 ms of the large benchmark's 184 ms step went to
                   their backward);
    entries        the compressed entries complete before a chunk's last query (rounded up to a quarter of the
                   C, C_n of them) join its blocks' keys ([D, 2W + C_n]), masked per query: on HCA layers by the
                   rule "entry c is complete", c < (t + 1) // ratio, on CSA layers by the query's picks (a pick is
                   always a complete entry). The mask is built per chunk of queries, never [S, C] for the
                   sequence, so memory stays linear in S; the work is O(S x C) = O(S^2 / ratio) (5/8 of S x C),
                   since a query's CSA picks are scored against every entry complete so far and masked. On a GPU the
                   CSA layers run `sparse_attention_kernels.py` instead (each query over its own window keys and
                   picks, O(S x (window + k))); these blocks are their CPU path and the sliding and HCA layers'.

Scores are accumulated and kept in fp32 (bf16 inputs, fp32 GEMM output) and the softmax is fp32 over the
window keys, the entries and the sink together; probabilities are rounded to the input dtype only to multiply
the values, as flash kernels do. Like them the backward recomputes the scores from the saved log-sum-exp instead
of saving probabilities, and queries run in chunks of blocks so the transient scores and masks stay
under `SCORE_BUDGET` elements.

The sink is one more logit per head that takes probability mass and adds no value:
softmax([s, sink]) . v, and d(sink) = -sum over queries of p_sink * (dO . O).
"""

from __future__ import annotations

import dataclasses

import torch

from modelzoo.layers.attention import in_window
from modelzoo.deepseek_v4.model.layers import matmul_fp32
from modelzoo.layers.fused import fused
from modelzoo.layers.recompute import ATTENTION_OUTPUT, kept_for_recompute

SCORE_BUDGET = 2**27   # score elements per chunk of queries (512 MiB in fp32)
ENTRY_BUCKETS = 4      # distinct counts of compressed entries the chunks of one call score against
# shapes each fused piece is compiled for in one process (torch's default, 8, is spent by one long row's sliding,
# HCA and CSA chunks; past it a new shape runs the eager ops, ~25% slower per step at 65536 tokens)
FUSED_SHAPES = 32


def _logits(scores, visible, scale: float):
    """Unscaled fp32 scores -> the softmax's logits: scaled, -inf where not visible (forward and backward alike)."""
    return (scores * scale).masked_fill(~visible, float("-inf"))


@fused(shapes=FUSED_SHAPES)
def _probabilities(scores, visible, sinks, scale: float, dtype: torch.dtype):
    """Scores [B, n, W, h, keys] (fp32, unscaled) -> probabilities (`dtype`) and log-sum-exp [B, n, W, h] (fp32)."""
    scores = _logits(scores, visible, scale)
    sink = sinks.float()
    peak = torch.maximum(scores.amax(-1), sink)
    lse = peak + torch.log(torch.exp(scores - peak.unsqueeze(-1)).sum(-1) + torch.exp(sink - peak))
    return torch.exp(scores - lse.unsqueeze(-1)).to(dtype), lse


@fused(shapes=FUSED_SHAPES)
def _output_terms(out_grad, out, lse, sinks):
    """dO . O per row [B, n, W, h] and the sinks' gradient over these rows, -sum p_sink * (dO . O) [h]."""
    delta = (out_grad.float() * out.float()).sum(-1).view(lse.shape)
    return delta, -(torch.exp(sinks.float() - lse) * delta).flatten(0, -2).sum(0)


@fused(shapes=FUSED_SHAPES)
def _score_gradients(scores, visible, lse, value_grads, delta, scale: float, dtype: torch.dtype):
    """-> d(loss)/d(unscaled score) = scale * p * (dO . v - dO . O) and p, both in `dtype` for the GEMMs.

    p is recomputed from the scores and the saved log-sum-exp, in fp32 as in the forward.
    """
    probs = torch.exp(_logits(scores, visible, scale) - lse.unsqueeze(-1))
    return (scale * probs * (value_grads - delta.unsqueeze(-1))).to(dtype), probs.to(dtype)


class _Chunk:
    """Query blocks [first, last) of one call: their query rows, keys and mask.

    q is [B, S, h, D] with S a multiple of W; kv is [B, W + S, D], padded with W zero rows in front so that
    block i's window keys are its rows iW .. iW + 2W; compressed is [B, C, D] or None, and its first `entries`
    rows (those any query of the chunk can see) join every block's keys: `keys` [B * n, 2W (+ entries), D].
    Which entries each query sees (its picks, or the complete windows) is built for this chunk's queries only,
    [B, n, W, 1, entries]: never for the whole sequence.
    """

    def __init__(self, q, kv, compressed, picks, ratio, window, first, last, first_position=0, halo=0):
        batch, _, heads, dim = q.shape
        self.batch, self.heads, self.blocks, self.window = batch, heads, last - first, window
        self.entries = _entries_seen(compressed, ratio, window, last, first_position)
        self.rows_slice = slice(first * window, last * window)
        self.q_rows = self.rows(q)                                                         # [B * n, W * h, D]
        blocks = kv[:, first * window:(last + 1) * window].unfold(1, 2 * window, window).transpose(-1, -2)
        query = torch.arange(first * window, last * window, device=q.device).view(-1, window, 1)
        key = query[:, :1] - window + torch.arange(2 * window, device=q.device)            # [n, 1, 2W]
        visible = (in_window(query, key, window) & (key >= -halo)).view(1, self.blocks, window, 1, -1)
        if compressed is not None:
            entries = self.entries
            blocks = torch.cat([blocks, compressed[:, :entries].unsqueeze(1).expand(-1, self.blocks, -1, -1)], dim=2)
            if picks is None:  # HCA: every complete window
                seen = (torch.arange(entries, device=q.device) < (query + first_position + 1) // ratio)[None]
            else:              # CSA: the query's top-k (-1: an empty slot, scattered past the last entry)
                chunk_picks = picks[:, self.rows_slice]
                seen = torch.zeros(*chunk_picks.shape[:2], entries + 1, dtype=torch.bool, device=q.device)
                seen.scatter_(-1, torch.where((chunk_picks >= 0) & (chunk_picks < entries), chunk_picks, entries), True)
                seen = seen[..., :entries]
            seen = seen.reshape(seen.shape[0], self.blocks, window, 1, entries)
            visible = torch.cat([visible.expand(seen.shape[0], -1, -1, -1, -1), seen], -1)
        self.keys = blocks.reshape(batch * self.blocks, -1, dim)                           # [B * n, 2W (+ C), D]
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

    def weighted_keys(self, weights):
        """weights [B * n, W * h, keys] (in the keys' dtype) -> sum over keys of weight x key: [B, n * W, h, D]."""
        return self.blocked(torch.bmm(weights, self.keys)).flatten(1, 2)

    def add_key_grads(self, kv_grad, compressed_grad, keys_grad):
        """keys_grad [B * n, 2W + entries, D]: overlap-add the window halves into kv's rows, sum the entries over
        blocks into the first `entries` rows of compressed_grad."""
        window = self.window
        keys_grad = keys_grad.view(self.batch, self.blocks, -1, keys_grad.shape[-1])
        start, stop = self.rows_slice.start, self.rows_slice.stop
        kv_grad[:, start:stop] += keys_grad[:, :, :window].flatten(1, 2)
        kv_grad[:, start + window:stop + window] += keys_grad[:, :, window:2 * window].flatten(1, 2)
        if compressed_grad is not None:
            compressed_grad[:, :self.entries] += keys_grad[:, :, 2 * window:].sum(1)


def _entries_seen(compressed, ratio: int | None, window: int, last: int, first_position: int) -> int:
    """How many compressed entries the queries of blocks before `last` are scored against: at least those complete
    at the last query, (first_position + last * W) // ratio (a causal limit CSA picks keep too), rounded up to a
    multiple of C / ENTRY_BUCKETS so that the chunks of a sequence have few distinct shapes (each shape is one
    compilation of the fused softmax pieces); all C without a ratio."""
    if compressed is None:
        return 0
    entries = compressed.shape[1]
    if ratio is None:
        return entries
    complete, bucket = (first_position + last * window) // ratio, -(-entries // ENTRY_BUCKETS)
    return min(entries, -(-complete // bucket) * bucket)


def _chunks(q, kv, compressed, picks, ratio, window, first_position, halo):
    blocks = q.shape[1] // window
    keys = 2 * window + (0 if compressed is None else compressed.shape[1])
    per_chunk = max(1, SCORE_BUDGET // (q.shape[0] * window * q.shape[2] * keys))
    for first in range(0, blocks, per_chunk):
        yield _Chunk(q, kv, compressed, picks, ratio, window, first, min(first + per_chunk, blocks), first_position,
                     halo)


def _attend(q, kv, compressed, picks, sinks, scale, window, ratio, first_position, halo):
    """The forward's output [B, S, h, D] and log-sum-exp [B, S, h] (fp32), chunk by chunk."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for chunk in _chunks(q, kv, compressed, picks, ratio, window, first_position, halo):
        probs, lse_chunk = _probabilities(chunk.scores(), chunk.visible, sinks, scale, q.dtype)
        out[:, chunk.rows_slice] = chunk.weighted_keys(probs.flatten(0, 1).flatten(1, 2))
        lse[:, chunk.rows_slice] = lse_chunk.flatten(1, 2)
    return out, lse


class _WindowSinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, compressed, picks, sinks, scale, window, ratio, first_position, halo):
        # a region that keeps attention outputs gives its recompute the forward's, not another run
        out, lse = kept_for_recompute(
            lambda: _attend(q, kv, compressed, picks, sinks, scale, window, ratio, first_position, halo),
            kind=ATTENTION_OUTPUT)
        ctx.save_for_backward(q, kv, compressed, picks, sinks, out, lse)
        ctx.scale, ctx.window, ctx.ratio, ctx.first_position, ctx.halo = scale, window, ratio, first_position, halo
        return out

    @staticmethod
    def backward(ctx, out_grad):
        q, kv, compressed, picks, sinks, out, lse = ctx.saved_tensors
        scale, dtype = ctx.scale, q.dtype
        out_grad = out_grad.contiguous()
        q_grad = torch.empty_like(q)
        kv_grad = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        compressed_grad = None if compressed is None else torch.zeros(
            compressed.shape, dtype=torch.float32, device=q.device)
        sinks_grad = torch.zeros_like(sinks, dtype=torch.float32)
        for chunk in _chunks(q, kv, compressed, picks, ctx.ratio, ctx.window, ctx.first_position, ctx.halo):
            lse_chunk = chunk.per_query(lse)
            rows_grad = chunk.rows(out_grad)
            delta, sinks_grad_chunk = _output_terms(rows_grad, chunk.rows(out), lse_chunk, sinks)
            sinks_grad += sinks_grad_chunk
            value_grads = chunk.blocked(matmul_fp32(rows_grad, chunk.keys.transpose(1, 2)))
            dscores, probs = _score_gradients(chunk.scores(), chunk.visible, lse_chunk, value_grads, delta, scale, dtype)
            dscores, probs = dscores.flatten(0, 1).flatten(1, 2), probs.flatten(0, 1).flatten(1, 2)
            q_grad[:, chunk.rows_slice] = chunk.weighted_keys(dscores)
            keys_grad = matmul_fp32(dscores.transpose(1, 2), chunk.q_rows) + matmul_fp32(probs.transpose(1, 2), rows_grad)
            chunk.add_key_grads(kv_grad, compressed_grad, keys_grad)
        compressed_grad = None if compressed is None else compressed_grad.to(compressed.dtype)
        return (q_grad, kv_grad.to(kv.dtype), compressed_grad, None, sinks_grad.to(sinks.dtype), None, None, None,
                None, None)


def _sparse_kernels(q: torch.Tensor, kv: torch.Tensor):
    """The CSA kernels' module (each query over its own window keys and picks) where they apply, else None."""
    if not q.is_cuda:
        return None
    from modelzoo.deepseek_v4.model import sparse_attention_kernels
    return sparse_attention_kernels if sparse_attention_kernels.applies(q, kv) else None


def window_sink_attention(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, scale: float, window: int,
                          picks: torch.Tensor | None = None, ratio: int | None = None, first_position: int = 0,
                          halo: int = 0) -> torch.Tensor:
    """Sink attention of q [B, S, h, D] over kv [B, halo + S + C, D] (K = V) -> [B, S, h, D], token t at position
    first_position + t of its sequence.

    Query t sees the window keys t - window < s <= t and, of the C compressed entries (kv rows halo + S + c), those
    in `picks` [B, S, k] (entry ids, -1 for none; CSA) or, without picks, the complete windows
    c < (first_position + t + 1) // ratio (HCA). Given both picks and the ratio, picks must be complete windows
    (the indexer's are): entries past a chunk's last complete one are not scored. kv's first `halo` rows (< window)
    are the window keys just before the queries (under context parallelism, where a rank's run of a sequence starts
    past its first token). The same result as `eager_sink_attention` with that mask.
    """
    seq_len = q.shape[1]
    if not 0 <= halo < window:
        raise ValueError(f"window_sink_attention: halo {halo} must be at least 0 and less than the window {window}")
    pad = -seq_len % window
    compressed = None
    if kv.shape[1] > halo + seq_len:
        compressed = kv[:, halo + seq_len:]
        if picks is None and ratio is None:
            raise ValueError("window_sink_attention: compressed entries need the query's picks or the window ratio")
    if picks is not None and (compressed is None or picks.shape[-1] == 0):
        compressed, picks = None, None   # nothing was picked: a sequence shorter than one compressed window
    kernels = _sparse_kernels(q, kv) if picks is not None else None
    if kernels is not None:
        return kernels.sparse_sink_attention(q, kv, sinks, scale, window, picks, halo)
    if picks is not None and pad:
        picks = torch.nn.functional.pad(picks, (0, 0, 0, pad), value=-1)
    if pad:  # padded queries are zeros whose outputs are dropped; padded keys follow every real query
        q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad))
    window_kv = torch.nn.functional.pad(kv[:, :halo + seq_len], (0, 0, window - halo, pad))   # [B, W + S', D]
    out = _WindowSinkAttention.apply(q.contiguous(), window_kv, compressed, picks, sinks, scale, window, ratio,
                                     first_position, halo)
    return out[:, :seq_len]


@dataclasses.dataclass
class QueryRun:
    """A run of consecutive queries of one sequence, for `attend_runs`: their rows of q.flatten(0, 1), the rows of
    kv.flatten(0, 1) they attend (the halo and window keys, then their sequence's compressed entries), and
    `window_sink_attention`'s picks [1, n, k] (ids into those entries), ratio, first position and halo."""

    queries: torch.Tensor
    keys: torch.Tensor
    picks: torch.Tensor | None
    ratio: int | None
    position: int
    halo: int


def attend_runs(q: torch.Tensor, kv: torch.Tensor, runs: list[QueryRun], sinks: torch.Tensor, scale: float,
                window: int) -> torch.Tensor:
    """`window_sink_attention` of each run of queries over its own keys: q [B, S, h, D], kv [B, K, D] ->
    [B, S, h, D], zeros at queries of no run (padding). Every run's queries and keys are gathered by one
    index_select each and the outputs placed by one index_copy: slicing them run by run would make each run's
    backward write a gradient the size of the whole batch (a packed row of 16 sequences spent more time on those
    than on its attention)."""
    if not runs:
        return torch.zeros_like(q)
    query_index = torch.cat([run.queries for run in runs]).to(q.device, non_blocking=True)
    key_index = torch.cat([run.keys for run in runs]).to(q.device, non_blocking=True)
    queries = q.flatten(0, 1).index_select(0, query_index).split([len(run.queries) for run in runs])
    keys = kv.flatten(0, 1).index_select(0, key_index).split([len(run.keys) for run in runs])
    outputs = [window_sink_attention(run_queries[None], run_keys[None], sinks, scale, window, run.picks, run.ratio,
                                     run.position, run.halo)[0]
               for run_queries, run_keys, run in zip(queries, keys, runs)]
    out = q.new_zeros(q.shape[0] * q.shape[1], *q.shape[2:]).index_copy(0, query_index, torch.cat(outputs))
    return out.view_as(q)
