"""`modelzoo logprobs --pack` (one THD forward of all sequences) and the packed case of `modelzoo parity`.

Oracle: the Hugging Face backend, one sequence at a time; LOGPROB_TOLERANCE = 1e-5 (fp32, same math in another order).
"""

import json

import pytest
from conftest import TINY

from modelzoo.conversion.cli import main

LOGPROB_TOLERANCE = 1e-5
SEQUENCES = [[1, 2, 3, 4, 5, 6, 7], [9, 8], list(range(10, 50)), [200, 3, 17, 99, 5]]


@pytest.mark.parametrize("name, tp", [("llama-tiny", 1), ("deepseek-v4-tiny", 2)])
def test_packed_logprobs_equal_the_hf_backend(tmp_path, name, tp):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(SEQUENCES))
    assert main(["logprobs", str(TINY / name), "--tokens", str(tokens), "--out", str(tmp_path / "packed.json"),
                 "--pack", "--tp", str(tp)]) == 0
    assert main(["logprobs", str(TINY / name), "--tokens", str(tokens), "--out", str(tmp_path / "hf.json"),
                 "--backend", "hf"]) == 0
    packed = json.loads((tmp_path / "packed.json").read_text())["logprobs"]
    reference = json.loads((tmp_path / "hf.json").read_text())["logprobs"]
    assert [len(sequence) for sequence in packed] == [len(sequence) - 1 for sequence in SEQUENCES]
    for ours, theirs in zip(packed, reference):
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= LOGPROB_TOLERANCE


def test_pack_with_the_hf_backend_is_refused(tmp_path, capsys):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(SEQUENCES))
    assert main(["logprobs", str(TINY / "llama-tiny"), "--tokens", str(tokens), "--out", str(tmp_path / "out.json"),
                 "--pack", "--backend", "hf"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--pack runs the Megatron backend's packed (THD) forward" in error
    assert not (tmp_path / "out.json").exists()


def test_parity_reports_the_packed_case(capsys):
    assert main(["parity", str(TINY / "loopcoder-tiny"), "--seq-len", "40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["packed_lengths"] == [1, 5, 13, 40]
    assert report["max_abs_diff_logprobs_packed"] <= LOGPROB_TOLERANCE and report["passed"]
