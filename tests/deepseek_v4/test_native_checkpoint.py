"""DeepSeek-V4 release checkpoints: native names, FP8 128x128 blocks, MXFP4 experts (modelzoo/deepseek_v4/release/checkpoint.py).

tiny_checkpoints/deepseek-v4-tiny-native is the tiny model (q_lora_rank 144, moe_intermediate 48: dims
that are not multiples of 128 / 32) quantised by modelzoo/deepseek_v4/release/quantization.py into the release layout,
in native names, in several shards. `dequantised` below is the same checkpoint dequantised to fp32 under
mapping.py's HF names: the plain import path and transformers read it.
"""

import json
import weakref

import pytest
import torch
from dsv4_helpers import hf_model, hf_token_logprobs, max_diff, provider_for, random_tokens
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from modelzoo.conversion.engine import megatron_tensors
from modelzoo.conversion.safetensors_io import CheckpointError, CheckpointReader
from modelzoo import runtime
from modelzoo.deepseek_v4.release import checkpoint as native
from tiny_checkpoints.deepseek_v4_tiny import write_deepseek_v4_tiny_native
from conftest import TINY

NATIVE = TINY / "deepseek-v4-tiny-native"
PARITY = 1e-4  # Megatron vs transformers, fp32: different op order only (the repo's parity tolerance; measured ~1e-6)


def read_all(folder):
    reader = CheckpointReader(folder)
    return {name: reader.get(name) for name in reader.names()}


