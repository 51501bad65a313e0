"""DeepSeek-V4.1 through the CLI: HF -> Megatron (torch_dist, at TP 2, EP 2 or PP 2) -> HF bit-exact (the image
delimiters carried through), `modelzoo parity` at TP 1, TP 2, TP 2 + SP and EP 2, `modelzoo logprobs` against our
reference, and bad inputs (a missing or mismatched tokenizer, a layout the model cannot run, a checkpoint of mixed
namings) refused in one sentence with exit 2 and nothing written."""

import json
import re
import shutil

import pytest
import torch
from dsv41_helpers import V41_TINY, load_tiny, next_token_logprobs, random_rows
from safetensors.torch import load_file, save_file

from modelzoo.conversion.cli import main


@pytest.mark.parametrize("import_layout, export_layout", [
    (["--tp", "2"], ["--tp", "1"]),
    (["--ep", "2"], ["--tp", "2"]),
    (["--pp", "2"], []),
], ids=["tp2-to-tp1", "ep2-to-tp2", "pp2-to-pp1"])
def test_cli_round_trip_is_bit_exact(tmp_path, import_layout, export_layout):
    assert main(["import", str(V41_TINY), str(tmp_path / "megatron"), *import_layout]) == 0
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "hf"), *export_layout]) == 0
    original, exported = load_file(V41_TINY / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys() and "image_start" in exported
    assert all(exported[k].dtype == v.dtype and torch.equal(exported[k], v) for k, v in original.items())
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (V41_TINY / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("layout", [[], ["--tp", "2"], ["--tp", "2", "--sp"], ["--ep", "2"], ["--attention", "fast"],
                                    ["--tp", "2", "--sp", "--attention", "fast"]],
                         ids=["tp1", "tp2", "tp2-sp", "ep2", "fast", "tp2-sp-fast"])
def test_cli_parity_passes(layout, capsys):
    assert main(["parity", str(V41_TINY), *layout, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["architecture"] == "deepseek_v41" and report["passed"]
    assert report["max_abs_diff_logprobs"] <= 1e-5 and report["max_abs_diff_logprobs_packed"] <= 1e-5


LOGPROB_TOLERANCE = 1e-5  # the bar (fp32), as in test_v41_megatron_parity.py


def test_cli_logprobs_match_the_reference(tmp_path):
    """Two rows of different lengths (one past the candidate budget), one at a time and packed into one row, at
    TP 2: each against our reference's log-probs of that row alone."""
    rows = [random_rows(1, 40, seed=5)[0].tolist(), random_rows(1, 23, seed=6)[0].tolist()]
    (tmp_path / "tokens.json").write_text(json.dumps(rows))
    reference = load_tiny()
    with torch.no_grad():
        expected = [next_token_logprobs(reference(torch.tensor([row]), use_cache=True).logits, torch.tensor([row]))[0]
                    for row in rows]
    for name, extra in (("plain", []), ("packed", ["--pack"])):
        out = tmp_path / f"{name}.json"
        assert main(["logprobs", str(V41_TINY), "--tokens", str(tmp_path / "tokens.json"), "--out", str(out),
                     "--tp", "2", *extra]) == 0
        got = json.loads(out.read_text())["logprobs"]
        assert [len(values) for values in got] == [len(row) - 1 for row in rows], name
        for values, wanted in zip(got, expected):
            assert (torch.tensor(values) - wanted).abs().max() <= LOGPROB_TOLERANCE, name


def _copy_without_tokenizer(tmp_path):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(V41_TINY, folder)
    (folder / "tokenizer.json").unlink()
    return folder


@pytest.mark.parametrize("argv, message", [
    (["--ep", "3"], "expert parallel size 3 must divide n_routed_experts"),
    (["--tp", "4"], "tensor parallel size 4 must divide o_groups \\(2\\)"),
    (["--pp", "3"], "pipeline parallel size 3 must divide the 10 decoder layers"),
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


def test_import_refuses_a_checkpoint_without_its_tokenizer(tmp_path, capsys):
    folder = _copy_without_tokenizer(tmp_path)
    assert main(["import", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{folder / 'tokenizer.json'}" in err
    assert not (tmp_path / "out").exists()


def _copy_with_a_longer_tokenizer(tmp_path):
    """The tiny checkpoint with ten more tokens in its tokenizer than config.json's vocab_size (250)."""
    folder = tmp_path / "long-tokenizer"
    shutil.copytree(V41_TINY, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer["model"]["vocab"] |= {f"extra{index}": 250 + index for index in range(10)}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    return folder


def _copy_with_fewer_classes(tmp_path):
    """The tiny checkpoint whose config claims one normalised class fewer than its tokenizer gives (138)."""
    folder = tmp_path / "fewer-classes"
    shutil.copytree(V41_TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["engram_compressed_vocab_size"] = 137
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("make, message", [
    (_copy_with_a_longer_tokenizer, r"normalises 260 tokens into \d+ classes, but .*config.json has "
                                    r"engram_compressed_vocab_size 138 and vocab_size 250"),
    (_copy_with_fewer_classes, r"normalises 250 tokens into 138 classes, but .*config.json has "
                               r"engram_compressed_vocab_size 137"),
], ids=["more-tokens-than-vocab", "other-class-count"])
@pytest.mark.parametrize("command", ["import", "logprobs", "parity"])
def test_a_tokenizer_that_does_not_fit_the_config_is_refused(tmp_path, capsys, make, message, command):
    folder = make(tmp_path)
    (tmp_path / "tokens.json").write_text(json.dumps([[6, 7, 8, 9]]))
    argv = {"import": ["import", str(folder), str(tmp_path / "out")],
            "logprobs": ["logprobs", str(folder), "--tokens", str(tmp_path / "tokens.json"), "--out",
                         str(tmp_path / "out")],
            "parity": ["parity", str(folder)]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_mixing_the_two_namings_is_refused(tmp_path, capsys):
    folder = tmp_path / "mixed"
    shutil.copytree(V41_TINY, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["layers.0.attn_norm.weight"] = tensors.pop("model.layers.0.attn_norm.weight")  # the release's name
    save_file(tensors, folder / "model.safetensors")
    assert main(["import", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "mixes native names" in err, err
    assert not (tmp_path / "out").exists()


def test_help_describes_each_architectures_native_format_and_quantisation(capsys):
    """Two architectures declare `native` and `--quantize`: the help gives each one's description, not one of them."""
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "deepseek_v4: the release checkpoint's names, FP8 / MXFP4" in text
    assert "deepseek_v41: the release checkpoint's names, FP8 / FP4" in text
    assert "FP8 128x128 blocks" in text and "FP8 32x32 blocks" in text
