"""DeepSeek-V4.1 between pipeline stages: what the layers hand down the stack, packed into the one tensor Megatron's
schedules send.

A stage's layers need more than the hyper-connection streams (DeepSeek-V4 sends those alone): the previous FFN
site's `pre` (the next attention site collapses its input with it), the CSA2 state the earlier layers published
(`CompressedState`: the last KV source's rotated latents and indexer keys, the last index source's top-k, the
candidate source's blocks) and the token ids (later Engram layers hash their n-grams). Per row of the micro-batch
(S tokens, N streams of H, C = S // r latents of the last KV source before the stage, r its ratio), in order:

    length       3           S as three base-256 digits (a later stage may be given no token ids)
    streams      S N H       the residual streams                        gradient sent back
    pre          S N P       fp32, as P parts in the pipeline dtype      gradient sent back
    ids          S 3         each token id as three base-256 digits
    kv           C D         rotated latents (head_dim D)                gradient sent back (to the compressor)
    index keys   C Dk        from frozen indexers: no gradient
    selected     S C         0 / 1, the top-k each query attends
    candidates   S C         0 / 1, when the candidate source is before the stage

flat, zero-padded to a multiple of H and sent as [L, B, H] (`boundary_length`: L for the whole model's largest
boundary, C = S // the smallest KV-source ratio, so one L serves every stage). Integers and 0 / 1 are exact in any
floating dtype (a base-256 digit is exact in bf16, whose significand has 8 bits). An fp32 `pre` is one part in an
fp32 pipeline; under a 16-bit pipeline dtype three parts whose sum is the fp32 value (`split_fp32`). Which pieces are
present is a function of the configuration and the stage's first layer (`Boundary`).
"""

from __future__ import annotations

import dataclasses

import torch

from modelzoo.deepseek_v41.config import DeepseekV41Args
from modelzoo.deepseek_v41.hf_model import CompressedState

ID_DIGITS = 3  # token ids below 256 ** 3, in base-256 digits


def pre_parts(dtype: torch.dtype) -> int:
    """The pipeline-dtype numbers that carry one fp32 value of `pre`."""
    return 1 if dtype == torch.float32 else 3


