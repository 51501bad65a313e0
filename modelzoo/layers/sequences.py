"""The batch as a trainer hands it over, and the one description of it that every model here reads.

RL and SFT trainers on Megatron call a model as Megatron-Core's `GPTModel.forward` is called:

    model(input_ids, position_ids, attention_mask, labels=labels, packed_seq_params=packed_seq_params)

with one of three batch forms:
- plain rows: `input_ids` [b, s], each row one whole sequence;
- padded rows: `attention_mask` in Megatron's convention, a boolean tensor broadcastable to [b, 1, s, s] with
  True where attention is masked out: [b, 1, 1, s] marks padding keys (SkyRL's form), [b, 1, s, s] any mask
  (one that is causal over each row's real tokens is read as their padding mask; others as given);
  `position_ids` [b, s] give each token's RoPE position (left padding needs them);
- packed rows (THD): `input_ids` [1, T] holding several sequences back to back, described by
  `PackedSeqParams(qkv_format="thd", cu_seqlens_q, cu_seqlens_q_padded, ...)`: sequence i's real tokens
  are at [cu_padded[i], cu_padded[i] + len_i), its padding (if any) right after them.

`token_layout` turns any of them into a `TokenLayout`: each token's sequence (`segment_ids`, -1 for padding)
and its index within that sequence (`positions`). Attention is causal within a sequence (and, in sliding
windows, reaches back `window` positions); a padding token sees only itself, so its output is finite and
read by no real token. Models read the layout instead of the raw arguments, so packed, padded and plain
batches run the same code.

Under context parallelism (CP) each rank of the CP group is handed its share of every row, in Megatron's
load-balanced layout (`context_parallel_indices`; `modelzoo.layers.context_parallel` splits and gathers batches): the
layout then describes this rank's tokens as queries, and in `keys` the tokens of every rank, which attention
reads after gathering their keys and values over the group.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from modelzoo.compat import PassedAsPackedSeqParams


class BatchLayoutError(ValueError):
    """An input that does not describe a batch this model can run (one sentence naming it)."""


@dataclasses.dataclass(frozen=True, eq=False)
class ContextParallel:
    """This rank's place in its context-parallel group (`group` is the torch.distributed process group)."""

    group: object
    size: int
    rank: int


@dataclasses.dataclass(eq=False)
class KeyTokens:
    """The tokens a layout's queries attend over, in the order their keys arrive: the row itself, or under context
    parallelism every CP rank's tokens one rank after another (the order of an all-gather over the group).

    segment_ids, positions [b, keys]; `index` [keys]: each key's place in the whole row; `query_index` [s]: each
    query's place in the whole row (causality compares these, across ranks too).
    """

    segment_ids: Tensor
    positions: Tensor
    index: Tensor
    query_index: Tensor
    context_parallel: ContextParallel | None = None


