"""Block-scaled FP8 and MXFP4 weights: dequantise and quantise, from the formats' definitions.

Architecture-agnostic. Two storage formats of a weight `W [..., R, C]` (leading dims, if any, are
independent matrices, e.g. stacked experts):

FP8 block (DeepSeek-V3/V4 release layout; DeepSeek-V4.1's uses 32 x 32 blocks, and 1 x 32 for its Engram tables)
    `weight` float8_e4m3fn `[..., R, C]` and `scale` `[..., ceil(R/br), ceil(C/bc)]`, one per br x bc block
    (`block`, 128 x 128 by default; the last row / column of blocks is partial when R or C is not a multiple).
    W = float(weight) * scale[block], the scale stored as float32 or as E8M0 (`float8_e8m0fnu`, or
    uint8 bytes: 2^(byte - 127)).
MXFP4 (OCP Microscaling Formats spec v1.0, MXFP4 = E2M1 elements, block of k = 32, E8M0 scale)
    `weight` int8 / uint8 `[..., R, C/2]`: two E2M1 codes per byte, element 2j in the low nibble, 2j+1 in
    the high nibble (the gpt-oss / DeepSeek packing); `scale` E8M0 `[..., R, ceil(C/32)]`, one per 32
    consecutive elements of a row (the last block of a row is partial when C % 32 != 0; C must be even).
    E2M1: sign bit, 2 exponent bits (bias 1), 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6.

Dequantisation is exact arithmetic in fp32 (an E4M3 / E2M1 value times a power of two is exact; a
float32 scale gives one fp32 rounding), then one cast to the requested dtype.

Quantisation rules (chosen so that quantise(dequantise(q, s)) == (q, s) bit for bit, i.e. idempotent):
- MXFP4: the spec's shared exponent floor(log2(amax)) - 2 (emax of E2M1), elements rounded to nearest
  even and saturated to +-6. The block's largest |code| is then 4 or 6, which gives back the same exponent.
- FP8, E8M0 scale: the smallest exponent e with amax / 2^e <= 464 (464 = the midpoint of 448 and the next
  E4M3 step, 480: anything up to it rounds to 448), elements clamped to +-448 and rounded to nearest even.
  The largest |q| is then in [240, 448], which gives back the same e. (DeepSeek's own rule,
  e = ceil(log2(amax / 448)), can leave a block whose largest |q| is 224; such a block has a second
  encoding, q * 2 at e - 1, with identical values, and no rule can return both: we return the latter.)
- FP8, float32 scale: s = amax / 448 (DeepSeek's rule), then s <- (448 s) / 448 in fp32 until it no longer
  changes (one step in practice; about 16% of fp32 values are not fixed points of that map), so that
  re-quantising the dequantised block reproduces s exactly. An all-zero block gets s = 1.

Kept scales. A checkpoint quantised by another rule (DeepSeek's ceil rule above, or an MXFP4 rule other
than the spec's) can hold blocks that these rules encode differently with the same values. Passing the
source's scales as `keep_scale` makes every block that its kept scale still encodes exactly (dequantising
gives back the block's values in the input dtype) keep that scale, so import -> export reproduces a
release's bytes; blocks whose values changed (training) get a fresh scale by the rules above.
"""

from __future__ import annotations

import torch

from modelzoo.conversion.safetensors_io import CheckpointError

