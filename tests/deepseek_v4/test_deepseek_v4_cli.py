"""DeepSeek-V4 through the CLI: HF -> Megatron (torch_dist) -> HF bit-exact at TP 1, TP 2 and EP 2, and parity at TP 2."""

import pytest
import torch
from conftest import TINY
from safetensors.torch import load_file, save_file

from modelzoo.deepseek_v4.release import quantization as q
from modelzoo.conversion.cli import main

DEEPSEEK_V4 = TINY / "deepseek-v4-tiny"


@pytest.mark.parametrize("import_layout, export_layout", [
    (["--tp", "1"], ["--tp", "1"]),
    (["--tp", "2"], ["--tp", "1"]),
    (["--ep", "2"], ["--tp", "2"]),
], ids=["tp1", "tp2-to-tp1", "ep2-to-tp2"])
def test_cli_round_trip_is_bit_exact(tmp_path, import_layout, export_layout):
    assert main(["import", str(DEEPSEEK_V4), str(tmp_path / "megatron"), *import_layout]) == 0
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "hf"), *export_layout]) == 0
    original, exported = load_file(DEEPSEEK_V4 / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(exported[k].dtype == v.dtype and torch.equal(exported[k], v) for k, v in original.items())


def test_cli_parity_at_tp2_passes():
    assert main(["parity", str(DEEPSEEK_V4), "--tp", "2"]) == 0


def test_cli_parity_of_the_native_tiny_passes_and_leaves_no_copy(tmp_path, monkeypatch):
    """Its blocks do not tile q_a_proj (144 rows) or the experts' down_proj (48 columns): transformers' loader,
    which takes the block size from the scale grid, reads those tensors otherwise (the control), so the oracle
    loads a dequantised copy (`DeepseekV4Provider.oracle_checkpoint`) in a scratch folder that goes afterwards."""
    from modelzoo import build_provider
    from modelzoo.parity import load_hf_model

    native = TINY / "deepseek-v4-tiny-native"
    provider = build_provider(native)
    with provider.oracle_checkpoint() as folder:
        assert folder != native
        copied = load_hf_model(native).state_dict()
    assert not folder.exists()
    as_read = provider.hf_model_class().from_pretrained(native).state_dict()
    differ = sorted({name.split(".", 3)[-1] for name, tensor in copied.items()
                     if not torch.equal(tensor, as_read[name].to(tensor.dtype))})
    assert differ == ["mlp.experts.down_proj", "self_attn.q_a_proj.weight"]
    with build_provider(DEEPSEEK_V4).oracle_checkpoint() as folder:  # blocks that tile: the checkpoint itself
        assert folder == DEEPSEEK_V4

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert main(["parity", str(native)]) == 0
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_an_expert_layout_that_does_not_divide_the_experts(tmp_path, capsys):
    assert main(["import", str(DEEPSEEK_V4), str(tmp_path / "out"), "--ep", "3"]) == 2
    assert "expert parallel size 3 must divide n_routed_experts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_native_release_checkpoint_round_trip(tmp_path):
    """`import` of the FP8 / MXFP4 native tiny, `export --format native --quantize fp8`: same tensors, same bytes."""
    native = TINY / "deepseek-v4-tiny-native"
    assert main(["import", str(native), str(tmp_path / "megatron"), "--tp", "2"]) == 0
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "native"), "--format", "native",
                 "--quantize", "fp8", "--max-shard-bytes", str(256 * 1024)]) == 0
    original = {k: v for f in sorted(native.glob("*.safetensors")) for k, v in load_file(f).items()}
    exported = {k: v for f in sorted((tmp_path / "native").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported.keys() == original.keys()
    assert all(exported[k].dtype == v.dtype and torch.equal(exported[k], v) for k, v in original.items())


def test_cli_refuses_native_format_for_a_model_without_one(tmp_path, capsys):
    assert main(["import", str(TINY / "llama-tiny"), str(tmp_path / "out"), "--format", "native"]) == 2
    assert "llama checkpoints have only the 'hf' naming, not 'native'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _ceil_rule_release(tensors: dict) -> dict:
    """The native tiny re-quantised by another quantiser's rule, e = ceil(log2(amax / max code)) per block
    (DeepSeek's FP8 rule; the same for MXFP4), which leaves blocks that our rule would encode differently:
    FP8 blocks whose largest |q| is 224 (one is forced) and MXFP4 blocks whose largest |code| is 3."""
    out = {}
    forced = False
    for name, weight in tensors.items():
        scale_name = name.removesuffix(".weight") + ".scale"
        if name.endswith(".scale") or scale_name not in tensors:   # unquantised: bf16, as in a release
            out.setdefault(name, weight.bfloat16() if weight.is_floating_point() and weight.dtype != q.E8M0 else weight)
            continue
        values = q.dequantize(weight, tensors[scale_name]) * 0.55   # off our own grid: 6 * 0.55 -> code 3
        if q.quantized_format(weight.dtype) == "fp8":
            if not forced:   # block (0, 0)'s largest magnitude to 226 * 2^j: its largest code rounds to 224
                block = values[:128, :128]
                at = block.abs().argmax()
                peak = block.flatten()[at]
                block.view(-1)[at] = torch.sign(peak) * 226 * 2.0 ** torch.round(torch.log2(peak.abs() / 226))
                forced = True
            rows, cols = values.shape
            padded = torch.nn.functional.pad(values, (0, -cols % 128, 0, -rows % 128))
            blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
            e = torch.ceil(torch.log2(blocks.abs().amax(dim=(1, 3)) / 448))
            codes = (blocks / 2.0 ** e[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)
            out[name], out[scale_name] = codes[:rows, :cols].contiguous(), (e + 127).to(torch.uint8).view(q.E8M0)
        else:
            rows, cols = values.shape
            blocks = torch.nn.functional.pad(values, (0, -cols % 32)).reshape(rows, -1, 32)
            e = torch.ceil(torch.log2(blocks.abs().amax(dim=-1) / 6))
            nibbles = q._e2m1_encode(blocks / 2.0 ** e[..., None]).flatten(-2)[..., :cols]
            packed = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).view(weight.dtype)
            out[name], out[scale_name] = packed.contiguous(), (e + 127).to(torch.uint8).view(q.E8M0)
    return out


def test_cli_round_trip_of_another_quantisers_release_is_byte_exact(tmp_path):
    """import -> export --format native --quantize fp8 of a release our quantiser would not have written:
    the kept source scales make every byte come back (the acceptance: lossless for real checkpoints)."""
    native = TINY / "deepseek-v4-tiny-native"
    source = {k: v for f in sorted(native.glob("*.safetensors")) for k, v in load_file(f).items()}
    release = _ceil_rule_release(source)
    (tmp_path / "release").mkdir()
    save_file(release, tmp_path / "release" / "model.safetensors")
    (tmp_path / "release" / "config.json").write_bytes((native / "config.json").read_bytes())
    # control: without the kept scales, re-quantising changes FP8 and MXFP4 bytes
    changed = {q.quantized_format(w.dtype) for n, w in release.items() if n.removesuffix(".weight") + ".scale" in release
               and not torch.equal(q.quantize(q.dequantize(w, release[n.removesuffix(".weight") + ".scale"]),
                                              q.quantized_format(w.dtype))[0].view(torch.uint8), w.view(torch.uint8))}
    assert changed == {"fp8", "mxfp4"}

    assert main(["import", str(tmp_path / "release"), str(tmp_path / "megatron"), "--dtype", "bfloat16"]) == 0
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "exported"), "--format", "native",
                 "--quantize", "fp8"]) == 0
    exported = {k: v for f in sorted((tmp_path / "exported").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported.keys() == release.keys()
    for name, tensor in release.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name].view(torch.uint8),
                                                                    tensor.view(torch.uint8)), name


