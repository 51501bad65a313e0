"""What the benchmarks share: what a run records about itself and where it is written, timing on the GPU, the
recompute settings, and scratch folders that go away when a run is stopped.

The benchmarks are scripts run as `python3 benchmarks/<script>.py`, which puts `benchmarks/` on `sys.path`: they
import this module, and the dense benchmark's model configs from `bench_dense`, by name. This module adds the
repository root after it, so that they import the tiny checkpoints' generators (`tiny_checkpoints`) as the tests do.

A result file, `benchmarks/results/<benchmark>[_<config>]_<gpu>.json`, holds one benchmark, configuration and machine
kind: `{"runs": [...]}`, each run with its `command`, `commit`, `date`, `machine` and `versions` beside its figures.
A run replaces an earlier run of the same command and is appended after runs of other commands (the probes of a
longest-fit search at other lengths, a comparison of other paths). `docs/performance.md` is rendered from these
files by `benchmarks/render_performance.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository root: tiny_checkpoints/
PROVENANCE = ("command", "commit", "date", "machine", "versions")
PACKAGES = ("megatron-core", "transformers")  # beside Python and torch


def commit() -> str:
    """$MODELZOO_COMMIT where set (a copy of the tree whose .git is not its own), else git's short hash, marked
    where tracked files differ from it."""
    if os.environ.get("MODELZOO_COMMIT"):
        return os.environ["MODELZOO_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=here).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, check=True, cwd=here).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+uncommitted changes" if changed else "")


def machine() -> str:
    """The GPU's name, or on a machine without one its CPU and core count."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")), "") if cpuinfo.exists() else ""
    return f"{cpu or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def versions() -> dict[str, str]:
    """Python's, torch's (with the CUDA it was built for) and the installed versions of the other packages a
    benchmark's figures depend on."""
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def run_record(script: str) -> dict:
    """Where a run came from: the command as typed (`--out` left out: it names where one machine wrote the file),
    the commit, the date (UTC), the machine and the software versions."""
    arguments, given = [], iter(sys.argv[1:])
    for argument in given:
        if argument == "--out":
            next(given, None)  # and its value
        elif not argument.startswith("--out="):
            arguments.append(argument)
    return {"command": shlex.join(["python3", f"benchmarks/{script}", *arguments]), "commit": commit(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "versions": versions()}


def results_file(name: str) -> Path:
    """benchmarks/results/<name>_<gpu>.json, e.g. dense_h200.json: one file per benchmark, config and GPU."""
    gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ").split()[0].lower()
    return RESULTS / f"{name}_{gpu}.json"


def write_run(path: str | Path, run: dict) -> None:
    """Add `run` (a `run_record` and its figures) to the result file at `path`, in place of a run of the same
    command."""
    path = Path(path)
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    runs = [earlier for earlier in runs if earlier["command"] != run["command"]] + [run]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")


def exit_on_sigterm() -> None:
    """Turn SIGTERM (`timeout`, a job scheduler) into SystemExit(143), so that `with` blocks and `finally` clauses
    clean up on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


@contextlib.contextmanager
def scratch_folder(name: str):
    """A folder `name` in a temporary directory for the run's random checkpoint, removed when the block ends, also
    when the run is stopped with SIGTERM: a large DeepSeek-V4 checkpoint left behind by every run fills a GPU
    machine's disk."""
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="modelzoo-bench-") as scratch:
        yield Path(scratch) / name


def check_recompute_layers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.recompute_layers is not None and args.recompute != "full":
        parser.error("--recompute-layers goes with --recompute full")


def recompute_name(setting: str, layers: int | None) -> str:
    """The name result files give `--recompute setting [--recompute-layers N]`: the setting, or full_block<N>."""
    return setting if layers is None else f"full_block{layers}"


def recompute_settings(table: dict, setting: str, layers: int | None) -> tuple[dict, str]:
    """Megatron's TransformerConfig settings for `--recompute setting` (a key of `table`) and `recompute_name`; with
    `--recompute full --recompute-layers N` only the first N layers are recomputed (recompute_method="block")."""
    settings = dict(table[setting])
    if layers is not None:
        settings.update(recompute_method="block", recompute_num_layers=layers)
    return settings, recompute_name(setting, layers)


def random_tokens(vocab: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Token ids drawn from a fixed seed, on the GPU (on the CPU without one): runs in separate processes time the
    same tokens (the MoE's routing, and so its timing, depends on them)."""
    tokens = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))
    return tokens.cuda() if torch.cuda.is_available() else tokens


def matmul_peak_tflops() -> float:
    """The bf16 matmul rate this GPU reaches: ten 8192 x 8192 x 8192 GEMMs after three untimed ones."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def time_steps(step, steps: int, warmup: int = 3) -> tuple[float, float | None]:
    """Mean seconds of `steps` calls of `step` after `warmup` untimed ones, and the peak GiB reserved meanwhile (None
    on a machine without a GPU, where the steps run on the CPU)."""
    gpu = torch.cuda.is_available()
    for _ in range(warmup):
        step()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if gpu:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    # reserved, not allocated: what the caching allocator holds from the GPU (CUDA graph pools included)
    return seconds, torch.cuda.max_memory_reserved() / 2**30 if gpu else None


def hf_step(model, ids, **forward_kwargs):
    """A training step of a transformers model: forward and backward of its mean token loss; `forward_kwargs`: more
    keywords of its forward (a provider's `oracle_forward_kwargs`)."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False, **forward_kwargs).loss
        loss.backward()
        return loss.detach()
    return step


def megatron_step(provider, model, ids):
    """A training step of one of our models: forward and backward of the mean negative token log-probability."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = -provider.token_logprobs(model, ids).mean()
        loss.backward()
        return loss.detach()
    return step
