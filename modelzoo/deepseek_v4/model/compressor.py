"""KV compressors of the compressed attention layers (transformers' DeepseekV4{HCA,CSA}Compressor).

Every `m` source tokens are pooled into one compressed KV entry: a softmax over the window of
`gate + position_bias` weights the projected `kv`, then RMSNorm and RoPE at the window's first
position (the "compress" RoPE). HCA (ratio m'=128 in the release) pools disjoint windows; CSA
(m=4) pools overlapping windows of width 2m (series Ca of the previous window + Cb of the current)
and lets the Lightning Indexer choose the top-k entries per query.

Tensor parallelism: the compressors are *replicated* on every TP rank. They produce the single
shared K=V head (MQA) that all query heads read, so there is nothing to split by heads; splitting
the head dim would need an all-reduce inside the RMSNorm and the softmax pooling. The attention
wraps their output in `copy_to_tensor_model_parallel_region`, so the gradients of the per-rank
heads are summed before they reach these weights.

Only the stateless full-sequence form (training, prefill, parity) is implemented: no decode cache.
"""

from __future__ import annotations

import torch
from torch import nn

from modelzoo.deepseek_v4.config import CSA, HCA, DeepseekV4Args
from modelzoo.deepseek_v4.model.layers import ReplicatedLinear, RMSNorm, RotaryTable, apply_rotary, fp32_param
from modelzoo.fused import fused


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, ratio: int, head_dim: int,
                 overlap: bool, kv_norm: RMSNorm, rotary: RotaryTable) -> torch.Tensor:
    """[B, S, (1|2)*D] projections -> [B, S // ratio, D] compressed entries (normed, RoPE'd)."""
    batch, n_windows = kv.shape[0], kv.shape[1] // ratio
    if n_windows == 0:
        return kv.new_zeros((batch, 0, head_dim))
    compressed = kv_norm(gated_window_sum(kv, gate, position_bias, ratio, head_dim, overlap))
    positions = (torch.arange(n_windows, device=compressed.device) * ratio).unsqueeze(0).expand(batch, -1)
    cos, sin = rotary(positions, compressed.dtype)
    return apply_rotary(compressed.unsqueeze(1), cos, sin).squeeze(1)


@fused
def gated_window_sum(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, ratio: int, head_dim: int,
                     overlap: bool) -> torch.Tensor:
    """Each window's kv weighted by softmax(gate + position_bias) over the window and summed: [B, S // ratio, D]."""
    batch, n_windows = kv.shape[0], kv.shape[1] // ratio
    usable = n_windows * ratio
    chunk_kv, chunk_gate = kv[:, :usable], gate[:, :usable]
    chunk_kv = chunk_kv.view(batch, n_windows, ratio, -1)
    chunk_gate = chunk_gate.view(batch, n_windows, ratio, -1) + position_bias
    if overlap:
        # window w pools [Ca of window w-1 | Cb of window w]; window 0's Ca half is zero kv, -inf gate
        new_kv = chunk_kv.new_zeros((batch, n_windows, 2 * ratio, head_dim))
        new_gate = chunk_gate.new_full((batch, n_windows, 2 * ratio, head_dim), float("-inf"))
        new_kv[:, :, ratio:] = chunk_kv[..., head_dim:]
        new_gate[:, :, ratio:] = chunk_gate[..., head_dim:]
        if n_windows > 1:
            new_kv[:, 1:, :ratio] = chunk_kv[:, :-1, :, :head_dim]
            new_gate[:, 1:, :ratio] = chunk_gate[:, :-1, :, :head_dim]
        chunk_kv, chunk_gate = new_kv, new_gate
    return (chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=2)


def causal_block_bias(compressed_kv: torch.Tensor, position_ids: torch.Tensor, ratio: int) -> torch.Tensor:
    """[B, 1, S, T] additive bias: query t sees entry w only once its window is complete, w < (t+1)//m."""
    batch, _, compressed_len, _ = compressed_kv.shape
    seq_len = position_ids.shape[1]
    entry = torch.arange(compressed_len, device=compressed_kv.device)
    threshold = (position_ids + 1) // ratio
    bias = compressed_kv.new_zeros((batch, 1, seq_len, compressed_len))
    return bias.masked_fill(entry.view(1, 1, 1, -1) >= threshold.unsqueeze(1).unsqueeze(-1), float("-inf"))


class _Compressor(nn.Module):
    overlap: bool

    def __init__(self, config, args: DeepseekV4Args, ratio: int, head_dim: int):
        super().__init__()
        width = (2 if self.overlap else 1) * head_dim
        self.ratio, self.head_dim = ratio, head_dim
        self.linear_kv = ReplicatedLinear(args.hidden_size, width, config)
        self.linear_gate = ReplicatedLinear(args.hidden_size, width, config)
        self.position_bias = fp32_param(ratio, width, fill=0.0)
        self.kv_norm = RMSNorm(head_dim, args.rms_norm_eps)
        self.rotary = RotaryTable(*args.rope_table("compress"))

    def compress(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return pool_windows(self.linear_kv(hidden_states), self.linear_gate(hidden_states), self.position_bias,
                            self.ratio, self.head_dim, self.overlap, self.kv_norm, self.rotary)


class HCACompressor(_Compressor):
    """Heavily compressed attention: disjoint windows of m' tokens, every complete entry visible."""

    overlap = False

    def __init__(self, config, args: DeepseekV4Args):
        super().__init__(config, args, args.compress_rates[HCA], args.head_dim)

    def forward(self, hidden_states, q_residual, position_ids) -> tuple[torch.Tensor, torch.Tensor | None]:
        compressed_kv = self.compress(hidden_states).unsqueeze(1)       # [B, 1, T, D]
        if position_ids.shape[1] == 1 or compressed_kv.shape[2] == 0:
            return compressed_kv, None
        return compressed_kv, causal_block_bias(compressed_kv, position_ids, self.ratio)


class CSACompressor(_Compressor):
    """Compressed sparse attention: overlapping windows of 2m tokens, top-k entries per query."""

    overlap = True

    def __init__(self, config, args: DeepseekV4Args):
        from modelzoo.deepseek_v4.model.indexer import Indexer

        super().__init__(config, args, args.compress_rates[CSA], args.head_dim)
        self.indexer = Indexer(config, args)

    def forward(self, hidden_states, q_residual, position_ids) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq_len, _ = hidden_states.shape
        compressed_kv = self.compress(hidden_states).unsqueeze(1)       # [B, 1, T, D]
        top_k = self.indexer(hidden_states, q_residual, position_ids)  # [B, S, k], -1 = not visible
        compressed_len = compressed_kv.shape[2]
        valid = top_k >= 0
        safe = torch.where(valid, top_k, torch.full_like(top_k, compressed_len))
        bias = compressed_kv.new_full((batch, 1, seq_len, compressed_len + 1), float("-inf"))
        bias.scatter_(-1, safe.unsqueeze(1), 0.0)
        return compressed_kv, bias[..., :compressed_len]


COMPRESSORS = {CSA: CSACompressor, HCA: HCACompressor}