@pytest.fixture(scope="module")
def dequantised(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dsv4native") / "dequantised"
    folder.mkdir()
    view = native.checkpoint_view(NATIVE)
    save_file({name: view.get(name) for name in view.names()}, folder / "model.safetensors")
    config = json.loads((NATIVE / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def loaded(dequantised):
    """(provider, model from the native checkpoint, model from the dequantised HF one), TP 1."""
    with runtime.parallel():
        provider = provider_for(NATIVE)
        from_native, from_hf = provider.provide(), provider.provide()
        provider.load_hf_weights(from_native, NATIVE, progress=False)
        provider.load_hf_weights(from_hf, dequantised, progress=False)
        yield provider, from_native, from_hf


def test_shipped_checkpoint_is_the_generator_output(tmp_path):
    write_deepseek_v4_tiny_native(tmp_path / "again")
    shipped = sorted(p.name for p in NATIVE.iterdir())
    assert shipped == sorted(p.name for p in (tmp_path / "again").iterdir())
    assert sum(name.startswith("model-") for name in shipped) >= 3  # sharded: imports read across files
    for name in shipped:
        assert (NATIVE / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_release_layout():
    reader = CheckpointReader(NATIVE)
    info = reader.tensors
    assert native.is_native(reader.names()) and "embed.weight" in info and "layers.0.attn.kv_norm.weight" in info
    assert info["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn and info["layers.1.attn.wq_a.weight"].shape == (144, 64)
    assert info["layers.1.attn.wq_a.scale"].shape == (2, 1) and info["layers.1.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert info["layers.1.attn.wq_b.scale"].shape == (1, 2)                                  # 144 columns: 128 + 16
    assert info["mtp.0.ffn.experts.7.w2.weight"].dtype == torch.int8 and info["mtp.0.ffn.experts.7.w2.weight"].shape == (64, 24)
    assert info["mtp.0.ffn.experts.7.w2.scale"].shape == (64, 2)                             # 48 columns: 32 + 16
    assert info["mtp.0.attn.wo_b.weight"].dtype == torch.float8_e4m3fn
    assert info["layers.0.ffn.shared_experts.w2.weight"].dtype == torch.float8_e4m3fn
    assert info["embed.weight"].dtype == info["layers.1.attn.compressor.wkv.weight"].dtype == torch.float32
    assert json.loads((NATIVE / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


def test_names_round_trip():
    reader = CheckpointReader(NATIVE)
    for name in reader.names():
        if name.endswith(".scale"):
            continue
        assert native.hf_to_native(native.native_to_hf(name)) == name
    assert native.native_to_hf("layers.3.attn.kv_norm.weight") == "model.layers.3.attn.norm.weight"
    assert native.native_to_hf("mtp.0.attn.kv_norm.weight") == "mtp.0.attn.kv_norm.weight"
    assert native.native_to_hf("hc_head_fn") == "model.hc_head.hc_fn"


def test_dequantisation_agrees_with_transformers(dequantised):
    """Every quantised tensor of the release checkpoint, dequantised by the import path, equals transformers'
    own dequantisers (FP8: `_dequantize_fp8_weight`, ragged edges included; MXFP4: `Fp8Dequantize`, whole
    32-column blocks only, so the 48-column w2 is checked against test_quantization's bit decoder); exact."""
    from test_quantization import mxfp4_dequant_by_hand
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    reader, ours = CheckpointReader(NATIVE), load_file(dequantised / "model.safetensors")
    counts = {"fp8": 0, "mxfp4": 0, "mxfp4 ragged": 0}
    for name in reader.names():
        if not name.endswith(".scale"):
            continue
        weight_name = name[: -len(".scale")] + ".weight"
        weight, scale, mine = reader.get(weight_name), reader.get(name), ours[native.native_to_hf(weight_name)]
        if weight.dtype == torch.float8_e4m3fn:
            counts["fp8"] += 1
            assert torch.equal(mine, _dequantize_fp8_weight(weight, scale, [128, 128], torch.float32)), name
        elif weight.shape[-1] * 2 % 32 == 0:
            counts["mxfp4"] += 1
            assert torch.equal(mine, Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)), name
        else:
            counts["mxfp4 ragged"] += 1
            assert torch.equal(mine, mxfp4_dequant_by_hand(weight, scale)), name
    assert min(counts.values()) > 0, counts


def test_native_import_equals_dequantised_import(loaded):
    """Exact: the same dequantised weights by two paths (native names + on-the-fly dequantisation vs a plain
    fp32 HF checkpoint), every tensor including mtp.*, and the same log-probs bit for bit."""
    provider, from_native, from_hf = loaded
    a, b = megatron_tensors(from_native), megatron_tensors(from_hf)
    assert any(name.startswith("mtp.") for name in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ids = random_tokens(batch=1)
    with torch.no_grad():
        assert torch.equal(provider.token_logprobs(from_native, ids), provider.token_logprobs(from_hf, ids))


def test_matches_transformers(loaded, dequantised):
    provider, from_native, _ = loaded
    ids = random_tokens(batch=1)
    with torch.no_grad():
        ours = provider.token_logprobs(from_native, ids)
        theirs = hf_token_logprobs(hf_model(dequantised), ids)
    assert max_diff(ours, theirs) < PARITY


def test_export_native_fp8_reproduces_the_release_bytes(loaded, tmp_path):
    provider, from_native, _ = loaded
    native.save(provider, from_native, tmp_path / "out", naming="native", quantize="fp8", max_shard_bytes=256 * 1024)
    ours, release = read_all(tmp_path / "out"), read_all(NATIVE)
    assert sorted(ours) == sorted(release)
    for name, tensor in release.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((NATIVE / "config.json").read_text())


def test_export_hf_names_full_and_bf16(loaded, dequantised, tmp_path):
    provider, from_native, _ = loaded
    native.save(provider, from_native, tmp_path / "hf", naming="hf")
    reference = load_file(dequantised / "model.safetensors")
    ours = read_all(tmp_path / "hf")
    assert sorted(ours) == sorted(reference) and all(torch.equal(ours[n], reference[n]) for n in reference)
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    native.save(provider, from_native, tmp_path / "bf16", naming="native", dtype=torch.bfloat16)
    bf16 = read_all(tmp_path / "bf16")
    for name, tensor in reference.items():
        assert torch.equal(bf16[native.hf_to_native(name)], tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor)


def test_export_hf_names_fp8_and_float32_scales_are_kept(loaded, tmp_path):
    """A release checkpoint with float32 block scales: read, re-exported with the source's scale format (F32)."""
    source = tmp_path / "f32"
    write_deepseek_v4_tiny_native(source, scale_format="f32")
    provider, model, _ = loaded
    provider.load_hf_weights(model, source, progress=False)  # (the fixture holds the parallel state)
    native.save(provider, model, tmp_path / "out", naming="native", quantize="fp8", source_dir=source)
    native.save(provider, model, tmp_path / "hf_fp8", naming="hf", quantize="fp8", source_dir=source)
    provider.load_hf_weights(model, NATIVE, progress=False)  # leave the shared model as it was
    ours, release = read_all(tmp_path / "out"), read_all(source)
    assert release["layers.0.attn.wq_a.scale"].dtype == torch.float32
    for name, tensor in release.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name
    hf = CheckpointReader(tmp_path / "hf_fp8")
    assert hf.tensors["model.layers.0.attn.wq_a.weight_scale_inv"].dtype == torch.float32
    assert not native.is_native(hf.names())
    view, view_native = native.checkpoint_view(hf), native.checkpoint_view(source)
    for name in view.names():  # the HF-named FP8 checkpoint reads back to the same values
        assert torch.equal(view.get(name), view_native.get(name)), name


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of CPU tensor storages that torch ops allocate while active (model storages excluded)."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude, self.live, self.current, self.peak = exclude, {}, 0, 0

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr == 0 or ptr in self.exclude:
                continue
            if ptr not in self.live:
                self.live[ptr] = [t.untyped_storage().nbytes(), 0]
                self.current += self.live[ptr][0]
                self.peak = max(self.peak, self.current)
            self.live[ptr][1] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def test_import_memory_is_one_tensor_at_a_time(loaded):
    """Peak tensor memory that torch allocates while importing the sharded native checkpoint, beyond the
    model itself, is bounded by 2x the largest Megatron tensor in fp32: one Megatron tensor's sources
    (dequantised) plus the full tensor they make (the stacked experts). engine.load_hf_weights drops both
    before reading the next tensor; without that the peak measured 3.31x. Dequantising the whole
    checkpoint up front would be `total`, 30x the largest tensor."""
    provider, model, _ = loaded
    tensors = megatron_tensors(model)
    largest = max(t.numel() * 4 for t in tensors.values())
    total = sum(t.numel() * 4 for t in tensors.values())
    with LiveTensorBytes({t.untyped_storage().data_ptr() for t in tensors.values()}) as tracker:
        provider.load_hf_weights(model, NATIVE, progress=False)
    assert tracker.peak >= 2 * largest  # the tracker sees the stacked experts and their sources
    assert tracker.peak <= 2 * largest < total / 4, (tracker.peak, largest, total)


def _write(folder, tensors, config_from=NATIVE):
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_bytes((config_from / "config.json").read_bytes())
    return folder


def test_bad_input_names_the_tensor(tmp_path):
    tensors = read_all(NATIVE)
    no_scale = dict(tensors)
    del no_scale["layers.2.attn.wo_a.scale"]
    with pytest.raises(CheckpointError, match=r"tensor layers\.2\.attn\.wo_a\.weight is torch.float8_e4m3fn but has no scale"):
        native.checkpoint_view(_write(tmp_path / "a", no_scale))
    geometry = dict(tensors)
    geometry["layers.1.attn.wq_a.scale"] = geometry["layers.1.attn.wq_a.scale"][:1]
    with pytest.raises(CheckpointError, match=r"tensor layers\.1\.attn\.wq_a\.weight: scale shape \[1, 1\] does not match 128x128"):
        native.checkpoint_view(_write(tmp_path / "b", geometry))
    mx = dict(tensors)
    mx["layers.0.ffn.experts.3.w2.scale"] = torch.cat([mx["layers.0.ffn.experts.3.w2.scale"]] * 2, dim=1)
    with pytest.raises(CheckpointError, match=r"tensor layers\.0\.ffn\.experts\.3\.w2\.weight: scale shape \[64, 4\]"):
        native.checkpoint_view(_write(tmp_path / "c", mx))
    dtype = dict(tensors)
    dtype["layers.3.attn.wkv.weight"] = dtype["layers.3.attn.wkv.weight"].to(torch.float16)
    with pytest.raises(CheckpointError, match=r"tensor layers\.3\.attn\.wkv\.weight: a weight with a scale must be .* got torch.float16"):
        native.checkpoint_view(_write(tmp_path / "d", dtype))
    orphan = dict(tensors)
    del orphan["layers.0.attn.wq_b.weight"]
    with pytest.raises(CheckpointError, match=r"scale layers\.0\.attn\.wq_b\.scale has no weight layers\.0\.attn\.wq_b\.weight"):
        native.checkpoint_view(_write(tmp_path / "e", orphan))
    mixed = {**tensors, "model.norm.weight": tensors["norm.weight"].clone()}
    with pytest.raises(CheckpointError, match="mixes native names"):
        native.checkpoint_view(_write(tmp_path / "f", mixed))
