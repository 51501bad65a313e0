"""FP8 (128x128 block) and MXFP4 formats (modelzoo/deepseek_v4/release/quantization.py).

Oracles, independent of our code: transformers' own dequantisers (`_dequantize_fp8_weight`, which
handles ragged edges, and `Fp8Dequantize._dequantize_one`, the FP4 path it uses for DeepSeek-V4 experts,
which needs whole 32-column blocks), and bit decoders written here from the published definitions
(E4M3: OCP 8-bit FP spec; E2M1 and E8M0: OCP Microscaling spec v1.0), computed in float64.
Every comparison is exact (torch.equal): an E4M3/E2M1 value times a power of two is exact in fp32, and
a float32 scale gives one correctly rounded fp32 product, which float64-then-fp32 reproduces.
"""

import math

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

from modelzoo.deepseek_v4.release import quantization as q

E8M0 = torch.float8_e8m0fnu


def e4m3_by_hand(byte: int) -> float:
    sign, exponent, mantissa = byte >> 7, (byte >> 3) & 0xF, byte & 7
    if exponent == 15 and mantissa == 7:
        return math.nan
    magnitude = mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return -magnitude if sign else magnitude


def e2m1_by_hand(code: int) -> float:
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def fp8_dequant_by_hand(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor([e4m3_by_hand(b) for b in range(256)], dtype=torch.float64)
    values = lut[weight.view(torch.uint8).long()]
    if scale.dtype == torch.float32:
        s = scale.double()
    else:
        s = torch.tensor([2.0 ** (b - 127) for b in range(256)], dtype=torch.float64)[scale.view(torch.uint8).long()]
    rows, cols = weight.shape[-2:]
    s = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
    return (values * s).float()


def mxfp4_dequant_by_hand(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor([e2m1_by_hand(c) for c in range(16)], dtype=torch.float64)
    raw = packed.view(torch.uint8).long()
    values = torch.stack((lut[raw & 15], lut[raw >> 4]), -1).flatten(-2)  # element 2j = low nibble
    s = torch.tensor([2.0 ** (b - 127) for b in range(256)], dtype=torch.float64)[scale.view(torch.uint8).long()]
    return (values * s.repeat_interleave(32, -1)[..., : values.shape[-1]]).float()


def random_fp8(shape, scale_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    scale_shape = q.fp8_scale_shape(shape)
    if scale_dtype == torch.float32:
        scale = torch.rand(scale_shape, generator=g) * 2.0 ** torch.randint(-20, 5, scale_shape, generator=g)
    else:
        scale = torch.randint(100, 140, scale_shape, generator=g, dtype=torch.uint8)
        scale = scale if scale_dtype == torch.uint8 else scale.view(scale_dtype)
    return raw.view(torch.float8_e4m3fn), scale


def random_mxfp4(shape, seed=0, packed_dtype=torch.int8):
    g = torch.Generator().manual_seed(seed)
    *lead, rows, cols = shape
    packed = torch.randint(0, 256, (*lead, rows, cols // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(100, 140, q.mxfp4_scale_shape(shape), generator=g, dtype=torch.uint8).view(E8M0)
    return (packed if packed_dtype == torch.uint8 else packed.view(torch.int8)), scale


# ragged: 200 = 128 + 72 rows, 300 = 2 * 128 + 44 columns; a stack of 2; smaller than one block
FP8_SHAPES = [(200, 300), (2, 130, 129), (5, 7), (256, 128)]


@pytest.mark.parametrize("shape", FP8_SHAPES)
@pytest.mark.parametrize("scale_dtype", [E8M0, torch.float32, torch.uint8])
def test_fp8_dequantisation_matches_transformers_and_the_bits(shape, scale_dtype):
    weight, scale = random_fp8(shape, scale_dtype)
    ours = q.dequantize_fp8(weight, scale, torch.float32)
    by_hand = fp8_dequant_by_hand(weight, scale)
    assert torch.equal(ours, by_hand)
    if scale_dtype != torch.uint8:  # transformers reads a uint8 FP8 scale as a number, not as E8M0 bytes
        theirs = _dequantize_fp8_weight(weight, scale, [128, 128], torch.float32)
        assert torch.equal(ours, theirs)
    assert torch.equal(q.dequantize_fp8(weight, scale, torch.bfloat16), by_hand.bfloat16())


@pytest.mark.parametrize("shape", [(64, 96), (2, 48, 256), (64, 48), (3, 10)])
def test_mxfp4_dequantisation_matches_transformers_and_the_bits(shape):
    packed, scale = random_mxfp4(shape)
    ours = q.dequantize_mxfp4(packed, scale, torch.float32)
    assert ours.shape == shape
    assert torch.equal(ours, mxfp4_dequant_by_hand(packed, scale))
    if shape[-1] % 32 == 0:  # transformers derives the block from the scale grid: whole blocks only
        theirs = Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=torch.float32)
        assert torch.equal(ours, theirs)
    assert torch.equal(q.dequantize_mxfp4(packed.view(torch.uint8), scale.view(torch.uint8)), ours)


def spread_values(shape, seed=0):
    """Random values with block magnitudes from 2^-20 to 2^20, an all-zero region and tiny negatives (-0 codes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-20, 20, shape[:-1] + (1,), generator=g)
    x[..., :3, :40] = 0.0
    x[..., -1, :5] = -1e-30
    return x


@pytest.mark.parametrize("shape", FP8_SHAPES)
@pytest.mark.parametrize("scale_dtype", [E8M0, torch.float32])
def test_fp8_requantisation_reproduces_bytes_and_scales(shape, scale_dtype):
    weight, scale = q.quantize_fp8(spread_values(shape), scale_dtype)
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == scale_dtype
    assert tuple(scale.shape) == q.fp8_scale_shape(shape)
    again, again_scale = q.quantize_fp8(q.dequantize_fp8(weight, scale), scale_dtype)
    assert torch.equal(again.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(again_scale.view(torch.uint8), scale.view(torch.uint8))


@pytest.mark.parametrize("shape", [(64, 96), (2, 48, 256), (64, 48), (3, 10)])
@pytest.mark.parametrize("packed_dtype", [torch.int8, torch.uint8])
def test_mxfp4_requantisation_reproduces_bytes_and_scales(shape, packed_dtype):
    packed, scale = q.quantize_mxfp4(spread_values(shape), packed_dtype)
    assert packed.dtype == packed_dtype and tuple(scale.shape) == q.mxfp4_scale_shape(shape)
    again, again_scale = q.quantize_mxfp4(q.dequantize_mxfp4(packed, scale), packed_dtype)
    assert torch.equal(again.view(torch.uint8), packed.view(torch.uint8))
    assert torch.equal(again_scale.view(torch.uint8), scale.view(torch.uint8))


def test_random_release_bytes_requantise_to_the_same_values():
    """Arbitrary MXFP4 bytes (not made by our quantiser) dequantise and re-quantise to the same values."""
    packed, scale = random_mxfp4((32, 64))
    values = q.dequantize_mxfp4(packed, scale)
    assert torch.equal(q.dequantize_mxfp4(*q.quantize_mxfp4(values)), values)


def test_mxfp4_rounding_follows_the_spec():
    # amax 6 -> shared exponent floor(log2 6) - 2 = 0: elements are rounded as they are; ties to the even code
    row = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 5.9, 0.1, 2.9, -1.4] + [0.0] * 18)
    expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 6.0, 0.0, 3.0, -1.5] + [0.0] * 18
    packed, scale = q.quantize_mxfp4(row[None])
    assert scale.view(torch.uint8).item() == 127
    out = q.dequantize_mxfp4(packed, scale)[0]
    assert out.tolist() == expected and torch.signbit(out[8])
    # amax 7.9: exponent still 0 (floor(log2 7.9) = 2); 7.9 saturates to 6; amax 8 -> exponent 1
    assert q.dequantize_mxfp4(*q.quantize_mxfp4(torch.tensor([[7.9, 1.0]])))[0].tolist() == [6.0, 1.0]
    packed, scale = q.quantize_mxfp4(torch.tensor([[8.0, 1.0]]))
    assert scale.view(torch.uint8).item() == 128 and q.dequantize_mxfp4(packed, scale)[0].tolist() == [8.0, 1.0]


def test_fp8_scale_rules():
    x = spread_values((300, 260), seed=3)
    weight, scale = q.quantize_fp8(x, E8M0)
    exponents = scale.view(torch.uint8).long() - 127
    blocks = torch.nn.functional.pad(x, (0, 124, 0, 84)).reshape(3, 128, 3, 128).abs().amax(dim=(1, 3))
    for (i, j), amax in zip(torch.cartesian_prod(torch.arange(3), torch.arange(3)).tolist(), blocks.flatten().tolist()):
        e = exponents[i, j].item()
        if amax == 0:
            assert e == -127
        else:  # the smallest e with amax / 2^e <= 464, by hand
            assert amax / 2.0**e <= 464 < amax / 2.0 ** (e - 1), (i, j, amax, e)
    # every element is the nearest E4M3 value (half a step of the 3-bit mantissa, relative)
    scaled = x / q.dequantize_fp8(torch.ones_like(weight, dtype=torch.float32).to(torch.float8_e4m3fn), scale)
    decoded = weight.float()
    normal = scaled.abs() >= 2.0**-6
    step = 2.0 ** (torch.floor(torch.log2(scaled.abs().clamp(min=2.0**-6))) - 3)
    assert ((scaled - decoded).abs() <= step / 2 + 1e-12)[normal].all()
    # float32 scales: amax / 448 up to the fixed-point step (a few ulp)
    _, f32 = q.quantize_fp8(x, torch.float32)
    assert torch.allclose(f32[blocks > 0], blocks[blocks > 0] / 448, rtol=1e-6, atol=0)


def deepseek_rule_fp8():
    """A 256 x 384 tensor quantised with DeepSeek's E8M0 rule e = ceil(log2(amax / 448)); block (0, 0) has
    amax 226 * 2^-6, so its largest |q| rounds to 224 (a block with a second encoding)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 384, generator=g)
    x[0, 0] = 226 * 2.0 ** -6 * 1.0  # block (0, 0): amax = 226 * 2^-6 -> DeepSeek e = -6, rounds to 224
    x[:128, :128].clamp_(-226 * 2.0**-6, 226 * 2.0**-6)
    amax = x.reshape(2, 128, 3, 128).abs().amax(dim=(1, 3))
    e = torch.ceil(torch.log2(amax / 448))
    theirs = (x.reshape(2, 128, 3, 128) / 2.0 ** e[:, None, :, None]).reshape(256, 384).to(torch.float8_e4m3fn)
    return theirs, (e + 127).to(torch.uint8).view(E8M0)


def test_deepseek_rule_blocks_keep_their_values():
    """Without the source's scales, the block whose largest |q| is 224 comes back in its second encoding
    (2q at e - 1, the same values); all other blocks come back byte for byte."""
    theirs, their_scale = deepseek_rule_fp8()
    values = q.dequantize_fp8(theirs, their_scale)
    ours, our_scale = q.quantize_fp8(values, E8M0)
    assert torch.equal(q.dequantize_fp8(ours, our_scale), values)
    qmax = theirs.float().abs().reshape(2, 128, 3, 128).amax(dim=(1, 3))
    same = our_scale.view(torch.uint8) == their_scale.view(torch.uint8)
    assert qmax[0, 0] == 224 and not same[0, 0]
    assert same[qmax != 224].all() and (qmax != 224).sum() == 5


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_kept_scales_reproduce_a_deepseek_rule_release_byte_for_byte(model_dtype):
    theirs, their_scale = deepseek_rule_fp8()
    values = q.dequantize_fp8(theirs, their_scale, model_dtype)   # what an import holds
    ours, our_scale = q.quantize_fp8(values, E8M0, keep_scale=their_scale)
    assert same_bytes(ours, theirs) and same_bytes(our_scale, their_scale)


def test_kept_float32_scales_reproduce_arbitrary_scales_byte_for_byte():
    weight, scale = random_fp8((200, 300), torch.float32)   # random scales: not fixed points of our rule
    values = q.dequantize_fp8(weight, scale)
    ours, our_scale = q.quantize_fp8(values, torch.float32, keep_scale=scale)
    assert same_bytes(ours, weight) and same_bytes(our_scale, scale)
    fresh, fresh_scale = q.quantize_fp8(values, torch.float32)
    assert not same_bytes(fresh_scale, scale)   # control: without them the scales differ


def test_kept_mxfp4_scales_reproduce_another_rules_bytes():
    """Blocks whose codes stay below 4 (|v| <= 2^e * 3): the spec's rule picks e - 1 for them, the kept scale e."""
    packed, scale = random_mxfp4((16, 64), seed=2)
    raw = packed.view(torch.uint8)
    low = torch.arange(16) % 2 == 0
    raw[low] = raw[low] & 0xBB   # even rows: every code's magnitude bits limited to 0..3 (|v| <= 1.5)
    values = q.dequantize_mxfp4(packed, scale, torch.bfloat16)
    ours, our_scale = q.quantize_mxfp4(values, keep_scale=scale)
    assert same_bytes(ours, packed) and same_bytes(our_scale, scale)
    _, fresh_scale = q.quantize_mxfp4(values)
    assert not torch.equal(fresh_scale.view(torch.uint8)[low], scale.view(torch.uint8)[low])   # control


def test_a_block_whose_values_changed_gets_a_fresh_scale():
    theirs, their_scale = deepseek_rule_fp8()
    values = q.dequantize_fp8(theirs, their_scale)
    values[0, 1] = 0.123456789   # "trained": off the block's grid
    ours, our_scale = q.quantize_fp8(values, E8M0, keep_scale=their_scale)
    _, fresh_scale = q.quantize_fp8(values, E8M0)
    kept = our_scale.view(torch.uint8) == their_scale.view(torch.uint8)
    assert not kept[0, 0] and our_scale.view(torch.uint8)[0, 0] == fresh_scale.view(torch.uint8)[0, 0]
    assert kept.flatten()[1:].all()
    assert same_bytes(ours[128:], theirs[128:]) and same_bytes(ours[:128, 128:], theirs[:128, 128:])


def test_a_kept_scale_of_another_geometry_is_refused():
    with pytest.raises(q.QuantizationError, match=r"w: kept scale \[2, 3\] .* does not match the scale being "
                                                  r"written \(\[2, 2\]"):
        q.quantize_fp8(torch.ones(256, 256), E8M0, name="w", keep_scale=torch.zeros(2, 3, dtype=torch.uint8))


def test_bad_input_is_one_error_naming_the_tensor():
    weight, scale = q.quantize_fp8(torch.randn(200, 300))
    with pytest.raises(q.QuantizationError, match=r"layers\.0\.attn\.wq_a\.weight: scale shape \[2, 2\] does not match"):
        q.dequantize_fp8(weight, scale[:, :2], name="layers.0.attn.wq_a.weight")
    with pytest.raises(q.QuantizationError, match=r"w1: a weight with a scale must be .* got torch.bfloat16"):
        q.dequantize(torch.zeros(4, 4, dtype=torch.bfloat16), scale, name="w1")
    with pytest.raises(q.QuantizationError, match=r"w2: FP8 scale dtype torch.float16"):
        q.dequantize_fp8(weight, scale.float().half(), name="w2")
    packed, mx_scale = q.quantize_mxfp4(torch.randn(8, 48))
    with pytest.raises(q.QuantizationError, match=r"w3: scale shape \[8, 1\] does not match 32-element"):
        q.dequantize_mxfp4(packed, mx_scale[:, :1], name="w3")
    with pytest.raises(q.QuantizationError, match="w4: MXFP4 packs two values per byte"):
        q.quantize_mxfp4(torch.randn(4, 5), name="w4")
    with pytest.raises(q.QuantizationError, match="w5: cannot quantise a tensor with inf or NaN"):
        q.quantize_fp8(torch.tensor([[1.0, float("nan")]]), name="w5")
    with pytest.raises(q.QuantizationError, match="w6: MXFP4 scale holds the E8M0 NaN code"):
        q.dequantize_mxfp4(packed, torch.full_like(mx_scale.view(torch.uint8), 255).view(E8M0), name="w6")
