"""DeepSeek-V4.1 between pipeline stages: what the layers hand down the stack, packed into the one tensor Megatron's
schedules send.

A stage's layers need more than the hyper-connection streams (DeepSeek-V4 sends those alone): the previous FFN
site's `pre` (the next attention site collapses its input with it), the CSA2 state the earlier layers published
(`CompressedState`: the last KV source's rotated latents and indexer keys, the last index source's top-k, the
candidate source's blocks) and the token ids (later Engram layers hash their n-grams; a later stage may be given
none). The layers run on rows: the micro-batch's rows, or each packed or padded sequence as a row of its own
(`each_sequence`); every row's state travels for its real tokens only. For a micro-batch of B rows of T tokens, N
streams of H, and a row of n tokens with c = n // r latents of the last KV source before the stage (r its ratio):

    once         3            T as three base-256 digits
                 B T 3        the token ids, three base-256 digits each
    per row      n N H        the residual streams                        gradient sent back
                 n N P        pre (fp32) as P parts in the pipeline dtype gradient sent back
                 c D          rotated latents (head_dim D)                gradient sent back (to the compressor)
                 c Dk         indexer keys (frozen indexers)              no gradient
                 n c          the top-k each query attends, 0 / 1
                 n c          the candidate blocks, 0 / 1, when the candidate source is before the stage

flat, in the rows' order (the receiver knows the rows from the batch's layout), zero-padded and sent as [L, B, H]
with L = `boundary_length(T)`: the numbers of a row of T tokens, plus 3 per token of slack, over H, where c takes the
smallest KV-source ratio, so that one L serves every stage and layout (a row's numbers grow faster than its length,
so a row's sequences never need more than the whole row would). Integers and 0 / 1 are exact in any floating dtype
(a base-256 digit is exact in bf16, whose significand has 8 bits). An fp32 `pre` is one part in an fp32 pipeline;
under a 16-bit pipeline dtype three parts whose fp32 sum is the value (`split_fp32`). Which pieces travel is a
function of the configuration and the stage's first layer (`Boundary`).
"""

from __future__ import annotations

