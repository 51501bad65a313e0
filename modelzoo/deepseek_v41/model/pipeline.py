"""DeepSeek-V4.1 between pipeline stages: what the layers hand down the stack, packed into the one tensor Megatron's
schedules send.

A stage's layers need more than the hyper-connection streams (DeepSeek-V4 sends those alone): the previous FFN
site's `pre` (the next attention site collapses its input with it), the CSA2 state the earlier layers published
(`CompressedState`: the last KV source's rotated latents and indexer keys, the last index source's top-k, the
candidate source's blocks) and the token ids (later Engram layers hash their n-grams; a later stage may be given
none). The layers run on rows: the micro-batch's rows, or each packed or padded sequence as a row of its own
(`each_sequence`), or under context parallelism this rank's tokens of each sequence (`SequenceShares`). What this
rank holds of each row is a `RowShapes`: its tokens (streams and pre), its queries (the rows of the masks) and the
whole row's length (the latents). Every row's state travels for its real tokens only. For a micro-batch of B rows of
T tokens here, N streams of H, and a row with n tokens here, q queries and c = length // r latents of the last KV
source before the stage (r its ratio):

    once         3            T as three base-256 digits
                 B T 3        the token ids here, three base-256 digits each
    per row      n N H        the residual streams                        gradient sent back
                 n N P        pre (fp32) as P parts in the pipeline dtype gradient sent back
                 c D          rotated latents (head_dim D)                gradient sent back (to the compressor)
                 c Dk         indexer keys (frozen indexers)              no gradient
                 q c          the top-k each query attends, 0 / 1
                 q c          the candidate blocks, 0 / 1, when the candidate source is before the stage

Under `attention="fast"` the layers hold the picks as ids, and so they travel: q k' 3 for the top-k, q b' 3 for the
candidate blocks, each id + 1 as three base-256 digits (0: an empty slot), k' = min(index top-k, c) and b' =
min(candidate top blocks, c / block size rounded up): linear in the length where the masks are quadratic.

Without context or sequence parallelism n = q = the row's length. Under context parallelism n = q = the rank's
tokens of the sequence (its length / CP in Megatron's layout), while the latents are the whole sequence's (every
rank pools them all). Under sequence parallelism n is the row's real tokens in this TP rank's slice of S / tp, while
attention and so the state run on the whole row: q = the length, and the state is the same on every TP rank.

Flat, in the rows' order (the receiver knows the rows from the batch's layout), zero-padded and sent as [L, B, H]
with L = `boundary_length(args, S, dtype, cp)` for rows of S tokens: the numbers of a row of S / cp tokens, plus 3
per token of slack, over H, where c takes the smallest KV-source ratio and the whole length S, so that one L serves
every stage and layout (a row's numbers grow faster than its length, so a row's sequences never need more than the
whole row would). Under sequence parallelism the schedules give each TP rank L / tp, but a rank's real tokens of a
micro-batch's sequences can reach S (the sequences are padded to the longest and each split in tp), so the provider
asks for tp x L (`pipeline_seq_length`): every TP rank sends what the whole row would. Integers and 0 / 1 are exact
in any floating dtype (a base-256 digit is exact in bf16, whose significand has 8 bits). An fp32 `pre` is one part
in an fp32 pipeline; under a 16-bit pipeline dtype three parts whose fp32 sum is the value (`split_fp32`). Which
pieces travel is a function of the configuration and the stage's first layer (`Boundary`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.nn.utils.rnn import pad_sequence

from modelzoo.deepseek_v41.config import DeepseekV41Args
from modelzoo.deepseek_v41.hf_model import CompressedState

ID_DIGITS = 3  # token ids (and the row length) below 256 ** 3, in base-256 digits


def pre_parts(dtype: torch.dtype) -> int:
    """The pipeline-dtype numbers that carry one fp32 value of `pre`."""
    return 1 if dtype == torch.float32 else 3


def split_fp32(values: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """fp32 values as `pre_parts(dtype)` tensors of `dtype` whose fp32 sum is the values: each part the rounding of
    what the earlier parts leave (8 significant bits each for bf16: 3 x 8 = fp32's 24)."""
    parts, rest = [], values
    for _ in range(pre_parts(dtype)):
        parts.append(rest.to(dtype))
        rest = rest - parts[-1].float()
    return parts


def digits(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if ids.numel() and (int(ids.max()) >= 256**ID_DIGITS or int(ids.min()) < 0):
        raise ValueError(f"deepseek_v41: token ids between pipeline stages travel as {ID_DIGITS} base-256 digits; "
                         f"got ids outside 0..{256**ID_DIGITS - 1}")
    return torch.stack([ids // 256**place % 256 for place in range(ID_DIGITS)], dim=-1).to(dtype)


def number(digits: torch.Tensor) -> torch.Tensor:
    digits = digits.long()
    return sum(digits[..., place] * 256**place for place in range(ID_DIGITS))


@dataclasses.dataclass(frozen=True)
class RowShapes:
    """What this rank holds of each row the layers run: `tokens`, its tokens (streams and pre: a prefix of the row's
    `padded_tokens` slots); `queries`, the rows of its masks (of `padded_queries`); `lengths`, the whole rows'
    lengths (the latents: of `padded_length` tokens)."""

    tokens: list[int]
    queries: list[int]
    lengths: list[int]
    padded_tokens: int
    padded_queries: int
    padded_length: int

    @classmethod
    def of(cls, here: list[int], padded: int, lengths: list[int], padded_length: int, tp: int = 1,
           rank: int = 0) -> RowShapes:
        """Rows whose queries here are `here` tokens of each (a prefix of `padded` slots: the whole row, or under
        context parallelism this rank's share), of rows of `lengths` tokens (padded to `padded_length`). Under
        sequence parallelism (`tp` > 1) TP rank `rank` holds slots [rank * padded / tp, (rank + 1) * padded / tp)
        of each row: its real tokens are a prefix of that slice, while attention runs on the rows whole."""
        share = padded // tp
        tokens = [min(max(queries - rank * share, 0), share) for queries in here]
        return cls(tokens, here, lengths, share, padded, padded_length)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """What enters the stage whose first layer is `first_layer`: the ratio of the last KV source before it (0: none,
    no latents travel), whether an index source has selected among its latents since, whether the candidate
    source is before it, whether the picks are ids (`attention="fast"`) rather than masks."""

    ratio: int
    selected: bool
    candidates: bool
    picks_as_ids: bool = False

    @classmethod
    def before(cls, args: DeepseekV41Args, first_layer: int, picks_as_ids: bool = False) -> Boundary:
        text = args.text
        sources = [layer for layer in text.kv_source_layer_ids if layer < first_layer]
        if not sources:
            return cls(0, False, False, picks_as_ids)
        last = sources[-1]
        selected = any(last <= layer < first_layer for layer in text.index_source_layer_ids)
        return cls(text.compress_ratios[last], selected, 0 <= text.candidate_source_layer_id < first_layer,
                   picks_as_ids)

    def latents(self, length: int) -> int:
        return length // self.ratio if self.ratio else 0

    def masks(self, length: int) -> tuple[str, ...]:
        """The masks of rows up to `length` tokens (none while there is no latent: nothing is selected yet)."""
        if not self.latents(length):
            return ()
        return tuple(name for name, present in (("selected", self.selected), ("candidates", self.candidates))
                     if present)

    def pick_shape(self, args: DeepseekV41Args, name: str, length: int) -> tuple[int, ...]:
        """A query's numbers of the picks `name` in a row of `length` tokens: its mask over the latents, or its ids
        (as many as can be set) as ID_DIGITS digits each."""
        latents = self.latents(length)
        if not self.picks_as_ids:
            return (latents,)
        text = args.text
        width = (min(args.index_topk, latents) if name == "selected" else
                 min(text.candidate_topk_blocks, -(-latents // text.candidate_block_size)))
        return width, ID_DIGITS

    def row_sizes(self, args: DeepseekV41Args, tokens: int, queries: int, length: int, dtype: torch.dtype,
                  padded_length: int) -> list[int]:
        """The numbers of each piece of a row with `tokens` tokens and `queries` queries here, of `length` tokens
        in all, among rows padded to `padded_length`."""
        latents = self.latents(length)
        sizes = [tokens * args.hc_mult * args.hidden_size, *[tokens * args.hc_mult] * pre_parts(dtype)]
        if self.ratio:
            sizes += [latents * args.head_dim, latents * args.index_head_dim]
            sizes += [queries * math.prod(self.pick_shape(args, name, length)) for name in self.masks(padded_length)]
        return sizes


def boundary_length(args: DeepseekV41Args, seq_length: int, dtype: torch.dtype, context_parallel: int = 1,
                    picks_as_ids: bool = False) -> int:
    """L of the [L, B, H] tensor a rank sends between stages for micro-batches of rows of `seq_length` tokens, each
    CP rank holding seq_length / `context_parallel` of them."""
    ratios = [args.text.compress_ratios[layer] for layer in args.text.kv_source_layer_ids]
    widest = Boundary(min(ratios) if ratios else 0, True, args.text.candidate_source_layer_id >= 0, picks_as_ids)
    here = seq_length // context_parallel
    numbers = ID_DIGITS * (1 + 2 * here) + sum(widest.row_sizes(args, here, here, seq_length, dtype, seq_length))
    return -(-numbers // args.hidden_size)


def pack(args: DeepseekV41Args, boundary: Boundary, streams: torch.Tensor, pre: torch.Tensor,
         state: CompressedState, shapes: RowShapes, input_ids: torch.Tensor, dtype: torch.dtype,
         boundary_rows: int) -> torch.Tensor:
    """Rows' streams [R, n, N, H], pre [R, n, N] fp32 and state, what this rank holds of each row, the micro-batch's
    input_ids [B, T] here -> the [`boundary_rows`, B, H] tensor of `dtype` sent to the next stage; its pieces keep
    their autograd edges."""
    batch, seq_length = input_ids.shape
    if state.ratio != boundary.ratio or (boundary.ratio and
                                         state.kv.shape[1] != boundary.latents(shapes.padded_length)):
        raise AssertionError(f"the state before the next stage has ratio {state.ratio}, its boundary says "
                             f"{boundary.ratio}")
    pieces = [digits(input_ids.new_tensor([seq_length]), dtype), digits(input_ids, dtype)]
    pre_pieces = split_fp32(pre, dtype)
    masks = boundary.masks(shapes.padded_length)
    sent = {name: sent_picks(getattr(state, name), boundary.picks_as_ids, dtype) for name in masks}
    for row, (tokens, queries, length) in enumerate(zip(shapes.tokens, shapes.queries, shapes.lengths)):
        latents = boundary.latents(length)
        pieces += [streams[row, :tokens].to(dtype), *[part[row, :tokens] for part in pre_pieces]]
        if boundary.ratio:
            pieces += [state.kv[row, :latents].to(dtype), state.index_keys[row, :latents].to(dtype)]
            pieces += [sent[name][row, :queries, :boundary.pick_shape(args, name, length)[0]] for name in masks]
    flat = torch.cat([piece.reshape(-1) for piece in pieces])
    if flat.numel() > batch * boundary_rows * args.hidden_size:
        raise AssertionError(f"{flat.numel()} numbers between pipeline stages, the tensor holds "
                             f"{batch * boundary_rows * args.hidden_size}")
    flat = torch.nn.functional.pad(flat, (0, batch * boundary_rows * args.hidden_size - flat.numel()))
    return flat.view(batch, boundary_rows, args.hidden_size).transpose(0, 1).contiguous()


def received_ids(received: torch.Tensor) -> torch.Tensor:
    """The micro-batch's input_ids [B, T] in `pack`'s tensor."""
    flat = received.detach().transpose(0, 1).reshape(-1)
    seq_length = int(number(flat[:ID_DIGITS]))
    return number(flat[ID_DIGITS:ID_DIGITS * (1 + received.shape[1] * seq_length)].view(-1, seq_length, ID_DIGITS))


def unpack(args: DeepseekV41Args, boundary: Boundary, received: torch.Tensor, shapes: RowShapes, dtype: torch.dtype,
           compute_dtype: torch.dtype):
    """`pack`'s tensor -> the rows' (streams [R, n, N, H] in `compute_dtype`, pre [R, n, N] fp32, state), padded as
    `shapes` says with zeros (0 / False, ids -1); each piece a view of `received`, so gradients flow back into it."""
    batch = received.shape[1]
    flat = received.transpose(0, 1).reshape(-1)
    seq_length = int(number(flat[:ID_DIGITS].detach()))
    parts = pre_parts(dtype)
    sizes = [ID_DIGITS * (1 + batch * seq_length)]
    for tokens, queries, length in zip(shapes.tokens, shapes.queries, shapes.lengths):
        sizes += boundary.row_sizes(args, tokens, queries, length, dtype, shapes.padded_length)
    pieces = list(flat[:sum(sizes)].split(sizes))[1:]
    per_row = len(sizes[1:]) // len(shapes.lengths)
    rows = [pieces[start:start + per_row] for start in range(0, len(pieces), per_row)]

    def padded(index: int, shape, size: int) -> torch.Tensor:
        """Piece `index` of every row, viewed as [its length, *shape], padded to [R, size, *shape]."""
        return _pad_to(pad_sequence([row[index].view(-1, *shape) for row in rows], batch_first=True), size, dim=1)

    streams = padded(0, (args.hc_mult, args.hidden_size), shapes.padded_tokens).to(compute_dtype)
    pre = sum(padded(1 + part, (args.hc_mult,), shapes.padded_tokens).float() for part in range(parts))
    state = CompressedState()
    if boundary.ratio:
        latents, first = boundary.latents(shapes.padded_length), 1 + parts
        state.ratio = boundary.ratio
        state.kv = padded(first, (args.head_dim,), latents).to(compute_dtype)
        state.index_keys = padded(first + 1, (args.index_head_dim,), latents).to(compute_dtype)
        for offset, name in enumerate(boundary.masks(shapes.padded_length)):
            widest = boundary.pick_shape(args, name, shapes.padded_length)[0]
            picks = [row[first + 2 + offset].detach().view(queries, *boundary.pick_shape(args, name, length))
                     for row, queries, length in zip(rows, shapes.queries, shapes.lengths)]
            picks = torch.stack([_pad_to(_pad_to(pick, widest, dim=1), shapes.padded_queries, dim=0)
                                 for pick in picks])
            setattr(state, name, number(picks) - 1 if boundary.picks_as_ids else picks != 0)
    return streams, pre, state


def sent_picks(picks: torch.Tensor, as_ids: bool, dtype: torch.dtype) -> torch.Tensor:
    """The rows' picks as they travel (converted once for every row): a mask as 0 / 1, or ids + 1 as digits (an
    empty slot is 0)."""
    return digits(picks + 1, dtype) if as_ids else picks.to(dtype)


def _pad_to(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Zeros appended along `dim` up to `size`."""
    missing = size - tensor.shape[dim]
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, missing]
    return torch.nn.functional.pad(tensor, pad)