FP8_BLOCK = 128
Block = tuple[int, int]         # an FP8 scale block: (rows, columns)
FP8_BLOCK_2D: Block = (FP8_BLOCK, FP8_BLOCK)
MX_BLOCK = 32
E4M3_MAX = 448.0
E8M0 = getattr(torch, "float8_e8m0fnu", None)
FP8_SCALE_DTYPES = (torch.float32, E8M0, torch.uint8)
MXFP4_PACKED_DTYPES = (torch.int8, torch.uint8)
MXFP4_SCALE_DTYPES = (E8M0, torch.uint8)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# E2M1 magnitudes by 3-bit code (exponent bits e, mantissa bit m: e == 0 -> m / 2, else 2^(e-1) (1 + m/2))
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class QuantizationError(CheckpointError):
    """A quantised tensor, its scale or a quantisation request is inconsistent."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_shape(shape: tuple[int, ...] | torch.Size, block: Block = FP8_BLOCK_2D) -> tuple[int, ...]:
    *lead, rows, cols = shape
    return (*lead, _cdiv(rows, block[0]), _cdiv(cols, block[1]))


def mxfp4_scale_shape(shape: tuple[int, ...] | torch.Size, block: int = MX_BLOCK) -> tuple[int, ...]:
    *lead, rows, cols = shape
    return (*lead, rows, _cdiv(cols, block))


def mxfp4_logical_shape(packed_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    *lead, rows, half = packed_shape
    return (*lead, rows, 2 * half)


# --- scales -------------------------------------------------------------------------------------
def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 (float8_e8m0fnu or uint8 bytes) -> float32 2^(byte - 127); byte 255 is NaN."""
    exponent = scale.view(torch.uint8).to(torch.int32) - 127
    out = torch.ldexp(torch.ones(exponent.shape, dtype=torch.float32), exponent)
    return out.masked_fill(exponent == 128, float("nan"))