@dataclasses.dataclass(eq=False)
class TokenLayout(PassedAsPackedSeqParams):
    """Where each token of a [batch, seq] block belongs.

    segment_ids   [b, s] int64: the token's sequence within its row (0, 1, ...), -1 for padding
    positions     [b, s] int64: the token's index within its sequence (0 for padding)
    rope_positions [b, s] int64: the RoPE position: `position_ids` when the caller gave them, else `positions`
    attention_mask [b, 1, s|1, s] bool or None: a caller's general mask (True = masked), read as given;
                   None when the segments say everything (plain, packed and key-padding batches)
    plain         whether every row is one whole sequence without padding, positions 0..s-1
    longest       the longest sequence's length (a Python int)
    rope_length   1 + the largest RoPE position (a Python int): the rows of a RoPE table the batch reads
    """

    segment_ids: Tensor
    positions: Tensor
    rope_positions: Tensor
    attention_mask: Tensor | None
    plain: bool
    longest: int
    rope_length: int
    # under context parallelism: every rank's tokens, which this rank's queries attend over
    context_parallel_keys: KeyTokens | None = None
    # what kernels derive from the layout once per forward and reuse in every layer (flex_attention block masks)
    derived: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def shape(self) -> torch.Size:
        return self.segment_ids.shape

    @property
    def padding(self) -> Tensor:
        """[b, s] bool, True for padding tokens (no sequence)."""
        return self.segment_ids < 0

    @property
    def keys(self) -> KeyTokens:
        """The tokens this layout's queries attend over (its own, or every CP rank's)."""
        if self.context_parallel_keys is not None:
            return self.context_parallel_keys
        index = torch.arange(self.shape[1], device=self.segment_ids.device)
        return KeyTokens(self.segment_ids, self.positions, index, index)

    def whole_rows(self) -> TokenLayout:
        """Under context parallelism the layout of the whole rows this rank's share comes from (every rank's tokens,
        in row order; RoPE positions are each token's position in its sequence); the layout itself otherwise."""
        keys = self.context_parallel_keys
        if keys is None:
            return self
        if "whole rows" not in self.derived:  # once per forward, read by every layer
            order = keys.index.argsort()
            segment_ids, positions = keys.segment_ids[:, order], keys.positions[:, order]
            plain = bool((segment_ids == 0).all()) and torch.equal(positions, order.expand_as(positions))
            self.derived["whole rows"] = TokenLayout(segment_ids, positions, positions, None, plain=plain,
                                                     longest=self.longest, rope_length=self.longest)
        return self.derived["whole rows"]

    def visible(self, window: int | None = None) -> Tensor:
        """[b, s, keys] bool, True where query t may attend to key u: same sequence (or allowed by the caller's
        mask), u <= t in the row, and within `window` positions when given; a query that sees nothing sees itself."""
        keys = self.keys
        allowed = keys.index[None, None, :] <= keys.query_index[None, :, None]
        if self.attention_mask is not None:
            allowed = allowed & ~self.attention_mask[:, 0]
        else:  # padding sees itself only (below): finite, and no real token reads it
            allowed = allowed & (self.segment_ids[:, :, None] == keys.segment_ids[:, None, :]) \
                & (keys.segment_ids >= 0)[:, None, :]
        if window is not None:
            allowed = allowed & (self.positions[:, :, None] - keys.positions[:, None, :] < window)
        itself = keys.query_index[:, None] == keys.index[None, :]
        return allowed | (itself & ~allowed.any(-1, keepdim=True))

    @functools.cached_property
    def sequences(self) -> list[tuple[int, int, int]]:
        """(row, first token, length) of every sequence, in row order (read on the host; for per-sequence work)."""
        rows, starts = torch.nonzero((self.positions == 0) & ~self.padding, as_tuple=True)
        counts = [torch.bincount(row[row >= 0], minlength=0) for row in self.segment_ids]
        return [(row, start, int(counts[row][self.segment_ids[row, start]]))
                for row, start in zip(rows.tolist(), starts.tolist())]

    def contiguous(self) -> bool:
        """Whether each sequence's tokens are consecutive in its row, positions 0, 1, 2, ... (true of plain,
        packed and left- or right-padded rows; false of a general mask, or of padding between two tokens)."""
        if self.attention_mask is not None:
            return False
        follows = (self.segment_ids[:, 1:] == self.segment_ids[:, :-1]) & (self.positions[:, 1:] == self.positions[:, :-1] + 1)
        continuing = (self.segment_ids[:, 1:] >= 0) & (self.positions[:, 1:] > 0)
        return bool((follows | ~continuing).all()) and bool((self.positions[:, 0] == 0).all())


def plain_layout(batch: int, seq: int, device: torch.device | str) -> TokenLayout:
    """Every row one whole sequence: positions 0..seq-1."""
    positions = torch.arange(seq, device=device).expand(batch, -1)
    return TokenLayout(torch.zeros(batch, seq, dtype=torch.long, device=device), positions, positions, None,
                       plain=True, longest=seq, rope_length=seq)


