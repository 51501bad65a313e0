"""DeepSeek-V4.1 through the CLI: HF -> Megatron (torch_dist) -> HF bit-exact (the image delimiters carried through),
`modelzoo parity` at TP 2 and EP 2, and bad inputs refused in one sentence with exit 2 and nothing written."""

import json
import re
import shutil

import pytest
import torch
from dsv41_helpers import V41_TINY
from safetensors.torch import load_file

from modelzoo.conversion.cli import main


@pytest.mark.parametrize("import_layout, export_layout", [
    (["--tp", "2"], ["--tp", "1"]),
    (["--ep", "2"], ["--tp", "2"]),
], ids=["tp2-to-tp1", "ep2-to-tp2"])
def test_cli_round_trip_is_bit_exact(tmp_path, import_layout, export_layout):
    assert main(["import", str(V41_TINY), str(tmp_path / "megatron"), *import_layout]) == 0
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "hf"), *export_layout]) == 0
    original, exported = load_file(V41_TINY / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys() and "image_start" in exported
    assert all(exported[k].dtype == v.dtype and torch.equal(exported[k], v) for k, v in original.items())
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (V41_TINY / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--ep", "2"]], ids=["tp2", "ep2"])
def test_cli_parity_passes(layout, capsys):
    assert main(["parity", str(V41_TINY), *layout, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["architecture"] == "deepseek_v41" and report["passed"]
    assert report["max_abs_diff_logprobs"] <= 1e-5 and report["max_abs_diff_logprobs_packed"] <= 1e-5


def _copy_without_tokenizer(tmp_path):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(V41_TINY, folder)
    (folder / "tokenizer.json").unlink()
    return folder


@pytest.mark.parametrize("argv, message", [
    (["--ep", "3"], "expert parallel size 3 must divide n_routed_experts"),
    (["--tp", "4"], "tensor parallel size 4 must divide o_groups \\(2\\)"),
    (["--pp", "2"], "pipeline parallel size 2: the model runs at one pipeline stage"),
])
def test_cli_refuses_a_layout_it_cannot_run(tmp_path, capsys, argv, message):
    assert main(["import", str(V41_TINY), str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_logprobs_refuses_a_checkpoint_without_its_tokenizer(tmp_path, capsys):
    folder = _copy_without_tokenizer(tmp_path)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([[6, 7, 8, 9]]))
    assert main(["logprobs", str(folder), "--tokens", str(tokens), "--out", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'tokenizer.json'}" in err and "normalised vocabulary" in err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("entry", [[[64], "float99"], [[-1], "float32"], ["64", "float32"], [[64]]])
def test_a_bad_carried_record_is_refused_by_name(entry):
    from modelzoo.deepseek_v41.provider import carried_from_record

    with pytest.raises(ValueError, match=r"model option carried\['image_start'\]"):
        carried_from_record({"image_start": entry}, "megatron.json")
    with pytest.raises(ValueError, match=r"carried\['model.embed.weight'\]"):
        carried_from_record({"model.embed.weight": [[64], "float32"]}, "megatron.json")
    assert carried_from_record({"image_start": [[64], "bfloat16"]}, "x") == {"image_start": ((64,), torch.bfloat16)}