def _e8m0_from_exponent(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    raw = (exponent + 127).to(torch.uint8)
    return raw if dtype == torch.uint8 else raw.view(dtype)


def e8m0_rounded_down(scale: torch.Tensor, dtype: torch.dtype = E8M0) -> torch.Tensor:
    """float32 scales (> 0) as E8M0 (`dtype`: float8_e8m0fnu or uint8), each rounded down to a power of two: exact
    for scales that are powers of two (those an E8M0 scale was read into)."""
    exponent = (torch.frexp(scale.to(torch.float32))[1] - 1).clamp(-127, 127)
    return _e8m0_from_exponent(exponent, dtype)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A float32 or E8M0 scale as float32 values (exact)."""
    return scale.to(torch.float32) if scale.dtype == torch.float32 else e8m0_to_float(scale)


def _check_finite(x: torch.Tensor, name: str) -> None:
    if not torch.isfinite(x).all():
        raise QuantizationError(f"{name}: cannot quantise a tensor with inf or NaN values")


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pad_rows, pad_cols = rows - x.shape[-2], cols - x.shape[-1]
    return torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows)) if pad_rows or pad_cols else x


# --- FP8 E4M3, br x bc blocks (128 x 128 by default) --------------------------------------------
def check_fp8(weight_shape, weight_dtype, scale_shape, scale_dtype, name: str = "tensor",
              block: Block = FP8_BLOCK_2D) -> None:
    if weight_dtype != torch.float8_e4m3fn:
        raise QuantizationError(f"{name}: FP8 block weights must be float8_e4m3fn, got {weight_dtype}")
    if len(weight_shape) < 2:
        raise QuantizationError(f"{name}: an FP8 block-scaled weight must have at least 2 dims, got {list(weight_shape)}")
    if scale_dtype not in FP8_SCALE_DTYPES:
        raise QuantizationError(f"{name}: FP8 scale dtype {scale_dtype} is not float32 or E8M0")
    expected = fp8_scale_shape(weight_shape, block)
    if tuple(scale_shape) != expected:
        raise QuantizationError(
            f"{name}: scale shape {list(scale_shape)} does not match {block[0]}x{block[1]} blocks of the weight "
            f"{list(weight_shape)} (expected {list(expected)})")


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                   name: str = "tensor", block: Block = FP8_BLOCK_2D) -> torch.Tensor:
    """FP8 E4M3 weight [..., R, C] with one scale per `block` (rows x columns) -> `dtype`."""
    check_fp8(weight.shape, weight.dtype, scale.shape, scale.dtype, name, block)
    return apply_block_scale(weight.to(torch.float32), scale, block).to(dtype)


def apply_block_scale(values: torch.Tensor, scale: torch.Tensor, block: Block = FP8_BLOCK_2D) -> torch.Tensor:
    """fp32 values [..., R, C] times one (float32 or E8M0) scale per `block`, in place: exact where the product is
    (E4M3 codes times a power of two)."""
    rows, cols = values.shape[-2:]
    out = values
    row_scale = scale_to_float(scale).repeat_interleave(block[0], dim=-2)[..., :rows, :]  # [..., R, Cb]
    full, rest = divmod(cols, block[1])
    if full:
        out[..., : full * block[1]].unflatten(-1, (full, block[1])).mul_(row_scale[..., :full, None])
    if rest:
        out[..., full * block[1]:].mul_(row_scale[..., full:])
    return out
    return out.to(dtype)


def _fp8_codes(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of blocks [..., rb, br, cb, bc] under float scales [..., rb, cb]."""
    return (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _fp8_exact_blocks(blocks: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [..., rb, cb]: the block dequantises back to its values (in `dtype`) under `scale`."""
    back = (_fp8_codes(blocks, scale).to(torch.float32) * scale[..., :, None, :, None]).to(dtype).to(torch.float32)
    return (back == blocks).all(dim=-1).all(dim=-2)


def can_keep(kept: torch.Tensor, fmt: str, scale_dtype: torch.dtype, shape: tuple[int, ...] | torch.Size,
             block: Block = FP8_BLOCK_2D) -> bool:
    """Whether `kept` can be the kept scale of quantising a `shape` tensor to `fmt` with `scale_dtype` scales
    (not when the source stored the tensor in another format or scale dtype)."""
    dtypes = (torch.float32,) if fmt == "fp8" and scale_dtype == torch.float32 else (E8M0, torch.uint8)
    return tuple(kept.shape) == scale_shape(fmt, shape, block) and kept.dtype in dtypes


def _check_kept_scale(kept: torch.Tensor, fmt: str, scale_dtype: torch.dtype, shape, name: str,
                      block: Block = FP8_BLOCK_2D) -> None:
    if not can_keep(kept, fmt, scale_dtype, shape, block):
        raise QuantizationError(f"{name}: kept scale {list(kept.shape)} {kept.dtype} does not match the scale "
                                f"being written ({list(scale_shape(fmt, shape, block))}, {scale_dtype})")


def quantize_fp8(x: torch.Tensor, scale_dtype: torch.dtype = E8M0, name: str = "tensor",
                 keep_scale: torch.Tensor | None = None,
                 block: Block = FP8_BLOCK_2D) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, C] -> (float8_e4m3fn [..., R, C], scale [..., ceil(R/br), ceil(C/bc)] in `scale_dtype`).

    `keep_scale`: a previous scale of the same geometry and dtype; see "Kept scales" above."""
    if scale_dtype not in FP8_SCALE_DTYPES:
        raise QuantizationError(f"{name}: FP8 scale dtype {scale_dtype} is not float32 or E8M0")
    if x.dim() < 2:
        raise QuantizationError(f"{name}: FP8 block quantisation needs at least 2 dims, got {list(x.shape)}")
    source_dtype = x.dtype
    x = x.to(torch.float32)
    _check_finite(x, name)
    *lead, rows, cols = x.shape
    rb, cb = _cdiv(rows, block[0]), _cdiv(cols, block[1])
    blocks = _pad_to(x, rb * block[0], cb * block[1]).reshape(*lead, rb, block[0], cb, block[1])
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., rb, cb]
    if scale_dtype == torch.float32:
        scale = amax / E4M3_MAX
        scale = torch.where(amax > 0, scale, torch.ones_like(scale))
        for _ in range(4):  # to a fixed point of s -> (448 s) / 448 (see the module docstring)
            nxt = (scale * E4M3_MAX) / E4M3_MAX
            if torch.equal(nxt, scale):
                break
            scale = nxt
        else:
            raise QuantizationError(f"{name}: float32 block scales did not reach a fixed point")
    else:
        mantissa, exp = torch.frexp(amax)  # amax = m 2^k, m in [0.5, 1)
        exponent = torch.where(mantissa * 512 <= 464, exp - 9, exp - 8)  # smallest e with amax / 2^e <= 464
        exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -127)).clamp(min=-127)
        if (exponent > 127).any():
            raise QuantizationError(f"{name}: values too large for an E8M0 scale")
        scale = torch.ldexp(torch.ones_like(amax), exponent)
    if keep_scale is not None:
        _check_kept_scale(keep_scale, "fp8", scale_dtype, x.shape, name, block)
        kept = scale_to_float(keep_scale)
        scale = torch.where(_fp8_exact_blocks(blocks, kept, source_dtype), kept, scale)
    if scale_dtype == torch.float32:
        stored = scale
    else:
        stored = _e8m0_from_exponent(torch.frexp(scale)[1] - 1, scale_dtype)
    q = _fp8_codes(blocks, scale).reshape(*lead, rb * block[0], cb * block[1])[..., :rows, :cols].contiguous()
    return q, stored.contiguous()


