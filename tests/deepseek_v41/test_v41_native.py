"""DeepSeek-V4.1 release checkpoints (modelzoo/deepseek_v41/release.py over DeepSeek-V4's release machinery):
native names, FP8 32 x 32 blocks, FP4 routed experts with E8M0 scales, FP8 Engram tables whose scale the model holds.

tiny_checkpoints/deepseek-v41-tiny-native is the tiny model (q_lora_rank and moe_intermediate_size 48: partial
32-blocks) in the release layout, sharded, with a bf16 vision tower and aligner to carry through. `dequantised` is
the same checkpoint read by the import path and written under transformers main's names in fp32: independent
dequantisers (transformers' FP8 one, a bit-level FP4 decoder) check it, and our reference reads it for parity.
The CLI round trips are in test_v41_native_cli.py (a module of their own: the CLI starts its own parallel state).
"""

import json

import pytest
import torch
from dsv41_helpers import next_token_logprobs, random_rows
from safetensors.torch import load_file, save_file

from conftest import TINY
from modelzoo import build_provider, runtime
from modelzoo.conversion.engine import megatron_tensors
from modelzoo.conversion.safetensors_io import CheckpointError, CheckpointReader
from modelzoo.deepseek_v4.release import checkpoint as release
from modelzoo.deepseek_v41.release import DEEPSEEK_V41, hf_to_native, native_to_hf
from tiny_checkpoints.deepseek_v41_tiny import write_deepseek_v41_tiny_native

NATIVE = TINY / "deepseek-v41-tiny-native"
LOGPROB_TOLERANCE = 1e-5  # the bar (fp32), as in test_v41_megatron_parity.py


