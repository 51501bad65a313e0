"""DeepSeek-V4.1's release format through the CLI: import of deepseek-v41-tiny-native (FP8 / FP4, native names) and
of its HF-named dequantised twin, export --format native --quantize fp8, bit-exact both ways."""

import re

import pytest
from dsv41_helpers import V41_TINY
from test_v41_native import NATIVE, assert_same_bytes, read_all, write_dequantised

from modelzoo.conversion.cli import main


@pytest.fixture(scope="module")
def dequantised(tmp_path_factory):
    return write_dequantised(tmp_path_factory.mktemp("v41native") / "dequantised")


def test_cli_native_round_trip_at_tp2_is_bit_exact(tmp_path):
    """import of the release checkpoint at TP 2 (Engram tables row-sharded, experts FP4), export --format native
    --quantize fp8 at TP 1: the release's tensors and bytes, the vision tower and aligner carried unchanged."""
    assert main(["import", str(NATIVE), str(tmp_path / "megatron"), "--tp", "2"]) == 0
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "native"), "--format", "native",
                 "--quantize", "fp8"]) == 0
    assert_same_bytes(read_all(tmp_path / "native"), read_all(NATIVE))
    assert (tmp_path / "native" / "tokenizer.json").read_bytes() == (NATIVE / "tokenizer.json").read_bytes()


def test_cli_hf_naming_round_trip_to_native(tmp_path, dequantised):
    """The other direction: the HF-named checkpoint (no scales to keep) imported, exported in the release
    format: the same bytes, since our quantiser wrote the release and re-quantising its values is idempotent."""
    assert main(["import", str(dequantised), str(tmp_path / "megatron"), "--ep", "2"]) == 0
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "native"), "--format", "native",
                 "--quantize", "fp8"]) == 0
    assert_same_bytes(read_all(tmp_path / "native"), read_all(NATIVE))




@pytest.mark.parametrize("source, naming, message", [
    (V41_TINY, "native", r"model\.\S+: not a DeepSeek-V4\.1 native tensor name"),
    (NATIVE, "hf", r"unexpected tensors? .*layers\.0\."),
], ids=["hf-read-as-native", "native-read-as-hf"])
def test_a_checkpoint_read_in_the_other_naming_is_refused(tmp_path, capsys, source, naming, message):
    assert main(["import", str(source), str(tmp_path / "out"), "--format", naming]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_cli_hf_naming_quantised_round_trip(tmp_path):
    """native -> export --format hf --quantize fp8 (transformers main's names, `weight_scale_inv`, the Engram tables
    as codes + `.scale`) -> import -> export --format native --quantize fp8: the release's bytes again."""
    assert main(["import", str(NATIVE), str(tmp_path / "megatron")]) == 0
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "hf"), "--format", "hf", "--quantize", "fp8"]) == 0
    names = set(read_all(tmp_path / "hf"))
    assert {"model.layers.2.attn.wq_a.weight_scale_inv", "model.layers.1.engram.embed.scale",
            "lm_head.weight"} <= names and not any(name.endswith(".attn.wq_a.scale") for name in names)
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "megatron-again")]) == 0
    assert main(["export", str(tmp_path / "megatron-again"), str(tmp_path / "native"), "--format", "native",
                 "--quantize", "fp8"]) == 0
    assert_same_bytes(read_all(tmp_path / "native"), read_all(NATIVE))


@pytest.mark.parametrize("layout", [[], ["--tp", "2"]], ids=["tp1", "tp2"])
def test_cli_parity_on_the_release_checkpoint(layout, capsys):
    """`modelzoo parity` of the release checkpoint: our reference reads it as transformers main reads the release."""
    import json

    assert main(["parity", str(NATIVE), *layout, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["architecture"] == "deepseek_v41" and report["passed"]
    assert report["max_abs_diff_logprobs"] <= 1e-5 and report["max_abs_diff_logprobs_packed"] <= 1e-5
