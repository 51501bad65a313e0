"""DeepSeek-V4.1 under context parallelism: this CP rank's tokens as one row per sequence, and the whole sequences.

Each CP rank holds its share of every row in Megatron's layout (`modelzoo.layers.context_parallel`). The model runs
this rank's tokens of each sequence as one right-padded row (the queries: each token at its position in its
sequence), as `each_sequence` runs whole sequences without context parallelism. What reads other ranks' tokens is
computed over the whole sequences, from per-token tensors gathered over the CP group in row order
(`gather_in_row_order`, gradients summed back over the group): the window keys, the compressor's latents (pooled
from each sequence's start) and, from them, the indexer keys; the Engram hashes the whole sequences' token ids.
The indexer scores, top-k and candidate blocks belong to this rank's queries; the hyper-connections, norms, MoE and
loss are per token.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.utils.rnn import pad_sequence

from modelzoo.layers.context_parallel import gather_in_row_order
from modelzoo.layers.sequences import TokenLayout


class SequenceShares:
    """This rank's tokens of each sequence of the whole rows, as rows [N, Lq] (N sequences), and the sequences'
    tokens on every rank, as rows [N, L] (L: the longest sequence), both right-padded; Lq a multiple of `multiple`
    (the TP size under sequence parallelism, which splits these rows).

    padding [N, Lq] bool: a slot holding no token of this rank; positions [N, Lq]: each token's position in its
    sequence (0 at padding)."""

    def __init__(self, layout: TokenLayout, multiple: int = 1):
        self.keys = layout.context_parallel_keys
        whole = layout.whole_rows()
        self.local_shape = tuple(layout.shape)
        local_len, whole_len = self.local_shape[1], whole.shape[1]
        queries, keys = [], []
        for row, start, length in whole.sequences:
            mine = torch.nonzero(layout.segment_ids[row] == whole.segment_ids[row, start]).flatten()
            queries.append(mine + row * local_len)
            keys.append(torch.arange(length, device=mine.device) + row * whole_len + start)
        self.query_index = pad_sequence(queries, batch_first=True, padding_value=-1)      # [N, Lq] into [B * s]
        self.query_index = torch.nn.functional.pad(self.query_index, (0, -self.query_index.shape[1] % multiple),
                                                   value=-1)
        self.padding = self.query_index < 0
        self.real_index = self.query_index[~self.padding]
        self.positions = layout.positions.flatten()[self.query_index.clamp_min(0)].masked_fill(self.padding, 0)
        # a slot past a sequence's end reads the batch's first token: it comes after every query of the sequence,
        # so no query sees it (window keys, latents) and no n-gram reads it
        self.key_index = pad_sequence(keys, batch_first=True, padding_value=0)             # [N, L] into [B * S]

    @functools.cached_property
    def runs(self) -> list[tuple[int, int, int, int]]:
        """This rank's tokens as runs of consecutive positions of a sequence: (row, first slot, its position,
        count). Under Megatron's load-balanced layout a rank holds two chunks of each sequence."""
        real = ~self.padding
        starts = real.clone()
        starts[:, 1:] &= ~real[:, :-1] | (self.positions[:, 1:] != self.positions[:, :-1] + 1)
        rows, slots = torch.nonzero(starts, as_tuple=True)
        run_id = starts.flatten().cumsum(0).view_as(starts) - 1
        counts = torch.bincount(run_id[real], minlength=len(rows))
        return list(zip(rows.tolist(), slots.tolist(), self.positions[rows, slots].tolist(), counts.tolist()))

    def rows(self, local: torch.Tensor) -> torch.Tensor:
        """[B, s, ...] of this rank's tokens -> [N, Lq, ...] (padding slots read the first token)."""
        return local.flatten(0, 1)[self.query_index.clamp_min(0)]

    def put_back(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, Lq, ...] -> [B, s, ...] in this rank's token order; zeros at tokens of no sequence."""
        local = rows.new_zeros(self.local_shape[0] * self.local_shape[1], *rows.shape[2:])
        return local.index_copy(0, self.real_index, rows[~self.padding]).unflatten(0, self.local_shape)

    def whole(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, Lq, ...] of this rank's tokens -> [N, L, ...] of every rank's (collective); backward, each token's
        gradient summed over the group."""
        gathered = gather_in_row_order(self.put_back(rows), self.keys)
        return gathered.flatten(0, 1)[self.key_index]

    def at_positions(self, whole: torch.Tensor) -> torch.Tensor:
        """[N, L, ...] over the whole sequences -> [N, Lq, ...] at this rank's tokens."""
        return whole[torch.arange(whole.shape[0], device=whole.device)[:, None], self.positions]