def token_layout(input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                 packed_seq_params=None, max_positions: int | None = None,
                 context_parallel: ContextParallel | None = None) -> TokenLayout:
    """The layout of a GPTModel-style call; raises `BatchLayoutError` naming what is wrong with the arguments.

    With `context_parallel` (of size > 1), `input_ids` and `position_ids` are this rank's share of the rows, and
    `packed_seq_params` describes the whole packed row, as Megatron hands them over."""
    if input_ids.dim() != 2:
        raise BatchLayoutError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    batch, seq = input_ids.shape
    device = input_ids.device
    whole_seq = seq if context_parallel is None else seq * context_parallel.size
    last_packed = None
    if packed_seq_params is not None:
        if attention_mask is not None:
            raise BatchLayoutError("attention_mask and packed_seq_params together: a packed (THD) row is described by "
                                   "its cu_seqlens alone; pass attention_mask=None")
        try:
            layout = _packed_layout(packed_seq_params, batch, whole_seq, device)
        except BatchLayoutError as error:
            if context_parallel is None:
                raise
            raise BatchLayoutError(f"{error} (this rank's {seq} tokens x context parallel size {context_parallel.size}:"
                                   f" input_ids must be this rank's share, modelzoo.layers.context_parallel.split_for_rank)"
                                   ) from None
        last_packed = int(layout.segment_ids.max())
    elif attention_mask is not None:
        if context_parallel is not None:
            raise BatchLayoutError(f"attention_mask with context parallel size {context_parallel.size}: split rows are "
                                   f"read as whole sequences; pass packed sequences (packed_seq_params) for several "
                                   f"sequences or padding, and attention_mask=None")
        layout = _masked_layout(attention_mask, batch, seq, device)
    else:
        layout = plain_layout(batch, whole_seq, device)
    if max_positions is not None and position_ids is None:
        _check_reach(layout, max_positions, last_packed)  # the whole rows: every context-parallel rank agrees
    if context_parallel is not None:
        layout = _rank_share(layout, row_slots(whole_seq, packed_seq_params), context_parallel)
    if position_ids is not None:
        layout = _with_position_ids(layout, position_ids, batch, seq)
        if max_positions is not None:
            _check_reach(layout, max_positions, last_packed)
    return layout


def _check_reach(layout: TokenLayout, max_positions: int, last_packed: int | None) -> None:
    """Refuse RoPE positions past `max_positions`, except in the last sequence of a packed row: slime and miles pad a
    packed row with one more cu_seqlens entry whose positions run on past the trained range. It attends only to
    itself, so whatever it holds, it is computed (RoPE extends by its formula) and changes no other sequence."""
    positions = layout.rope_positions
    if layout.rope_length > max_positions and last_packed is not None:
        positions = positions[layout.segment_ids != last_packed]
    reach = int(positions.max()) + 1 if positions.numel() else 0
    if reach > max_positions:
        raise BatchLayoutError(f"a sequence reaches position {reach - 1}, past the model's "
                               f"{max_positions} positions (max_position_embeddings)")


def row_slots(seq: int, packed_seq_params=None) -> list[int]:
    """The lengths of the runs of a row that context parallelism splits each into 2 x CP chunks: the whole row, or
    each packed sequence's slot (from `cu_seqlens_q_padded`, else `cu_seqlens_q`), as Megatron splits them."""
    if packed_seq_params is None:
        return [seq]
    _, offsets = packed_spans(packed_seq_params, seq)
    return [end - start for start, end in zip(offsets, [*offsets[1:], seq])]


def context_parallel_indices(slots: list[int], size: int, rank: int, device=None) -> Tensor:
    """The row indices CP rank `rank` of `size` holds, in its order: each slot (`row_slots`) cut into 2 x size equal
    chunks, of which the rank takes chunks `rank` and `2 x size - 1 - rank` (Megatron's load-balanced layout:
    `get_batch_on_this_cp_rank` for rows, Transformer Engine's `thd_get_partitioned_indices` for packed rows)."""
    pieces, start = [], 0
    for number, slot in enumerate(slots):
        if slot % (2 * size):
            where = "the row" if len(slots) == 1 else f"packed sequence {number}'s slot"
            raise BatchLayoutError(
                f"context parallel size {size} cuts every sequence into {2 * size} equal chunks, but {where} has "
                f"{slot} tokens: pad it to a multiple of {2 * size} (packed rows: cu_seqlens_q_padded, "
                f"pack_sequences(divisor={2 * size}))")
        chunk = slot // (2 * size)
        for piece in (rank, 2 * size - 1 - rank):
            pieces.append(torch.arange(start + piece * chunk, start + (piece + 1) * chunk))
        start += slot
    return torch.cat(pieces).to(device)


