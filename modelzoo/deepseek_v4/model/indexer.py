"""Lightning Indexer of the CSA layers (transformers' DeepseekV4Indexer + DeepseekV4IndexerScorer).

It compresses the sequence with its own small compressor (index_head_dim wide, same overlapping
windows as the CSA compressor), scores each query against every compressed key with
`sum_h w[t,h] * relu(q[t,h] . k[s]) * d^-0.5 * n_heads^-0.5`, masks entries whose window is not
complete yet, and keeps the top `index_topk`; picks that point past the causal limit become -1. On CUDA
the masked scores come from one Triton kernel (`index_kernels.py`) that keeps the per-head scores in registers.

Tensor parallelism: *replicated*, not sharded by heads. Its output is a set of integer indices
that every TP rank must agree on bit for bit (each rank masks its own heads with them); a head
split would need an all-reduce of the [B, S, T] score matrix before the top-k, whose summation
order differs from the unsplit sum, so near-ties could pick different entries than the
reference. No gradient flows through a top-k of indices, so replication costs no gradient
communication either. (Its cost, index_n_heads x index_head_dim x q_lora_rank per token, is about
a quarter of wq_b's in the released configs.)
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from modelzoo.deepseek_v4.config import CSA, DeepseekV4Args
from modelzoo.deepseek_v4.model.decisions import Decider
from modelzoo.deepseek_v4.model.compressor import CompressedWindows, pool_windows, queries_of_sequence, window_inputs
from modelzoo.deepseek_v4.model.layers import (
    ReplicatedLinear,
    RMSNorm,
    RotaryTable,
    apply_rotary,
    fp32_param,
    matmul_fp32,
)
from modelzoo.layers.fused import fused
from modelzoo.layers.sequences import TokenLayout, plain_layout


def index_scores(q: torch.Tensor, compressed: torch.Tensor, head_weights: torch.Tensor, softmax_scale: float,
                 weights_scaling: float) -> torch.Tensor:
    """sum_h w[t,h] * relu(q[t,h] . k[s]) * scales: q [B, S, h, d], compressed [B, T, d], head_weights [B, S, h]."""
    batch, seq_len, heads, _ = q.shape
    # one [S*h, d] x [d, T] product per sequence (a broadcast matmul over h runs a slow batched kernel)
    scores = matmul_fp32(q.flatten(1, 2), compressed.transpose(1, 2)).view(batch, seq_len, heads, -1)
    return weighted_head_sum(scores, head_weights, softmax_scale, weights_scaling)


@fused
def weighted_head_sum(scores: torch.Tensor, head_weights: torch.Tensor, softmax_scale: float,
                      weights_scaling: float) -> torch.Tensor:
    scores = F.relu(scores) * softmax_scale
    weights = head_weights.float() * weights_scaling                                          # [B, S, h]
    return (scores * weights.unsqueeze(-1)).sum(dim=2)


SCORE_BUDGET = 2**28          # per-head index scores [B, chunk, h, E] of one chunk of queries (1 GiB in fp32)
KERNEL_SCORE_BUDGET = 2**28   # masked scores [B, chunk, E] of one chunk on the kernel path (1 GiB in fp32)


def index_kernels_for(q: torch.Tensor):
    """The Triton kernel's module where it applies (CUDA tensors, Triton installed), else None."""
    if not q.is_cuda or importlib.util.find_spec("triton") is None:
        return None
    from modelzoo.deepseek_v4.model import index_kernels
    return index_kernels


