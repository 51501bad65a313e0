"""Several GPUs (run on a machine with 2 or more, not in CI): the parallel layouts over NCCL against the Hugging Face
models, through the CLI (each layout's ranks are processes on their own GPUs; the HF model runs alone).

The same layouts run over gloo on CPU ranks in the CPU tests (test_context_parallel.py, test_sequence_parallel.py,
tests/deepseek_v4/test_parallel.py and others); here the collectives are NCCL's and the kernels CUDA's.
- fp32, `modelzoo parity` on the shipped tiny checkpoints (plain rows [2, 64] and a THD row of lengths 1, 5, 21 and
  64): max |delta logprob| <= FP32_TOLERANCE = 1e-5, the bound of the CPU parity tests (the same math in another
  order moves log-probs by ~1e-6; a token that reads a wrong key or a missing shard moves them by > 1e-2). TF32
  stays off (torch's default for matmuls), so fp32 here is fp32.
- bf16, `modelzoo logprobs` of two sequences (64 and 37 tokens): our bf16 error over NCCL, |ours(bf16) -
  ours(fp32)| at the layout, is at most BF16_ERROR_FACTOR = 1.25 x transformers' own, |HF(bf16) - HF(fp32)|. A fixed
  bound would sit below the noise of two correct bf16 runs. DeepSeek-V4 runs a variant without discrete choices
  (every compressed entry picked, every expert active, no hash routing), as in
  tests/deepseek_v4/test_bf16_precision.py, so that bf16 rounding cannot flip a top-k and the errors measure rounding.
Not yet run over NCCL (no machine with several GPUs was available). The same functions on gloo CPU ranks
(2026-12-06): fp32 within 3.3e-6 (DeepSeek-V4), 9.5e-7 (Llama, LoopCoder); bf16 error ratios 0.73-1.11.
"""

import json
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
import torch
from conftest import TINY

from modelzoo.conversion.cli import main

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA devices")]

FP32_TOLERANCE = 1e-5
BF16_ERROR_FACTOR = 1.25
LAYOUTS = {  # name -> the CLI's arguments, on 2 GPUs
    "tp2": ["--tp", "2"],
    "tp2-sp": ["--tp", "2", "--sp"],
    "cp2": ["--cp", "2", "--attention", "fast"],
    "pp2": ["--pp", "2"],
    "ep2": ["--ep", "2"],
}
CASES = [("llama-tiny", layout) for layout in ("tp2", "tp2-sp", "cp2", "pp2")]
CASES += [("loopcoder-tiny", layout) for layout in ("tp2", "tp2-sp", "cp2")]  # LoopCoder refuses pipeline stages
CASES += [("deepseek-v4-tiny", layout) for layout in ("tp2", "tp2-sp", "cp2", "pp2", "ep2")]
SEQUENCES = [torch.randint(2, 250, (length,), generator=torch.Generator().manual_seed(length)).tolist()
             for length in (64, 37)]
NO_DISCRETE_CHOICES = dict(index_topk=128, num_experts_per_tok=8, mlp_layer_types=["moe"] * 4)


def fp32_parity(checkpoint: str, layout: str) -> dict:
    """`modelzoo parity` at the layout in fp32 -> its report (raises if it fails)."""
    printed = StringIO()
    with redirect_stdout(printed):
        code = main(["parity", str(TINY / checkpoint), *LAYOUTS[layout], "--dtype", "float32",
                     "--tolerance", str(FP32_TOLERANCE), "--json"])
    report = json.loads(printed.getvalue().strip().splitlines()[-1])
    assert code == 0 and report["passed"], report
    return report


def bf16_errors(checkpoint: str, layout: str, scratch: Path) -> tuple[float, float]:
    """(our bf16 error at the layout, transformers' bf16 error): max |logprob(bf16) - logprob(fp32)| over the
    tokens of SEQUENCES, each model against itself."""
    folder = TINY / checkpoint
    if checkpoint == "deepseek-v4-tiny":
        from tiny_checkpoints.deepseek_v4_tiny import DEEPSEEK_V4_TINY, write_deepseek_v4_tiny

        folder = scratch / "deepseek-v4-no-discrete-choices"
        write_deepseek_v4_tiny(folder, {**DEEPSEEK_V4_TINY, **NO_DISCRETE_CHOICES})
    tokens = scratch / "tokens.json"
    tokens.write_text(json.dumps(SEQUENCES))

    def logprobs(name: str, *arguments: str) -> torch.Tensor:
        out = scratch / f"{name}.json"
        assert main(["logprobs", str(folder), "--tokens", str(tokens), "--out", str(out), *arguments]) == 0
        return torch.cat([torch.tensor(values) for values in json.loads(out.read_text())["logprobs"]])

    ours = {dtype: logprobs(f"ours-{dtype}", *LAYOUTS[layout], "--dtype", dtype) for dtype in ("float32", "bfloat16")}
    theirs = {dtype: logprobs(f"hf-{dtype}", "--backend", "hf", "--dtype", dtype) for dtype in ("float32", "bfloat16")}
    return ((ours["bfloat16"] - ours["float32"]).abs().max().item(),
            (theirs["bfloat16"] - theirs["float32"]).abs().max().item())


@pytest.mark.parametrize("checkpoint, layout", CASES)
def test_fp32_parity_over_nccl(checkpoint, layout):
    report = fp32_parity(checkpoint, layout)
    print(checkpoint, layout, report["max_abs_diff_logprobs"], report["max_abs_diff_logprobs_packed"])


@pytest.mark.parametrize("checkpoint, layout", CASES)
def test_bf16_error_over_nccl_is_no_larger_than_transformers(tmp_path, checkpoint, layout):
    ours, theirs = bf16_errors(checkpoint, layout, tmp_path)
    print(f"{checkpoint} {layout}: bf16 vs fp32, max |logprob diff|: ours {ours:.3e}, transformers {theirs:.3e}")
    assert ours <= BF16_ERROR_FACTOR * theirs