def _rank_share(whole: TokenLayout, slots: list[int], context_parallel: ContextParallel) -> TokenLayout:
    """The layout of this CP rank's tokens of `whole`, with every rank's tokens as its keys."""
    device = whole.segment_ids.device
    ranks = [context_parallel_indices(slots, context_parallel.size, rank, device)
             for rank in range(context_parallel.size)]
    mine, every = ranks[context_parallel.rank], torch.cat(ranks)
    keys = KeyTokens(whole.segment_ids[:, every], whole.positions[:, every], every, mine, context_parallel)
    return TokenLayout(whole.segment_ids[:, mine], whole.positions[:, mine], whole.rope_positions[:, mine], None,
                       plain=False, longest=whole.longest, rope_length=whole.rope_length, context_parallel_keys=keys)


def _with_position_ids(layout: TokenLayout, position_ids: Tensor, batch: int, seq: int) -> TokenLayout:
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, batch):
        raise BatchLayoutError(f"position_ids must be [batch, seq] = [{batch}, {seq}] (or [1, {seq}]), "
                               f"got shape {tuple(position_ids.shape)}")
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise BatchLayoutError(f"position_ids must be integers, got {position_ids.dtype}")
    rope_positions = position_ids.to(device=layout.segment_ids.device, dtype=torch.long).expand(batch, -1)
    smallest, largest = (int(value) for value in torch.aminmax(rope_positions))
    if smallest < 0:
        raise BatchLayoutError(f"position_ids has a negative position ({smallest})")
    changes = dict(rope_positions=rope_positions, rope_length=largest + 1, derived={},
                   plain=layout.plain and torch.equal(rope_positions, layout.positions))
    if layout.attention_mask is not None:  # a general mask: windows are measured in the caller's positions
        changes["positions"] = rope_positions
    return dataclasses.replace(layout, **changes)