# --- MXFP4 (E2M1 elements, E8M0 scale per 32 elements of a row) ----------------------------------
def check_mxfp4(packed_shape, packed_dtype, scale_shape, scale_dtype, name: str = "tensor") -> None:
    if packed_dtype not in MXFP4_PACKED_DTYPES:
        raise QuantizationError(f"{name}: MXFP4 weights must be packed int8 / uint8, got {packed_dtype}")
    if len(packed_shape) < 2:
        raise QuantizationError(f"{name}: an MXFP4 weight must have at least 2 dims, got {list(packed_shape)}")
    if scale_dtype not in MXFP4_SCALE_DTYPES:
        raise QuantizationError(f"{name}: MXFP4 scale dtype {scale_dtype} is not E8M0")
    expected = mxfp4_scale_shape(mxfp4_logical_shape(packed_shape))
    if tuple(scale_shape) != expected:
        raise QuantizationError(
            f"{name}: scale shape {list(scale_shape)} does not match 32-element row blocks of the MXFP4 weight "
            f"(packed {list(packed_shape)}, {mxfp4_logical_shape(packed_shape)[-1]} columns; expected {list(expected)})")


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float32)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "tensor") -> torch.Tensor:
    """Packed MXFP4 [..., R, C/2] with E8M0 scales [..., R, ceil(C/32)] -> `dtype` [..., R, C]."""
    check_mxfp4(packed.shape, packed.dtype, scale.shape, scale.dtype, name)
    raw = packed.view(torch.uint8)
    values = torch.stack((_e2m1_decode(raw & 0xF), _e2m1_decode(raw >> 4)), dim=-1).flatten(-2)
    cols = values.shape[-1]
    exponent = scale.view(torch.uint8).to(torch.int32) - 127
    if (exponent == 128).any():
        raise QuantizationError(f"{name}: MXFP4 scale holds the E8M0 NaN code (255)")
    exponent = exponent.repeat_interleave(MX_BLOCK, dim=-1)[..., :cols]
    return torch.ldexp(values, exponent).to(dtype)


