"""DeepSeek-V4 through the CLI: HF -> Megatron (torch_dist) -> HF bit-exact at TP 1, TP 2 and EP 2, and parity at TP 2."""

import pytest
import torch
from conftest import TINY
from safetensors.torch import load_file

from conversion.cli import main

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