def _masked_layout(attention_mask: Tensor, batch: int, seq: int, device) -> TokenLayout:
    """Megatron's mask: True = masked. [b, 1, 1, s] masks padding keys; [b, 1, s, s] is kept as a general mask."""
    if attention_mask.dtype != torch.bool:
        raise BatchLayoutError(f"attention_mask must be boolean (True = masked out, Megatron's convention), "
                               f"got {attention_mask.dtype}")
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[0] not in (1, batch) \
            or attention_mask.shape[2] not in (1, seq) or attention_mask.shape[3] != seq:
        raise BatchLayoutError(
            f"attention_mask must be [batch, 1, 1, seq] (padding keys) or [batch, 1, seq, seq] with True = masked out "
            f"(Megatron's convention) for input_ids of shape [{batch}, {seq}], got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.to(device).expand(batch, 1, attention_mask.shape[2], seq)
    if mask.shape[2] == 1:  # padding keys: every unmasked token is one sequence of its row, in order
        real = ~mask[:, 0, 0]
        positions = torch.where(real, real.long().cumsum(1) - 1, 0)
        segment_ids = torch.where(real, 0, -1)
        longest = int(real.sum(1).max()) if seq else 0
        return TokenLayout(segment_ids, positions, positions, None, plain=bool(real.all()), longest=longest,
                           rope_length=max(longest, 1))
    segments = _causal_runs(~mask[:, 0])
    if segments is not None:
        segment_ids, positions = segments
        longest = int(positions.max()) + 1 if bool((segment_ids >= 0).any()) else 0
        return TokenLayout(segment_ids, positions, positions, None, plain=bool((segment_ids == 0).all()),
                           longest=longest, rope_length=max(longest, 1))
    # a general mask is kept as given; positions are row indices
    real = ~mask[:, 0].diagonal(dim1=1, dim2=2)  # a token is real when it may attend to itself
    positions = torch.arange(seq, device=device).expand(batch, -1)
    return TokenLayout(torch.where(real, 0, -1), positions, positions, mask, plain=False, longest=seq,
                       rope_length=seq)


def _causal_runs(allowed: Tensor) -> tuple[Tensor, Tensor] | None:
    """A full mask as sequences, when it is causal over runs of consecutive tokens: (segment_ids, positions) [b, s].

    `allowed` [b, s, s]: query t may attend to key u. A token is real when it may attend to itself (a padding token
    sees nothing, or may see only itself); each real token must attend to exactly the keys from its sequence's
    first token to itself, all real and of the same sequence. That is the padding mask of left or right padding in
    Megatron's [b, 1, s, s] form (causal, padding keys and queries masked), with or without padding tokens seeing
    themselves, and the block-causal mask of documents packed in a row (Megatron's `reset_attention_mask`).
    Anything else gives None: a general mask."""
    batch, seq, _ = allowed.shape
    index = torch.arange(seq, device=allowed.device)
    real = allowed.diagonal(dim1=1, dim2=2)
    first_key = torch.where(real, allowed.long().argmax(-1), index)                      # [b, s]
    run = (index[None, None, :] >= first_key[:, :, None]) & (index[None, None, :] <= index[None, :, None])
    if not bool((allowed == run)[real].all()):
        return None
    # a token after the first of its run continues the previous token's run, which is real
    starts = first_key == index
    continues = (first_key[:, 1:] == first_key[:, :-1]) & real[:, :-1]
    if not bool((~real[:, 1:] | starts[:, 1:] | continues).all()):
        return None
    # a token that sees only itself and is seen by no other is a sequence of one token: padding or not, the
    # same computation
    segment_ids = torch.where(real, (starts & real).long().cumsum(1) - 1, -1)
    positions = torch.where(real, index - first_key, 0)
    return segment_ids, positions


def _packed_layout(params, batch: int, seq: int, device) -> TokenLayout:
    if params.qkv_format != "thd":
        raise BatchLayoutError(f"packed_seq_params.qkv_format={params.qkv_format!r}: only 'thd' (packed sequences) "
                               f"is supported")
    if batch != 1:
        raise BatchLayoutError(f"packed sequences (THD) come as one row: input_ids must be [1, tokens], "
                               f"got [{batch}, {seq}]")
    lengths, offsets = packed_spans(params, seq)
    segment_ids, positions = _packed_segments(tuple(lengths), tuple(offsets), seq, str(device))
    return TokenLayout(segment_ids, positions, positions, None, plain=len(lengths) == 1 and lengths[0] == seq,
                       longest=max(lengths), rope_length=max(lengths))


def packed_spans(params, tokens: int) -> tuple[list[int], list[int]]:
    """(real lengths, start offsets) of the sequences of a THD row of `tokens` tokens, checked."""
    lengths = _cu_seqlens_lengths(params.cu_seqlens_q, "cu_seqlens_q")
    if params.cu_seqlens_kv is not None and not torch.equal(torch.as_tensor(params.cu_seqlens_kv).cpu().long(),
                                                            torch.as_tensor(params.cu_seqlens_q).cpu().long()):
        raise BatchLayoutError("cu_seqlens_kv differs from cu_seqlens_q: these models attend within each sequence "
                               "(self-attention), so queries and keys are the same tokens")
    padded = params.cu_seqlens_q_padded
    if padded is None:
        offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    else:
        padded_lengths = _cu_seqlens_lengths(padded, "cu_seqlens_q_padded")
        if len(padded_lengths) != len(lengths):
            raise BatchLayoutError(f"cu_seqlens_q_padded describes {len(padded_lengths)} sequences, cu_seqlens_q "
                                   f"{len(lengths)}")
        short = [i for i, (real, slot) in enumerate(zip(lengths, padded_lengths)) if slot < real]
        if short:
            raise BatchLayoutError(f"cu_seqlens_q_padded gives sequence {short[0]} a slot of "
                                   f"{padded_lengths[short[0]]} tokens, shorter than its {lengths[short[0]]} tokens")
        offsets = torch.as_tensor(padded).cpu().long().tolist()
    if offsets[-1] != tokens:
        name = "cu_seqlens_q" if padded is None else "cu_seqlens_q_padded"
        raise BatchLayoutError(f"{name} ends at {offsets[-1]}, but the packed row has {tokens} tokens")
    return lengths, offsets[:-1]


def _cu_seqlens_lengths(cu_seqlens, name: str) -> list[int]:
    if cu_seqlens is None:
        raise BatchLayoutError(f"packed_seq_params.{name} is missing")
    values = torch.as_tensor(cu_seqlens).cpu()
    if values.dim() != 1 or values.numel() < 2 or values.dtype.is_floating_point:
        raise BatchLayoutError(f"{name} must be a 1-D integer tensor [number of sequences + 1], got "
                               f"{values.dtype} of shape {tuple(values.shape)}")
    values = values.long().tolist()
    if values[0] != 0:
        raise BatchLayoutError(f"{name} must start at 0, starts at {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(length <= 0 for length in lengths):
        bad = next(i for i, length in enumerate(lengths) if length <= 0)
        raise BatchLayoutError(f"{name} must increase: entries {bad} and {bad + 1} are {values[bad]} and "
                               f"{values[bad + 1]}")
    return lengths


@functools.lru_cache(maxsize=64)
def _packed_segments(lengths: tuple[int, ...], offsets: tuple[int, ...], total: int,
                     device: str) -> tuple[Tensor, Tensor]:
    segment_ids = torch.full((total,), -1, dtype=torch.long)
    positions = torch.zeros(total, dtype=torch.long)
    for number, (length, start) in enumerate(zip(lengths, offsets)):
        segment_ids[start:start + length] = number
        positions[start:start + length] = torch.arange(length)
    return segment_ids.to(device).unsqueeze(0), positions.to(device).unsqueeze(0)


# --- making packed batches ------------------------------------------------------------------------------------
@dataclasses.dataclass
class PackedBatch:
    """Sequences packed into one row for a THD forward: what `pack_sequences` returns.

    input_ids [1, T]; `packed_seq_params` for the model call; `lengths` the sequences' real lengths and
    `offsets` where each starts in the row (each slot padded to a multiple of the divisor).
    """

    input_ids: Tensor
    packed_seq_params: object
    lengths: list[int]
    offsets: list[int]

    def split(self, per_token: Tensor, shift: int = 0) -> list[Tensor]:
        """Each sequence's part of a [1, T, ...] tensor; `shift=1` drops its last token (a next-token quantity)."""
        return [per_token[0, start:start + length - shift] for start, length in zip(self.offsets, self.lengths)]

    def labels(self, ignore_index: int = 0) -> tuple[Tensor, Tensor]:
        """(labels [1, T], loss_mask [1, T]): each token's next token within its sequence, as GPTModel's `labels`
        want them; the last token of a sequence and padding get `ignore_index` and loss_mask 0."""
        labels = torch.full_like(self.input_ids, ignore_index)
        loss_mask = torch.zeros(self.input_ids.shape, dtype=torch.float32, device=self.input_ids.device)
        for start, length in zip(self.offsets, self.lengths):
            labels[0, start:start + length - 1] = self.input_ids[0, start + 1:start + length]
            loss_mask[0, start:start + length - 1] = 1.0
        return labels, loss_mask


def pack_sequences(sequences: list, divisor: int = 1, pad_id: int = 0, device=None) -> PackedBatch:
    """Pack token-id sequences into one THD row, each slot padded to a multiple of `divisor` (the layout's:
    e.g. tensor-parallel size with sequence parallelism, 2 x context-parallel size)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if not sequences:
        raise BatchLayoutError("nothing to pack: no sequences")
    lengths = [len(sequence) for sequence in sequences]
    if min(lengths) < 1:
        raise BatchLayoutError(f"sequence {lengths.index(min(lengths))} is empty")
    slots = [-(-length // divisor) * divisor for length in lengths]
    offsets = [0, *torch.tensor(slots).cumsum(0).tolist()]
    row = torch.full((1, offsets[-1]), pad_id, dtype=torch.long)
    for sequence, start in zip(sequences, offsets):
        row[0, start:start + len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_padded = torch.tensor(offsets, dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                             max_seqlen_q=max(slots), max_seqlen_kv=max(slots))
    return PackedBatch(row.to(device) if device is not None else row, params, lengths, offsets[:-1])