def _e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest E2M1 (ties to even code), saturating at 6; returns 4-bit codes (uint8)."""
    a = v.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5))
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def quantize_mxfp4(x: torch.Tensor, packed_dtype: torch.dtype = torch.int8, scale_dtype: torch.dtype = E8M0,
                   name: str = "tensor", keep_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, C] (C even) -> (packed [..., R, C/2] in `packed_dtype`, E8M0 scale [..., R, ceil(C/32)]).

    `keep_scale`: a previous E8M0 scale of the same geometry; see "Kept scales" above."""
    if packed_dtype not in MXFP4_PACKED_DTYPES or scale_dtype not in MXFP4_SCALE_DTYPES:
        raise QuantizationError(f"{name}: MXFP4 needs int8/uint8 packing and an E8M0 scale, "
                                f"got {packed_dtype} / {scale_dtype}")
    if x.dim() < 2 or x.shape[-1] % 2:
        raise QuantizationError(f"{name}: MXFP4 packs two values per byte: the last dim must be even, got {list(x.shape)}")
    source_dtype = x.dtype
    x = x.to(torch.float32)
    _check_finite(x, name)
    *lead, rows, cols = x.shape
    cb = _cdiv(cols, MX_BLOCK)
    blocks = _pad_to(x, rows, cb * MX_BLOCK).reshape(*lead, rows, cb, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)                      # floor(log2(amax)) = exp - 1; shared exponent - emax(2)
    exponent = torch.where(amax > 0, exp - 3, torch.full_like(exp, -127)).clamp(min=-127)
    if (exponent > 127).any():
        raise QuantizationError(f"{name}: values too large for an E8M0 scale")
    if keep_scale is not None:
        _check_kept_scale(keep_scale, "mxfp4", scale_dtype, x.shape, name)
        kept = keep_scale.view(torch.uint8).to(exponent.dtype) - 127
        back = torch.ldexp(_e2m1_decode(_e2m1_encode(torch.ldexp(blocks, -kept[..., None]))), kept[..., None])
        exact = (back.to(source_dtype).to(torch.float32) == blocks).all(dim=-1)
        exponent = torch.where(exact, kept, exponent)
    codes = _e2m1_encode(torch.ldexp(blocks, -exponent[..., None])).flatten(-2)[..., :cols]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    packed = packed if packed_dtype == torch.uint8 else packed.view(torch.int8)
    return packed.contiguous(), _e8m0_from_exponent(exponent, scale_dtype).contiguous()


# --- dispatch -------------------------------------------------------------------------------------
def quantized_format(weight_dtype: torch.dtype, name: str = "tensor") -> str:
    """'fp8' or 'mxfp4' from the stored weight dtype; anything else is an error naming the tensor."""
    if weight_dtype == torch.float8_e4m3fn:
        return "fp8"
    if weight_dtype in MXFP4_PACKED_DTYPES:
        return "mxfp4"
    raise QuantizationError(f"{name}: a weight with a scale must be float8_e4m3fn (FP8) or int8/uint8 (MXFP4), "
                            f"got {weight_dtype}")


def logical_shape(weight_shape, weight_dtype, scale_shape, scale_dtype, name: str = "tensor",
                  block: Block = FP8_BLOCK_2D) -> tuple[int, ...]:
    """Validate a (weight, scale) pair from headers alone and return the dequantised shape (`block`: of FP8)."""
    if quantized_format(weight_dtype, name) == "fp8":
        check_fp8(weight_shape, weight_dtype, scale_shape, scale_dtype, name, block)
        return tuple(weight_shape)
    check_mxfp4(weight_shape, weight_dtype, scale_shape, scale_dtype, name)
    return mxfp4_logical_shape(weight_shape)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               name: str = "tensor", block: Block = FP8_BLOCK_2D) -> torch.Tensor:
    if quantized_format(weight.dtype, name) == "fp8":
        return dequantize_fp8(weight, scale, dtype, name, block)
    return dequantize_mxfp4(weight, scale, dtype, name)


def scale_shape(fmt: str, shape: tuple[int, ...] | torch.Size, block: Block = FP8_BLOCK_2D) -> tuple[int, ...]:
    return fp8_scale_shape(shape, block) if fmt == "fp8" else mxfp4_scale_shape(shape)


def quantize(x: torch.Tensor, fmt: str, scale_dtype: torch.dtype = E8M0, name: str = "tensor",
             keep_scale: torch.Tensor | None = None, block: Block = FP8_BLOCK_2D) -> tuple[torch.Tensor, torch.Tensor]:
    """`block`: the FP8 scale block (MXFP4's is always 32 elements of a row)."""
    if fmt == "fp8":
        return quantize_fp8(x, scale_dtype, name, keep_scale, block)
    if fmt == "mxfp4":
        return quantize_mxfp4(x, torch.int8, E8M0 if scale_dtype == torch.float32 else scale_dtype, name, keep_scale)
    raise QuantizationError(f"{name}: unknown quantisation format {fmt!r} (fp8 | mxfp4)")
