"""What the `modelzoo` command imports: help, `list` and refused inputs import neither torch nor Megatron-Core,
a config imports only the architecture it names, and a conversion does not import transformers' modeling code."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, TINY

import modelzoo
from modelzoo import registry

# One process runs the commands in turn (the order matters: what one command imported, the next ones have too)
# and prints, after each, its exit code, its stderr and which of the watched modules are imported by then.
STEPS = """
import contextlib, io, json, sys
from modelzoo.conversion.cli import main

WATCHED = ("torch", "megatron.core", "transformers.modeling_utils", "modelzoo.deepseek_v4", "modelzoo.loopcoder")
for argv in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as exit:  # argparse: help, usage errors
            code = exit.code
    print(json.dumps({"argv": argv, "code": code, "stderr": stderr.getvalue(),
                      "imported": [name for name in WATCHED if name in sys.modules]}))
"""


def run_steps(*commands: list[str]) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", STEPS, json.dumps([[str(a) for a in c] for c in commands])],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_help_list_and_refused_inputs_import_neither_torch_nor_megatron(tmp_path):
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "gpt9", "architectures": ["Gpt9ForCausalLM"]}))
    existing = tmp_path / "existing"
    existing.mkdir()
    llama = TINY / "llama-tiny"
    steps = run_steps(
        ["--help"],
        ["import", "--help"],
        ["list"],
        ["import", llama, tmp_path / "out", "--tp", "0"],
        ["import", llama],
        ["import", tmp_path / "missing", tmp_path / "out"],
        ["import", unknown, tmp_path / "out"],
        ["import", llama, existing],
        ["logprobs", llama, "--tokens", tmp_path / "tokens.json", "--out", existing],
        ["export", tmp_path / "missing", existing],
    )
    expected = [(0, ""), (0, ""), (0, ""), (2, "--tp 0: it must be at least 1"),
                (2, "the following arguments are required: megatron_dir"),
                (2, "missing/config.json does not exist"), (2, "unknown model_type 'gpt9'"),
                (2, f"output {existing} already exists"), (2, f"output {existing} already exists"),
                (2, f"output {existing} already exists")]
    for step, (code, message) in zip(steps, expected, strict=True):
        assert (step["code"], step["imported"]) == (code, []), step
        assert message in step["stderr"], step


def test_config_refusals_import_no_megatron_and_a_conversion_no_transformers_modeling_code(tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2], [3]]")
    llama = TINY / "llama-tiny"
    tp_refused, tokens_refused, converted = run_steps(
        ["import", llama, tmp_path / "refused", "--tp", "3"],
        ["logprobs", llama, "--tokens", tokens, "--out", tmp_path / "logprobs.json"],
        ["import", llama, tmp_path / "out"],
    )
    assert "tensor parallel size 3 must divide the attention heads (4)" in tp_refused["stderr"]
    assert "must hold a JSON list of token-id lists, each of length >= 2" in tokens_refused["stderr"]
    for step in (tp_refused, tokens_refused):
        # torch comes with transformers' config class; Megatron-Core, the HF model and the other architectures do not
        assert (step["code"], step["imported"]) == (2, ["torch"]), step
    assert (converted["code"], converted["imported"]) == (0, ["torch", "megatron.core"]), converted
    assert (tmp_path / "out").is_dir() and not (tmp_path / "refused").exists()


def test_the_builtin_architectures_table_matches_the_provider_classes():
    for name, entry in registry.BUILTIN_ARCHITECTURES.items():
        provider = registry.provider_class({"model_type": entry.hf_model_types[0]})
        assert (provider.name, provider.hf_model_types, provider.hf_architectures) == \
               (name, entry.hf_model_types, entry.hf_architectures)
        assert registry.provider_class({"architectures": [entry.hf_architectures[0]]}) is provider
    assert modelzoo.list_architectures() == sorted(registry.BUILTIN_ARCHITECTURES)
    assert issubclass(registry.provider_class({"model_type": "llama"}), modelzoo.ModelProvider)
