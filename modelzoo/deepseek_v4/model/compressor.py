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

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from modelzoo.deepseek_v4.config import CSA, HCA, DeepseekV4Args
from modelzoo.deepseek_v4.model.layers import ReplicatedLinear, RMSNorm, RotaryTable, apply_rotary, fp32_param
from modelzoo.layers.context_parallel import gather_in_row_order
from modelzoo.layers.fused import fused
from modelzoo.layers.recompute import kept_for_recompute
from modelzoo.layers.sequences import TokenLayout, plain_layout


@dataclasses.dataclass(eq=False)
class CompressedWindows:
    """The complete windows of `ratio` tokens of every sequence in a batch, one compressed entry each.

    A sequence of n tokens has n // ratio windows, at its positions [w * ratio, (w + 1) * ratio); a last partial
    window makes no entry (a query only ever sees complete windows). In a packed row the entries of its
    sequences follow each other in row order, so no entry mixes two sequences.

    first_token [B, E]: the row index of each window's first token; number [B, E]: w, its window within its
    sequence; segment [B, E]: its sequence (-2 for the unused slots of a row with fewer entries than another).
    """

    ratio: int
    first_token: torch.Tensor
    number: torch.Tensor
    segment: torch.Tensor
    plain: bool

    @classmethod
    def of(cls, layout: TokenLayout, ratio: int) -> CompressedWindows:
        batch, seq = layout.shape
        device = layout.segment_ids.device
        if layout.plain:  # static: n // ratio windows per row, no host synchronisation
            number = torch.arange(seq // ratio, device=device).expand(batch, -1)
            return cls(ratio, number * ratio, number, torch.zeros_like(number), plain=True)
        # a window starts at each position that is a multiple of ratio and whose ratio-th token is still its sequence's
        last = F.pad(layout.positions, (0, ratio - 1), value=-1)[:, ratio - 1:]
        starts = (layout.segment_ids >= 0) & (layout.positions % ratio == 0) & (last == layout.positions + ratio - 1)
        counts = starts.sum(1)
        entries = int(counts.max())
        slot = torch.arange(entries, device=device)
        # each row's window starts in order, then its unused slots
        order = torch.sort(torch.where(starts, torch.arange(seq, device=device), seq), dim=1, stable=True).values
        first_token = order[:, :entries].clamp(max=max(seq - 1, 0))
        used = slot[None, :] < counts[:, None]
        number = torch.where(used, layout.positions.gather(1, first_token) // ratio, 0)
        segment = torch.where(used, layout.segment_ids.gather(1, first_token), -2)
        return cls(ratio, first_token, number, segment, plain=False)

    @property
    def count(self) -> int:
        return self.first_token.shape[1]

    def chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, width] -> each window's tokens [B, E, ratio, width] (a view of x for plain rows)."""
        batch, entries = self.first_token.shape
        if self.plain:
            return x[:, : entries * self.ratio].view(batch, entries, self.ratio, -1)
        tokens = self.first_token[:, :, None] + torch.arange(self.ratio, device=x.device)
        return x[torch.arange(batch, device=x.device)[:, None, None], tokens.clamp(max=x.shape[1] - 1)]

    def per_sequence(self, layout: TokenLayout) -> list[tuple[int, int]]:
        """(first entry, entries) of each of `layout.sequences`: a sequence of n tokens has n // ratio entries, and
        the entries of a row follow its sequences in order."""
        spans, next_entry = [], {}
        for row, _, length in layout.sequences:
            first = next_entry.get(row, 0)
            spans.append((first, length // self.ratio))
            next_entry[row] = first + length // self.ratio
        return spans

    def visible(self, layout: TokenLayout) -> torch.Tensor:
        """[B, S, E] bool: query t sees entry w of its own sequence once the window is complete, w < (t + 1) // ratio."""
        complete = self.number[:, None, :] < ((layout.positions + 1) // self.ratio)[:, :, None]
        if self.plain:
            return complete
        return complete & (self.segment[:, None, :] == layout.segment_ids[:, :, None])


@dataclasses.dataclass(eq=False)
class CompressedVisibility:
    """Which compressed entries each query sees: every complete window of its own sequence (HCA), or of those the
    indexer's top-k picked (CSA: `picks` [B, S, k] entry ids, -1 for none)."""

    windows: CompressedWindows
    picks: torch.Tensor | None = None

    def dense(self, layout: TokenLayout) -> torch.Tensor:
        """[B, S, E] bool over the whole batch."""
        if self.picks is None:
            return self.windows.visible(layout)
        batch, seq_len, _ = self.picks.shape
        picked = torch.zeros(batch, seq_len, self.windows.count + 1, dtype=torch.bool, device=self.picks.device)
        picked.scatter_(-1, torch.where(self.picks >= 0, self.picks, self.windows.count), True)
        return picked[..., : self.windows.count]

    def of_sequence(self, row: int, start: int, length: int, first_entry: int) -> tuple[torch.Tensor | None, int]:
        """One sequence's entries as that sequence alone sees them, in `window_sink_attention`'s terms: its picks
        [1, length, k] renumbered from its first entry (CSA), or None and the window ratio (HCA)."""
        if self.picks is None:
            return None, self.windows.ratio
        picks = self.picks[row:row + 1, start:start + length]
        return torch.where(picks >= 0, picks - first_entry, -1), self.windows.ratio


def queries_of_sequence(layout: TokenLayout, row: int, start: int, length: int) -> slice | torch.Tensor:
    """This layout's tokens of the sequence of `layout.whole_rows().sequences` at (row, start, length): the slice
    of its row, or under context parallelism the indices of this rank's share of it (two chunks, maybe none)."""
    if layout.context_parallel_keys is None:
        return slice(start, start + length)
    segment = layout.whole_rows().segment_ids[row, start]
    return torch.nonzero(layout.segment_ids[row] == segment)[:, 0]


def runs_of_sequence(layout: TokenLayout, row: int, start: int, length: int) -> list[tuple[int, int, int]]:
    """(first token in this layout's row, its position in the sequence, tokens) of each run of consecutive positions
    that this layout holds of the sequence of `layout.whole_rows().sequences` at (row, start, length): the whole
    sequence, or under context parallelism this rank's chunks of it (none, one, or two)."""
    if layout.context_parallel_keys is None:
        return [(start, 0, length)]
    tokens = queries_of_sequence(layout, row, start, length).tolist()
    positions = layout.positions[row, tokens].tolist()
    runs = []
    for token, position in zip(tokens, positions):
        if runs and token == runs[-1][0] + runs[-1][2] and position == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([token, position, 1])
    return [tuple(run) for run in runs]


def window_inputs(linear_kv: nn.Module, linear_gate: nn.Module, hidden_states: torch.Tensor,
                  layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The projections [B, S, width] a compressor pools, of the whole rows: under context parallelism each rank
    projects its own tokens and the projections of every rank are gathered in row order (their gradients summed
    back over the group), so that every rank pools the same entries from whole windows."""
    kv, gate = linear_kv(hidden_states), linear_gate(hidden_states)
    if layout.context_parallel_keys is None:
        return kv, gate
    return gather_in_row_order(torch.cat([kv, gate], dim=-1), layout.context_parallel_keys).chunk(2, dim=-1)


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, windows: CompressedWindows,
                 head_dim: int, overlap: bool, kv_norm: RMSNorm, rotary: RotaryTable) -> torch.Tensor:
    """[B, S, (1|2)*D] projections -> [B, E, D] compressed entries (normed, RoPE'd at each window's first position)."""
    batch, entries = kv.shape[0], windows.count
    if entries == 0:
        return kv.new_zeros((batch, 0, head_dim))
    compressed = kv_norm(gated_window_sum(windows.chunks(kv), windows.chunks(gate), position_bias, head_dim, overlap,
                                          windows.number == 0))
    cos, sin = rotary(windows.number * windows.ratio, compressed.dtype)
    return apply_rotary(compressed.unsqueeze(1), cos, sin).squeeze(1)


@fused
def gated_window_sum(chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, position_bias: torch.Tensor, head_dim: int,
                     overlap: bool, first: torch.Tensor) -> torch.Tensor:
    """Each window's kv weighted by softmax(gate + position_bias) over the window and summed: [B, E, D].

    chunk_kv, chunk_gate [B, E, ratio, (1|2)*D]; `first` [B, E] marks each sequence's first window."""
    chunk_gate = chunk_gate + position_bias
    if overlap:
        # window w pools [Ca of window w-1 | Cb of window w]; a sequence's first window has zero kv, -inf gate there
        no_previous = first[:, :, None, None]
        previous_kv = F.pad(chunk_kv[:, :-1, :, :head_dim], (0, 0, 0, 0, 1, 0)).masked_fill(no_previous, 0.0)
        previous_gate = F.pad(chunk_gate[:, :-1, :, :head_dim], (0, 0, 0, 0, 1, 0)).masked_fill(no_previous,
                                                                                                 float("-inf"))
        chunk_kv = torch.cat([previous_kv, chunk_kv[..., head_dim:]], dim=2)
        chunk_gate = torch.cat([previous_gate, chunk_gate[..., head_dim:]], dim=2)
    return (chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=2)


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

    def compress(self, hidden_states: torch.Tensor, windows: CompressedWindows, layout: TokenLayout) -> torch.Tensor:
        kv, gate = window_inputs(self.linear_kv, self.linear_gate, hidden_states, layout)
        return pool_windows(kv, gate, self.position_bias, windows, self.head_dim, self.overlap, self.kv_norm,
                            self.rotary)


class HCACompressor(_Compressor):
    """Heavily compressed attention: disjoint windows of m' tokens, every complete entry visible."""

    overlap = False

    def __init__(self, config, args: DeepseekV4Args):
        super().__init__(config, args, args.compress_rates[HCA], args.head_dim)

    def forward(self, hidden_states, q_residual, position_ids, layout: TokenLayout | None = None):
        """-> compressed entries [B, 1, E, D] and which of them each query sees (layout None: plain rows)."""
        layout = layout or plain_layout(*hidden_states.shape[:2], hidden_states.device)
        windows = CompressedWindows.of(layout.whole_rows(), self.ratio)
        return self.compress(hidden_states, windows, layout).unsqueeze(1), CompressedVisibility(windows)


class CSACompressor(_Compressor):
    """Compressed sparse attention: overlapping windows of 2m tokens, top-k entries per query."""

    overlap = True

    def __init__(self, config, args: DeepseekV4Args, indexer_class: type[nn.Module]):
        # `indexer_class`: the Lightning Indexer (indexer.py), which reads this module's windows: passed in, so
        # that this module does not import the one that imports it
        super().__init__(config, args, args.compress_rates[CSA], args.head_dim)
        self.indexer = indexer_class(config, args)

    def forward(self, hidden_states, q_residual, position_ids, layout: TokenLayout | None = None):
        """-> compressed entries [B, 1, E, D] and the indexer's picks per query (layout None: plain rows)."""
        layout = layout or plain_layout(*hidden_states.shape[:2], hidden_states.device)
        windows = CompressedWindows.of(layout.whole_rows(), self.ratio)
        compressed_kv = self.compress(hidden_states, windows, layout).unsqueeze(1)       # [B, 1, E, D]
        # [B, S, k], -1 = none; an activation recompute reuses the forward's picks (integers, no gradient)
        picks = kept_for_recompute(lambda: self.indexer(hidden_states, q_residual, position_ids, layout, windows))
        return compressed_kv, CompressedVisibility(windows, picks)