def write_dequantised(folder):
    """The native tiny as the import path reads it (dequantised, transformers main's names), fp32, with its config
    (no quantization_config) and tokenizer."""
    folder.mkdir(parents=True)
    view = release.checkpoint_view(NATIVE, release=DEEPSEEK_V41)
    save_file({name: view.get(name).contiguous() for name in view.names()}, folder / "model.safetensors")
    config = json.loads((NATIVE / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_bytes((NATIVE / "tokenizer.json").read_bytes())
    return folder


def read_all(folder) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    try:
        return {name: reader.get(name) for name in reader.names()}
    finally:
        reader.close()


def assert_same_bytes(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.fixture(scope="module")
def dequantised(tmp_path_factory):
    return write_dequantised(tmp_path_factory.mktemp("v41native") / "dequantised")


def test_shipped_checkpoint_is_the_generator_output(tmp_path):
    write_deepseek_v41_tiny_native(tmp_path / "again")
    shipped = sorted(path.name for path in NATIVE.iterdir())
    assert shipped == sorted(path.name for path in (tmp_path / "again").iterdir())
    assert sum(name.startswith("model-") for name in shipped) >= 3  # sharded: imports read across files
    for name in shipped:
        assert (NATIVE / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_release_layout():
    info = CheckpointReader(NATIVE).tensors
    assert "embed.weight" in info and "head.weight" in info and not any(name.startswith("model.") for name in info)
    fp8 = torch.float8_e4m3fn
    for name in ("layers.2.attn.wq_a", "layers.2.attn.wq_b", "layers.2.attn.wkv", "layers.2.attn.wo_a",
                 "layers.2.attn.wo_b", "layers.2.attn.indexer.wq_b", "layers.1.ffn.shared_experts.w2",
                 "layers.1.engram.wkv", "mtp.0.attn.wq_b"):
        weight, scale = info[f"{name}.weight"], info[f"{name}.scale"]
        rows, cols = weight.shape
        assert weight.dtype == fp8 and scale.dtype == torch.float8_e8m0fnu, name
        assert scale.shape == (-(-rows // 32), -(-cols // 32)), name                        # 32 x 32 blocks
    assert info["layers.2.attn.wq_a.weight"].shape == (48, 64) and info["layers.2.attn.wq_a.scale"].shape == (2, 2)
    expert, expert_scale = info["mtp.2.ffn.experts.3.w2.weight"], info["mtp.2.ffn.experts.3.w2.scale"]
    assert expert.dtype == torch.int8 and expert.shape == (64, 24) and expert_scale.shape == (64, 2)  # FP4, 48 columns
    table, table_scale = info["layers.4.engram.embed.weight"], info["layers.4.engram.embed.scale"]
    assert table.dtype == fp8 and table.shape == (306, 32) and table_scale.shape == (306, 1)  # a scale per 32 channels
    assert table_scale.dtype == torch.float8_e8m0fnu
    for name in ("embed.weight", "layers.2.attn.compressor.wkv.weight", "layers.2.attn.indexer.wk.weight",
                 "layers.2.attn.indexer.weights_proj.weight", "layers.2.ffn.gate.bias_vl", "layers.1.engram.q_weight",
                 "mtp.2.markov_head.embed.weight", "mtp.0.main_proj.weight", "image_start"):
        assert info[name].dtype == torch.float32, name
    assert info["vision.patch_embed.weight"].dtype == info["aligner.proj.weight"].dtype == torch.bfloat16
    config = json.loads((NATIVE / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [32, 32] and config["scale_fmt"] == "ue8m0" and config["expert_dtype"] == "fp4"


def test_names_round_trip():
    for name in CheckpointReader(NATIVE).names():
        if name.endswith(".scale") and not name.endswith("engram.embed.scale"):
            continue
        assert hf_to_native(native_to_hf(name)) == name
    assert native_to_hf("layers.3.attn.wq_a.weight") == "model.layers.3.attn.wq_a.weight"
    assert native_to_hf("head.weight") == "lm_head.weight" and native_to_hf("embed.weight") == "model.embed.weight"
    assert native_to_hf("mtp.2.markov_head.head.weight") == "mtp.2.markov_head.head.weight"
    assert native_to_hf("vision.patch_embed.weight") == "vision.patch_embed.weight"


def e2m1_by_hand(code: int) -> float:
    """An FP4 (E2M1) code from its bits: sign, two exponent bits (bias 1), one mantissa bit; subnormal at e = 0."""
    sign, exponent, mantissa = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (mantissa / 2 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2))


def fp4_dequant_by_hand(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Two codes a byte (element 2j in the low nibble), one E8M0 scale (2^(byte - 127)) per 32 elements of a row."""
    table = torch.tensor([e2m1_by_hand(code) for code in range(16)], dtype=torch.float64)
    raw = packed.view(torch.uint8).long()
    values = torch.stack((table[raw & 15], table[raw >> 4]), -1).flatten(-2)
    scales = 2.0 ** (scale.view(torch.uint8).double() - 127)
    return (values * scales.repeat_interleave(32, -1)[..., : values.shape[-1]]).float()


def test_dequantisation_agrees_with_independent_dequantisers(dequantised):
    """FP8 (32 x 32 blocks, ragged edges included): transformers' `_dequantize_fp8_weight`; FP4: a bit-level
    decoder written from the format; the Engram tables: their E4M3 codes and E8M0 scales as two tensors, exact."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    reader, ours = CheckpointReader(NATIVE), load_file(dequantised / "model.safetensors")
    counts = {"fp8": 0, "fp4": 0, "engram": 0}
    for name in reader.names():
        if not name.endswith(".scale"):
            continue
        weight_name = name.removesuffix(".scale") + ".weight"
        weight, scale, mine = reader.get(weight_name), reader.get(name), ours[native_to_hf(weight_name)]
        if ".engram.embed." in name:
            counts["engram"] += 1
            assert torch.equal(mine, weight.float()), name
            exponents = scale.view(torch.uint8).double() - 127
            assert torch.equal(ours[native_to_hf(name)], (2.0 ** exponents).float()), name
        elif weight.dtype == torch.float8_e4m3fn:
            counts["fp8"] += 1
            assert torch.equal(mine, _dequantize_fp8_weight(weight, scale, [32, 32], torch.float32)), name
        else:
            counts["fp4"] += 1
            assert torch.equal(mine, fp4_dequant_by_hand(weight, scale)), name
    assert counts["engram"] == 2 and min(counts.values()) > 0, counts
    assert ours["vision.patch_embed.weight"].dtype == torch.bfloat16  # carried as stored


@pytest.fixture(scope="module")
def loaded(dequantised):
    """(provider, model imported from the native checkpoint, model imported from the dequantised one), TP 1."""
    with runtime.parallel():
        provider = build_provider(NATIVE)
        from_native, from_hf = provider.provide(), provider.provide()
        provider.load_hf_weights(from_native, progress=False)
        provider.load_hf_weights(from_hf, dequantised, progress=False)
        yield provider, from_native, from_hf


def test_native_import_equals_dequantised_import_and_matches_the_reference(loaded, dequantised):
    from modelzoo.deepseek_v41 import DeepseekV41ForCausalLM

    provider, from_native, from_hf = loaded
    a, b = megatron_tensors(from_native), megatron_tensors(from_hf)
    assert any(name.startswith("carried.") for name in a) and any(name.startswith("mtp.") for name in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    rows = random_rows(2, 64, seed=3)
    reference = DeepseekV41ForCausalLM.from_pretrained(dequantised, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = next_token_logprobs(from_native(rows, runtime_gather_output=True)[..., :provider.vocab_size], rows)
        theirs = next_token_logprobs(reference(rows, use_cache=True).logits, rows)
    assert (ours - theirs).abs().max() <= LOGPROB_TOLERANCE


def test_export_both_namings(loaded, dequantised, tmp_path):
    """native + fp8: the release's bytes (kept nowhere: the model's values re-quantised by our rules, the Engram
    tables with the scales the model holds); hf: the dequantised checkpoint, without a quantization_config."""
    provider, from_native, _ = loaded
    release.save(provider, from_native, tmp_path / "native", naming="native", quantize="fp8", source_dir=NATIVE,
                 release=DEEPSEEK_V41, max_shard_bytes=256 * 1024)
    assert_same_bytes(read_all(tmp_path / "native"), read_all(NATIVE))
    assert json.loads((tmp_path / "native" / "config.json").read_text()) == \
        json.loads((NATIVE / "config.json").read_text())
    release.save(provider, from_native, tmp_path / "hf", naming="hf", source_dir=NATIVE, release=DEEPSEEK_V41)
    assert_same_bytes(read_all(tmp_path / "hf"), load_file(dequantised / "model.safetensors"))
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_a_trained_engram_table_is_requantised_not_truncated(loaded, tmp_path):
    """Values off the FP8 grid (a trained table): fresh scales per 32 channels, within E4M3's rounding."""
    provider, from_native, _ = loaded
    table = from_native.decoder.layers[1].engram.table.weight
    before = table.detach().clone()
    with torch.no_grad():
        table.mul_(1.37)
    try:
        release.save(provider, from_native, tmp_path / "trained", naming="native", quantize="fp8",
                     source_dir=NATIVE, release=DEEPSEEK_V41)
    finally:
        with torch.no_grad():
            table.copy_(before)
    out = read_all(tmp_path / "trained")
    codes, scale = out["layers.1.engram.embed.weight"], out["layers.1.engram.embed.scale"]
    values = codes.float() * (2.0 ** (scale.view(torch.uint8).float() - 127)).repeat_interleave(32, -1)
    original = read_all(NATIVE)
    wanted = original["layers.1.engram.embed.weight"].float() * 1.37 * \
        (2.0 ** (original["layers.1.engram.embed.scale"].view(torch.uint8).float() - 127))
    assert not torch.equal(codes.view(torch.uint8), original["layers.1.engram.embed.weight"].view(torch.uint8))
    assert ((values - wanted).abs() <= wanted.abs() * 2 ** -4 + 1e-30).all()  # E4M3: 3 mantissa bits


def test_a_scale_of_the_wrong_block_is_refused_by_name(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    tensors = read_all(NATIVE)
    tensors["layers.2.attn.wq_a.scale"] = tensors["layers.2.attn.wq_a.scale"][:1]  # a 128-block grid
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wq_a\.weight.*32x32 blocks"):
        release.checkpoint_view(folder, release=DEEPSEEK_V41)


def test_the_reference_reads_the_release_as_its_dequantised_twin(dequantised):
    """Our reference's from_pretrained on the release checkpoint (as transformers main reads the release: renamed,
    dequantised) gives the weights it reads from the dequantised HF-named twin, every one, with nothing to report."""
    from modelzoo.deepseek_v41 import DeepseekV41ForCausalLM

    native, info = DeepseekV41ForCausalLM.from_pretrained(NATIVE, dtype=torch.float32, output_loading_info=True)
    twin = DeepseekV41ForCausalLM.from_pretrained(dequantised, dtype=torch.float32)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    ours, theirs = native.state_dict(), twin.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in theirs)
    assert native.model.engram_hasher.token_map.numel() == 250  # the folder's tokenizer, as on the HF path


def test_the_reference_reports_what_a_release_checkpoint_lacks(tmp_path):
    from modelzoo.deepseek_v41 import DeepseekV41ForCausalLM

    folder = tmp_path / "lacking"
    folder.mkdir()
    tensors = read_all(NATIVE)
    del tensors["layers.3.attn.wo_b.weight"], tensors["layers.3.attn.wo_b.scale"]
    tensors["layers.3.attn.surplus.weight"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors")
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((NATIVE / name).read_bytes())
    _, info = DeepseekV41ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == ["model.layers.3.attn.wo_b.weight"]
    assert info["unexpected_keys"] == ["model.layers.3.attn.surplus.weight"]