# --- a checkpoint written by transformers' save_pretrained: no mtp.* tensors, num_nextn_predict_layers kept ----------
NO_MTP_WARNING = "has no mtp.* tensors although its config.json sets num_nextn_predict_layers=1"


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory):
    import json

    from transformers import DeepseekV4ForCausalLM

    folder = tmp_path_factory.mktemp("saved-by-transformers") / "checkpoint"
    DeepseekV4ForCausalLM.from_pretrained(DEEPSEEK_V4, dtype=torch.float32).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any(name.startswith("mtp.") for name in load_file(folder / "model.safetensors"))
    return folder


def test_a_checkpoint_without_mtp_round_trips_through_torch_dist_with_one_warning(saved_by_transformers, tmp_path, capfd):
    assert main(["import", str(saved_by_transformers), str(tmp_path / "megatron"), "--tp", "2"]) == 0
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "hf")]) == 0
    warnings = [line for line in capfd.readouterr().err.splitlines() if "mtp" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"deepseek_v4: {saved_by_transformers} {NO_MTP_WARNING}")
    original, exported = load_file(saved_by_transformers / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], v) for k, v in original.items())


def test_logprobs_of_a_checkpoint_without_mtp_match_transformers(saved_by_transformers, tmp_path, caplog):
    import json

    from dsv4_helpers import hf_model, hf_token_logprobs, random_tokens

    ids = random_tokens(batch=1, seq=48)
    (tmp_path / "tokens.json").write_text(json.dumps(ids.tolist()))
    assert main(["logprobs", str(saved_by_transformers), "--tokens", str(tmp_path / "tokens.json"),
                 "--out", str(tmp_path / "out.json")]) == 0
    ours = torch.tensor(json.loads((tmp_path / "out.json").read_text())["logprobs"])
    with torch.no_grad():
        reference = hf_token_logprobs(hf_model(saved_by_transformers), ids)
    assert (ours - reference).abs().max().item() <= 1e-4  # LOGPROB_TOLERANCE of tests/deepseek_v4/test_model.py
    assert [record.levelname for record in caplog.records if NO_MTP_WARNING in record.getMessage()] == ["WARNING"]


