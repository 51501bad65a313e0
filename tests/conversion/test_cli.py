"""The `modelzoo` CLI end to end: conversions through torch_dist, logprobs, and every bad input."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelzoo.conversion.cli import main


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("tp", [1, 2])
def test_import_export_reproduces_every_tensor_bit_exactly(tmp_path, capsys, llama_tiny, tp):
    code, out, _ = run_cli(capsys, "import", llama_tiny, tmp_path / "megatron", "--tp", tp)
    assert code == 0 and "import" in out
    # export at the other TP size: torch_dist reshards on load
    code, _, _ = run_cli(capsys, "export", tmp_path / "megatron", tmp_path / "hf", "--tp", 3 - tp)
    assert code == 0
    original, exported = load_file(llama_tiny / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(exported[k].dtype == v.dtype and torch.equal(exported[k], v) for k, v in original.items())
    assert (tmp_path / "hf" / "config.json").read_bytes() == (llama_tiny / "config.json").read_bytes()


def test_a_conversion_leaves_the_objects_it_found_out_of_the_gcs_collections():
    import gc

    from modelzoo.conversion import cli

    found = [cli]
    with cli._existing_objects_not_collected():
        made = [cli]
        collected = {id(obj) for obj in gc.get_objects()}  # all but the frozen
        assert id(found) not in collected and id(made) in collected
    assert id(found) in {id(obj) for obj in gc.get_objects()} and gc.get_freeze_count() == 0


def test_logprobs_megatron_and_hf_backends_agree(tmp_path, capsys, llama_tiny):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([[1, 5, 9, 200, 3, 17], [4, 4, 250, 8]]))
    results = {}
    for backend in ("megatron", "hf"):
        out = tmp_path / f"{backend}.json"
        code, _, err = run_cli(capsys, "logprobs", llama_tiny, "--tokens", tokens, "--out", out, "--backend", backend)
        assert code == 0, err
        results[backend] = json.loads(out.read_text())["logprobs"]
    assert [len(seq) for seq in results["megatron"]] == [5, 3]
    for ours, reference in zip(results["megatron"], results["hf"]):
        # 1e-4: same fp32 math in a different op order (see tests/llama/test_llama.py)
        assert max(abs(a - b) for a, b in zip(ours, reference)) <= 1e-4


def test_parity_command_passes_and_reports_json(capsys, llama_tiny):
    code, out, _ = run_cli(capsys, "parity", llama_tiny, "--seq-len", 16, "--json")
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and report["passed"] and report["max_abs_diff_logprobs"] <= 1e-4


def test_parity_command_fails_above_tolerance(capsys, llama_tiny):
    code, _, err = run_cli(capsys, "parity", llama_tiny, "--seq-len", 16, "--tolerance", "0")
    assert code == 1 and "exceeds tolerance" in err


# --- bad inputs: one clear line, non-zero exit, nothing left behind ------------------------------
def broken_copy(tmp_path, llama_tiny, edit_weights=None, edit_config=None):
    folder = tmp_path / "broken"
    shutil.copytree(llama_tiny, folder)
    if edit_weights:
        weights = load_file(folder / "model.safetensors")
        edit_weights(weights)
        save_file(weights, folder / "model.safetensors")
    if edit_config:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def truncate(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


BAD_INPUTS = {
    "truncated safetensors": (lambda f: truncate(f), [], r"model.safetensors is truncated"),
    "missing tensor": (dict(edit_weights=lambda w: w.pop("model.layers.1.mlp.up_proj.weight")), [],
                       r"missing tensors model.layers.1.mlp.up_proj.weight"),
    "unexpected tensor": (dict(edit_weights=lambda w: w.update({"model.layers.0.extra.bias": torch.zeros(3)})), [],
                          r"unexpected tensors model.layers.0.extra.bias"),
    "wrong shape": (dict(edit_weights=lambda w: w.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)})),
                    [], r"tensor model.layers.0.self_attn.k_proj.weight has shape \[16, 64\], the model expects \[32, 64\]"),
    "unknown model_type": (dict(edit_config=lambda c: c.update(model_type="gpt9", architectures=["Gpt9"])), [],
                           r"unknown model_type 'gpt9'"),
    "tp does not divide heads": ({}, ["--tp", "3"], r"tensor parallel size 3 must divide the attention heads \(4\)"),
    "ep on a dense model": ({}, ["--ep", "2"], r"expert parallel size 2: this llama model has no experts to split"),
    "require-mtp on a model without MTP": ({}, ["--require-mtp"], r"llama: unknown option 'require_mtp'"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_one_line_and_leaves_nothing(tmp_path, capsys, llama_tiny, case):
    edit, extra_args, message = BAD_INPUTS[case]
    if callable(edit):
        folder = broken_copy(tmp_path, llama_tiny)
        edit(folder)
    else:
        folder = broken_copy(tmp_path, llama_tiny, **edit)
    out_dir = tmp_path / "out"
    code, _, err = run_cli(capsys, "import", folder, out_dir, *extra_args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("modelzoo: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"], "no output or staging folder may remain"


def test_existing_output_folder_is_refused_untouched(tmp_path, capsys, llama_tiny):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "import", llama_tiny, out_dir)
    assert code == 2 and f"output {out_dir} already exists" in err
    assert [p.name for p in out_dir.iterdir()] == ["keep.txt"]


def test_export_of_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    code, _, err = run_cli(capsys, "export", tmp_path, tmp_path / "hf")
    assert code == 2 and "is not a modelzoo Megatron checkpoint" in err
    assert not (tmp_path / "hf").exists()


def test_failure_on_a_second_rank_is_one_line_too(tmp_path, capsys, llama_tiny):
    folder = broken_copy(tmp_path, llama_tiny, edit_weights=lambda w: w.pop("lm_head.weight"))
    code, _, err = run_cli(capsys, "import", folder, tmp_path / "out", "--tp", 2)
    assert code == 2 and err.strip().splitlines() == [err.strip()] and "missing tensors lm_head.weight" in err
    assert not (tmp_path / "out").exists()