import dataclasses

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
    if int(ids.max()) >= 256**ID_DIGITS or int(ids.min()) < 0:
        raise ValueError(f"deepseek_v41: token ids between pipeline stages travel as {ID_DIGITS} base-256 digits; "
                         f"got ids outside 0..{256**ID_DIGITS - 1}")
    return torch.stack([ids // 256**place % 256 for place in range(ID_DIGITS)], dim=-1).to(dtype)


def number(digits: torch.Tensor) -> torch.Tensor:
    digits = digits.long()
    return sum(digits[..., place] * 256**place for place in range(ID_DIGITS))


@dataclasses.dataclass(frozen=True)
class Boundary:
    """What enters the stage whose first layer is `first_layer`: the ratio of the last KV source before it (0: none,
    no latents travel), whether an index source has selected among its latents since, whether the candidate
    source is before it."""

    ratio: int
    selected: bool
    candidates: bool

    @classmethod
    def before(cls, args: DeepseekV41Args, first_layer: int) -> Boundary:
        text = args.text
        sources = [layer for layer in text.kv_source_layer_ids if layer < first_layer]
        if not sources:
            return cls(0, False, False)
        last = sources[-1]
        selected = any(last <= layer < first_layer for layer in text.index_source_layer_ids)
        return cls(text.compress_ratios[last], selected, 0 <= text.candidate_source_layer_id < first_layer)

    def latents(self, length: int) -> int:
        return length // self.ratio if self.ratio else 0

    def masks(self, length: int) -> tuple[str, ...]:
        """The masks of rows up to `length` tokens (none while there is no latent: nothing is selected yet)."""
        if not self.latents(length):
            return ()
        return tuple(name for name, present in (("selected", self.selected), ("candidates", self.candidates))
                     if present)

    def row_sizes(self, args: DeepseekV41Args, length: int, dtype: torch.dtype, padded_to: int) -> list[int]:
        """The numbers of each piece of a row of `length` tokens among rows padded to `padded_to`."""
        latents = self.latents(length)
        sizes = [length * args.hc_mult * args.hidden_size, *[length * args.hc_mult] * pre_parts(dtype)]
        if self.ratio:
            sizes += [latents * args.head_dim, latents * args.index_head_dim]
            sizes += [length * latents] * len(self.masks(padded_to))
        return sizes


def boundary_length(args: DeepseekV41Args, seq_length: int, dtype: torch.dtype) -> int:
    """L of the [L, B, H] tensor sent between stages for micro-batches of rows of `seq_length` tokens."""
    ratios = [args.text.compress_ratios[layer] for layer in args.text.kv_source_layer_ids]
    widest = Boundary(min(ratios) if ratios else 0, True, args.text.candidate_source_layer_id >= 0)
    numbers = ID_DIGITS * (1 + 2 * seq_length) + sum(widest.row_sizes(args, seq_length, dtype, seq_length))
    return -(-numbers // args.hidden_size)


def pack(args: DeepseekV41Args, boundary: Boundary, streams: torch.Tensor, pre: torch.Tensor,
         state: CompressedState, lengths: list[int], input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows' streams [R, n, N, H], pre [R, n, N] fp32 and state, each row's length, the micro-batch's input_ids
    [B, T] -> the [L, B, H] tensor of `dtype` sent to the next stage; its pieces keep their autograd edges."""
    batch, seq_length = input_ids.shape
    padded_to = streams.shape[1]
    if state.ratio != boundary.ratio or (boundary.ratio and state.kv.shape[1] != boundary.latents(padded_to)):
        raise AssertionError(f"the state before the next stage has ratio {state.ratio}, its boundary says "
                             f"{boundary.ratio}")
    pieces = [digits(input_ids.new_tensor([seq_length]), dtype), digits(input_ids, dtype)]
    pre_pieces = split_fp32(pre, dtype)
    for row, length in enumerate(lengths):
        latents = boundary.latents(length)
        pieces += [streams[row, :length].to(dtype), *[part[row, :length] for part in pre_pieces]]
        if boundary.ratio:
            pieces += [state.kv[row, :latents].to(dtype), state.index_keys[row, :latents].to(dtype)]
            pieces += [getattr(state, name)[row, :length, :latents].to(dtype) for name in boundary.masks(padded_to)]
    flat = torch.cat([piece.reshape(-1) for piece in pieces])
    rows = boundary_length(args, seq_length, dtype)
    flat = torch.nn.functional.pad(flat, (0, batch * rows * args.hidden_size - flat.numel()))
    return flat.view(batch, rows, args.hidden_size).transpose(0, 1).contiguous()


def received_ids(received: torch.Tensor) -> torch.Tensor:
    """The micro-batch's input_ids [B, T] in `pack`'s tensor."""
    flat = received.detach().transpose(0, 1).reshape(-1)
    seq_length = int(number(flat[:ID_DIGITS]))
    return number(flat[ID_DIGITS:ID_DIGITS * (1 + received.shape[1] * seq_length)].view(-1, seq_length, ID_DIGITS))


def unpack(args: DeepseekV41Args, boundary: Boundary, received: torch.Tensor, lengths: list[int], dtype: torch.dtype,
           compute_dtype: torch.dtype):
    """`pack`'s tensor -> the rows' (streams [R, n, N, H] in `compute_dtype`, pre [R, n, N] fp32, state), n the
    longest row, padded with zeros (0 / False); each piece a view of `received`, so gradients flow back into it."""
    batch = received.shape[1]
    flat = received.transpose(0, 1).reshape(-1)
    seq_length = int(number(flat[:ID_DIGITS].detach()))
    padded_to, parts = max(lengths), pre_parts(dtype)
    sizes = [ID_DIGITS * (1 + batch * seq_length)]
    for length in lengths:
        sizes += boundary.row_sizes(args, length, dtype, padded_to)
    pieces = list(flat[:sum(sizes)].split(sizes))[1:]
    per_row = len(sizes[1:]) // len(lengths)
    rows = [pieces[start:start + per_row] for start in range(0, len(pieces), per_row)]

    def padded(index: int, shape) -> torch.Tensor:
        """Piece `index` of every row, viewed as [its length, *shape], padded to [R, longest, *shape]."""
        return pad_sequence([row[index].view(-1, *shape) for row in rows], batch_first=True)

    streams = padded(0, (args.hc_mult, args.hidden_size)).to(compute_dtype)
    pre = sum(padded(1 + part, (args.hc_mult,)).float() for part in range(parts))
    state = CompressedState()
    if boundary.ratio:
        latents, first = boundary.latents(padded_to), 1 + parts
        state.ratio = boundary.ratio
        state.kv = _pad_to(padded(first, (args.head_dim,)), latents, dim=1).to(compute_dtype)
        state.index_keys = _pad_to(padded(first + 1, (args.index_head_dim,)), latents, dim=1).to(compute_dtype)
        for offset, name in enumerate(boundary.masks(padded_to)):
            masks = [row[first + 2 + offset].view(length, boundary.latents(length))
                     for row, length in zip(rows, lengths)]
            masks = [_pad_to(_pad_to(mask, latents, dim=1), padded_to, dim=0) for mask in masks]
            setattr(state, name, torch.stack(masks) != 0)
    return streams, pre, state


def _pad_to(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Zeros appended along `dim` up to `size`."""
    missing = size - tensor.shape[dim]
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, missing]
    return torch.nn.functional.pad(tensor, pad)