@pytest.mark.parametrize("command", ["import", "logprobs", "parity"])
def test_require_mtp_refuses_a_checkpoint_without_mtp(saved_by_transformers, tmp_path, capsys, command):
    out = tmp_path / "out"
    extra = {"import": [str(out)], "logprobs": ["--tokens", str(tmp_path / "tokens.json"), "--out", str(out)],
             "parity": []}[command]
    (tmp_path / "tokens.json").write_text("[[1, 2, 3]]")
    assert main([command, str(saved_by_transformers), *extra, "--require-mtp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"modelzoo: error: {saved_by_transformers}: missing tensors mtp.0.") and "\n" not in err
    assert not out.exists()


def test_the_provider_keyword_require_mtp(saved_by_transformers):
    from modelzoo.conversion.mapping import MappingError
    from modelzoo import build_provider, runtime

    with runtime.parallel():
        without = build_provider(saved_by_transformers)
        model = without.provide()
        without.load_hf_weights(model, progress=False)
        assert len(model.mtp.layers) == 0 and without.model_options() == {"build_mtp": False}
        required = build_provider(saved_by_transformers, require_mtp=True)
        assert required.model_options() == {}
        with pytest.raises(MappingError, match="missing tensors mtp.0."):
            required.load_hf_weights(required.provide(), progress=False)
        with pytest.raises(ValueError, match="mtp_loss_scale > 0 needs MTP layers, and .* has no mtp.. tensors"):
            build_provider(saved_by_transformers, mtp_loss_scale=0.3)
        assert build_provider(DEEPSEEK_V4).build_mtp  # the shipped tiny has its MTP tensors