def split_fp32(values: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """fp32 values as `pre_parts(dtype)` tensors of `dtype` whose fp32 sum is the values: each part the rounding of
    what the earlier parts leave (8 significant bits each for bf16, 3 x 8 = fp32's 24)."""
    parts, rest = [], values
    for _ in range(pre_parts(dtype)):
        parts.append(rest.to(dtype))
        rest = rest - parts[-1].float()
    return parts


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

    def latents(self, seq_length: int) -> int:
        return seq_length // self.ratio if self.ratio else 0

    def masks(self, seq_length: int) -> tuple[str, ...]:
        """The masks that travel (none while there is no latent: nothing has been selected yet)."""
        if not self.latents(seq_length):
            return ()
        return tuple(name for name, present in (("selected", self.selected), ("candidates", self.candidates))
                     if present)


def boundary_length(args: DeepseekV41Args, seq_length: int, dtype: torch.dtype) -> int:
    """L of the [L, B, H] tensor sent between stages for rows of `seq_length` tokens: the largest boundary's."""
    ratios = [args.text.compress_ratios[layer] for layer in args.text.kv_source_layer_ids]
    widest = Boundary(min(ratios) if ratios else 0, True, args.text.candidate_source_layer_id >= 0)
    return -(-_row_numbers(args, widest, seq_length, dtype) // args.hidden_size)


def _row_numbers(args: DeepseekV41Args, boundary: Boundary, seq_length: int, dtype: torch.dtype) -> int:
    latents = boundary.latents(seq_length)
    masks = len(boundary.masks(seq_length)) * seq_length * latents
    return (ID_DIGITS + seq_length * args.hc_mult * (args.hidden_size + pre_parts(dtype)) + seq_length * ID_DIGITS
            + latents * (args.head_dim + args.index_head_dim) + masks)


def pack(args: DeepseekV41Args, boundary: Boundary, streams: torch.Tensor, pre: torch.Tensor,
         state: CompressedState, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """streams [B, S, N, H], pre [B, S, N] fp32, the state, input_ids [B, S] -> [L, B, H] of `dtype`; its
    differentiable pieces keep their autograd edges."""
    batch, seq_length = input_ids.shape
    if int(input_ids.max()) >= 256**ID_DIGITS or int(input_ids.min()) < 0:
        raise ValueError(f"deepseek_v41: token ids between pipeline stages travel as {ID_DIGITS} base-256 digits; "
                         f"got ids outside 0..{256**ID_DIGITS - 1}")
    pieces = [digits(input_ids.new_full((batch,), seq_length), dtype), streams.to(dtype), *split_fp32(pre, dtype),
              digits(input_ids, dtype)]
    if boundary.ratio:
        latents = boundary.latents(seq_length)
        if state.ratio != boundary.ratio or state.kv.shape[1] != latents:
            raise AssertionError(f"the state before the stage has ratio {state.ratio} and {state.kv.shape[1]} "
                                 f"latents, the boundary says {boundary.ratio} and {latents}")
        pieces += [state.kv.to(dtype), state.index_keys.to(dtype)]
        pieces += [getattr(state, name).to(dtype) for name in boundary.masks(seq_length)]
    flat = torch.cat([piece.reshape(batch, -1) for piece in pieces], dim=1)
    rows = boundary_length(args, seq_length, dtype)
    flat = torch.nn.functional.pad(flat, (0, rows * args.hidden_size - flat.shape[1]))
    return flat.view(batch, rows, args.hidden_size).transpose(0, 1).contiguous()


def digits(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([ids // 256**place % 256 for place in range(ID_DIGITS)], dim=-1).to(dtype)


def number(digits: torch.Tensor) -> torch.Tensor:
    digits = digits.long()
    return sum(digits[..., place] * 256**place for place in range(ID_DIGITS))


def unpack(args: DeepseekV41Args, boundary: Boundary, received: torch.Tensor, dtype: torch.dtype,
           compute_dtype: torch.dtype):
    """`pack`'s [L, B, H] -> (streams [B, S, N, H], pre [B, S, N] fp32, the state, input_ids [B, S]); the streams,
    latents and keys in `compute_dtype`, each a view of `received` (their gradients flow back into it)."""
    batch, streams_count = received.shape[1], args.hc_mult
    flat = received.transpose(0, 1).reshape(batch, -1)
    seq_length = int(number(flat[0, :ID_DIGITS]))
    latents = boundary.latents(seq_length)
    parts = pre_parts(dtype)
    sizes = [ID_DIGITS, seq_length * streams_count * args.hidden_size, *[seq_length * streams_count] * parts,
             seq_length * ID_DIGITS]
    if boundary.ratio:
        sizes += [latents * args.head_dim, latents * args.index_head_dim]
        sizes += [seq_length * latents] * len(boundary.masks(seq_length))
    pieces = list(flat[:, :sum(sizes)].split(sizes, dim=1))[1:]
    streams = pieces.pop(0).view(batch, seq_length, streams_count, args.hidden_size).to(compute_dtype)
    pre = sum(pieces.pop(0).float() for _ in range(parts)).view(batch, seq_length, streams_count)
    input_ids = number(pieces.pop(0).view(batch, seq_length, ID_DIGITS))
    state = CompressedState()
    if boundary.ratio:
        state.ratio = boundary.ratio
        state.kv = pieces.pop(0).view(batch, latents, args.head_dim).to(compute_dtype)
        state.index_keys = pieces.pop(0).view(batch, latents, args.index_head_dim).to(compute_dtype)
        for name in boundary.masks(seq_length):
            setattr(state, name, pieces.pop(0).view(batch, seq_length, latents) != 0)
    return streams, pre, state, input_ids
