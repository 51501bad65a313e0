"""Start-up of the `modelzoo` command: wall time of commands that do little work, and what they import.

    python benchmarks/bench_cli_startup.py [--runs 5] [--out benchmarks/results/cli_startup.json]

Each command runs `--runs` times as a fresh process (the median is reported, with the fastest and the
slowest): `modelzoo --help`, `modelzoo list`, inputs the command refuses (a folder that does not exist; a
tensor-parallel size that does not split the model, which needs the model's config), `python -c "import
modelzoo"`, and a whole conversion of the tiny Llama checkpoint (`modelzoo import`, into a new folder each
run). One more run of each under `python -X importtime` records whether it imported torch, Megatron-Core and
transformers' modeling code. Adds its run (`harness.run_record` and each command's figures) to the result file.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import run_record, write_run

ROOT = Path(__file__).resolve().parents[1]
PYTHON = Path(sys.executable)
MODELZOO = PYTHON.parent / "modelzoo"  # the console script next to the interpreter (pyproject's entry point)
TINY_LLAMA = "tiny_checkpoints/llama-tiny"

# the heavy libraries a command may import, by the module whose import is the sign of each
HEAVY_MODULES = {"torch": "torch", "megatron_core": "megatron.core",
                 "transformers_modeling": "transformers.modeling_utils"}


def commands() -> dict[str, tuple[list[str], int]]:
    """name -> (argv, the exit code it must end with); `{out}` is replaced by a path that does not exist."""
    return {
        "help": ([str(MODELZOO), "--help"], 0),
        "list": ([str(MODELZOO), "list"], 0),
        "refused_missing_folder": ([str(MODELZOO), "import", "/nonexistent", "{out}"], 2),
        "refused_tp": ([str(MODELZOO), "import", TINY_LLAMA, "{out}", "--tp", "3"], 2),
        "import_modelzoo": ([str(PYTHON), "-c", "import modelzoo"], 0),
        "tiny_import": ([str(MODELZOO), "import", TINY_LLAMA, "{out}"], 0),
    }


def run_once(argv: list[str], expected: int, scratch: Path, python_flags: tuple[str, ...] = ()) -> tuple[float, str]:
    """Seconds from start to exit of one run, and its stderr; the output path is fresh and removed after."""
    out = scratch / "out"
    argv = [arg.replace("{out}", str(out)) for arg in argv]
    if python_flags:  # the console script is a Python file: run it under the interpreter with the flags
        argv = [str(PYTHON), *python_flags, *(argv[1:] if argv[0] == str(PYTHON) else argv)]
    start = time.perf_counter()
    finished = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    if finished.returncode != expected:
        raise SystemExit(f"{' '.join(argv)} exited {finished.returncode}, not {expected}:\n{finished.stderr}")
    return seconds, finished.stderr


def imported(importtime_log: str) -> dict[str, bool]:
    """Which of HEAVY_MODULES a `-X importtime` log shows imported."""
    names = {line.rsplit("|", 1)[1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")}
    return {key: module in names for key, module in HEAVY_MODULES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cli_startup.json")
    args = parser.parse_args()
    report = {**run_record("bench_cli_startup.py"), "system": platform.platform(),
              "load_average_1min_at_start": os.getloadavg()[0], "runs_per_command": args.runs, "commands": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name, (argv, expected) in commands().items():
            seconds = [run_once(argv, expected, Path(scratch))[0] for _ in range(args.runs)]
            _, log = run_once(argv, expected, Path(scratch), python_flags=("-X", "importtime"))
            shown = " ".join(Path(a).name if a in (str(MODELZOO), str(PYTHON)) else a for a in argv)
            report["commands"][name] = {"command": shown, "median_s": round(statistics.median(seconds), 3),
                                        "min_s": round(min(seconds), 3), "max_s": round(max(seconds), 3),
                                        "imports": imported(log)}
            print(f"{name:<24} {statistics.median(seconds):6.2f} s   {shown}   imports {imported(log)}")
    write_run(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