class Indexer(Decider):
    def __init__(self, config, args: DeepseekV4Args):
        super().__init__()
        self.ratio = args.compress_rates[CSA]
        self.num_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.softmax_scale = self.head_dim**-0.5
        self.weights_scaling = self.num_heads**-0.5
        self.linear_kv = ReplicatedLinear(args.hidden_size, 2 * self.head_dim, config)
        self.linear_gate = ReplicatedLinear(args.hidden_size, 2 * self.head_dim, config)
        self.position_bias = fp32_param(self.ratio, 2 * self.head_dim, fill=0.0)
        self.kv_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.linear_q_up_proj = ReplicatedLinear(args.q_lora_rank, self.num_heads * self.head_dim, config)
        self.linear_weights = ReplicatedLinear(args.hidden_size, self.num_heads, config)
        self.rotary = RotaryTable(*args.rope_table("compress"))

    @torch.no_grad()
    def forward(self, hidden_states, q_residual, position_ids, layout: TokenLayout | None = None,
                windows: CompressedWindows | None = None) -> torch.Tensor:
        """The top-k entries each query sees [B, S, k] (k = min(index_topk, E)); -1 where fewer are visible.

        `windows` are the CSA compressor's (the indexer pools the same windows with its own projections);
        layout None: plain rows. In packed and padded batches each sequence's queries score its own entries,
        as that sequence alone would: the same products, and the same top-k call on the same scores (a top-k
        over all entries of a packed row can break exact ties, e.g. entries whose ReLU scores are all 0,
        differently)."""
        batch, seq_len, _ = hidden_states.shape
        layout = layout or plain_layout(batch, seq_len, hidden_states.device)
        whole = layout.whole_rows()
        windows = windows or CompressedWindows.of(whole, self.ratio)
        kv, gate = window_inputs(self.linear_kv, self.linear_gate, hidden_states, layout)
        compressed = pool_windows(kv, gate, self.position_bias, windows, self.head_dim, True, self.kv_norm,
                                  self.rotary)                                                      # [B, E, d]
        cos, sin = self.rotary(position_ids, hidden_states.dtype)
        q = self.linear_q_up_proj(q_residual).view(batch, seq_len, -1, self.head_dim)
        q = apply_rotary(q, cos, sin, unsqueeze_dim=2)                                            # [B, S, h, d]
        head_weights = self.linear_weights(hidden_states)                                         # [B, S, h]
        if layout.plain:
            picks = self.top_k(q, compressed, head_weights, layout.positions)
            return self.decide_complete(picks, lambda: (layout.positions + 1) // self.ratio)
        picks = torch.full((batch, seq_len, min(self.topk, windows.count)), -1, dtype=torch.long,
                           device=hidden_states.device)
        spans = []  # (row, tokens, first entry, positions) of each sequence, for the replay check alone
        for (row, start, length), (first_entry, entries) in zip(whole.sequences, windows.per_sequence(whole)):
            tokens, own = queries_of_sequence(layout, row, start, length), slice(first_entry, first_entry + entries)
            if isinstance(tokens, torch.Tensor) and not len(tokens):  # no token of it on this context-parallel rank
                continue
            positions = layout.positions[row:row + 1, tokens]
            local = self.top_k(q[row:row + 1, tokens], compressed[row:row + 1, own], head_weights[row:row + 1, tokens],
                               positions)[0]
            picks[row, tokens, : local.shape[-1]] = torch.where(local >= 0, local + first_entry, -1)
            spans.append((row, tokens, first_entry, positions[0]))

        def complete():
            limits = torch.zeros(batch, seq_len, dtype=torch.long, device=hidden_states.device)
            for row, tokens, first_entry, positions in spans:
                limits[row, tokens] = first_entry + (positions + 1) // self.ratio
            return limits
        return self.decide_complete(picks, complete)

    def decide_complete(self, picks: torch.Tensor, complete) -> torch.Tensor:
        """`decide`, refusing replayed picks of entries not complete at their query: the attention scores only the
        complete ones (model/window_attention.py), and no causal indexer picks another. `complete()` [B, S]: the
        end of each query's complete entries."""
        picks = self.decide(picks)
        if self.decision_hook is not None:
            limits = complete()
            late = torch.nonzero(picks >= limits[..., None])
            if len(late):
                row, token, slot = late[0].tolist()
                raise ValueError(f"DeepSeek-V4 indexer: the replayed pick {picks[row, token, slot].item()} of token "
                                 f"{token} in row {row} is a compressed entry not complete at that token (entries "
                                 f"before {limits[row, token].item()} are, at compress ratio {self.ratio}); a causal "
                                 f"indexer never picks it")
        return picks

    def top_k(self, q: torch.Tensor, compressed: torch.Tensor, head_weights: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        """Plain rows: the top min(index_topk, E) of the complete entries for each query, -1 past the visible ones.

        Queries go in chunks (each query's top-k reads only its own scores, so the chunks change nothing): on CUDA
        the kernel's masked scores [chunk, E] stay under KERNEL_SCORE_BUDGET elements, elsewhere the plain ops'
        per-head scores [chunk, h, E] under SCORE_BUDGET."""
        batch, seq_len, heads, _ = q.shape
        entries = compressed.shape[1]
        if entries == 0:
            return torch.empty(batch, seq_len, 0, dtype=torch.long, device=q.device)
        kernels = index_kernels_for(q)
        if kernels is not None:
            rows = max(1, KERNEL_SCORE_BUDGET // (batch * entries))
        else:
            rows = max(1, SCORE_BUDGET // (batch * heads * entries))
        picks = []
        for start in range(0, seq_len, rows):
            queries = slice(start, start + rows)
            complete = (positions[:, queries] + 1) // self.ratio            # [B, s]: the entries before it are visible
            if kernels is not None:
                scores = kernels.masked_index_scores(q[:, queries], compressed, head_weights[:, queries], complete,
                                                     self.softmax_scale, self.weights_scaling)
            else:
                visible = torch.arange(entries, device=q.device) < complete[..., None]
                scores = index_scores(q[:, queries], compressed, head_weights[:, queries], self.softmax_scale,
                                      self.weights_scaling).masked_fill(~visible, float("-inf"))     # [B, s, E]
            indices = scores.topk(min(self.topk, entries), dim=-1).indices
            picks.append(torch.where(indices < complete[..., None], indices, -1))
        return torch.cat(picks, dim=1)
