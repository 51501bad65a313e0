"""The longest row (batch 1) a model trains on one GPU, at one recompute setting: one forward + backward step.

    python benchmarks/bench_longest_fit.py dense megatron-loopcoder --recompute full --start 32768
    python benchmarks/bench_longest_fit.py dense hf-llama-sdpa --recompute none
    python benchmarks/bench_longest_fit.py deepseek_v4 ours --recompute full --start 32768
    python benchmarks/bench_longest_fit.py dense megatron-loopcoder --recompute full --recompute-layers 13 --start 65536
    python benchmarks/bench_longest_fit.py deepseek_v4 transformers
    python benchmarks/bench_longest_fit.py deepseek_v41 ours --recompute full --start 65536

`dense` models are bench_dense.py's (`--only` names); `deepseek_v4` runs bench_deepseek_v4.py's `--config`
(default large) with our fast path (`ours`) or transformers' eager model (`transformers`); `deepseek_v41` likewise
bench_deepseek_v41.py's, `transformers` being our reference (eager). Each probe is a fresh
process of that script (an out-of-memory error leaves the allocator's pools behind) timing one step after one
untimed step. Lengths double from `--start` until one does not fit or `--max` is reached, then `--refine` bisection
steps between the longest that fit and the shortest that did not, on multiples of `--granularity`. Adds its run,
with every probe's figures, to benchmarks/results/longest_fit_<bench>_<model>_<recompute>_<gpu>.json (recompute
full_block<N> with `--recompute-layers N`) after each probe ("complete": false until the search ends); the runs of
other commands (probes at other lengths) stay in the file beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from harness import check_recompute_layers, exit_on_sigterm, recompute_name, results_file, run_record, write_run

HERE = Path(__file__).resolve().parent
OUT_OF_MEMORY_SIGNS = ("OutOfMemoryError", "CUDA out of memory")


def longest_fit(fits: Callable[[int], bool], start: int, maximum: int, refine: int, granularity: int) -> int | None:
    """The longest length found to fit: doubling from `start` (capped at `maximum`), then `refine` bisection
    steps on multiples of `granularity` below the first length that did not fit; None if `start` does not."""
    longest, too_long = None, None
    length = start
    while True:
        if fits(length):
            longest = length
            if length >= maximum:
                return longest
            length = min(2 * length, maximum)
        else:
            too_long = length
            break
    if longest is None:
        return None
    for _ in range(refine):
        middle = (longest + too_long) // 2 // granularity * granularity
        if middle <= longest:
            break
        if fits(middle):
            longest = middle
        else:
            too_long = middle
    return longest


def probe_command(args, seq: int, out: Path) -> list[str]:
    common = ["--seq", str(seq), "--recompute", args.recompute, "--steps", "1", "--warmup", "1", "--out", str(out)]
    if args.recompute_layers is not None:
        common += ["--recompute-layers", str(args.recompute_layers)]
    if args.bench == "dense":
        return [sys.executable, str(HERE / "bench_dense.py"), "--batch", "1", "--only", args.model, *common]
    paths = ["--paths", "fast", "--no-hf"] if args.model == "ours" else ["--paths", ""]
    return [sys.executable, str(HERE / f"bench_{args.bench}.py"), "--config", args.config, *paths, *common]


def run_probe(command: list[str], scratch: str, timeout: float) -> tuple[int, str]:
    """Run `command` in its own process group with its temporary files under `scratch` -> (exit status, stderr).

    If it outlives `timeout` (subprocess.TimeoutExpired) or this process is stopped, the whole group is killed: a
    probe left running would hold the GPU, its memory and its disk under the next probe's figures."""
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, env={**os.environ, "TMPDIR": scratch})
    try:
        _, stderr = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    return child.returncode, stderr


def probe(args, seq: int, probes: list[dict]) -> bool:
    """Run one step at `seq` in a fresh process; record its figures; whether it fit."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        command = probe_command(args, seq, out)
        status, stderr = run_probe(command, scratch, args.probe_timeout)
        if status == 0:
            [result] = json.loads(out.read_text())["runs"][-1]["results"]
        elif any(sign in stderr for sign in OUT_OF_MEMORY_SIGNS):  # outside the timed steps (building)
            result = {"out_of_memory": True}
        else:
            raise SystemExit(f"{' '.join(command)} exited {status}:\n{stderr[-3000:]}")
    fit = not result.get("out_of_memory")
    probes.append({"seq": seq, "fits": fit, **result})
    print(f"{seq:>8} tokens: {'fits' if fit else 'out of memory'}"
          + (f", {result['ms_per_step']:.0f} ms/step, {result['peak_memory_gib']:.1f} GiB reserved" if fit else ""),
          flush=True)
    return fit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bench", choices=["dense", "deepseek_v4", "deepseek_v41"])
    parser.add_argument("model", help="dense: a bench_dense.py model name; deepseek_v4 / deepseek_v41: ours or "
                                      "transformers")
    parser.add_argument("--recompute", default="none", help="the benchmark script's --recompute")
    parser.add_argument("--recompute-layers", type=int, default=None,
                        help="with --recompute full: only the first N layers (the script's --recompute-layers)")
    parser.add_argument("--config", default="large", help="deepseek_v4 / deepseek_v41: the script's --config")
    parser.add_argument("--start", type=int, default=4096)
    parser.add_argument("--max", type=int, default=262144)
    parser.add_argument("--refine", type=int, default=2, help="bisection steps after the doubling")
    parser.add_argument("--granularity", type=int, default=4096)
    parser.add_argument("--probe-timeout", type=int, default=900, help="seconds one probe may take")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.bench != "dense" and args.model not in ("ours", "transformers"):
        parser.error(f"{args.bench} models: ours or transformers")
    if args.model in ("transformers", "hf-llama-sdpa", "hf-loopcoder") and (
            args.recompute not in ("none", "full") or args.recompute_layers is not None):
        parser.error(f"transformers' models recompute fully (gradient checkpointing) or not at all, not "
                     f"{args.recompute!r}" + (f" of {args.recompute_layers} layers" if args.recompute_layers else ""))
    check_recompute_layers(parser, args)
    setting = recompute_name(args.recompute, args.recompute_layers)

    exit_on_sigterm()  # run_probe's cleanup runs when stopped
    out = args.out or results_file(f"longest_fit_{args.bench}_{args.model}_{setting}")
    record = run_record("bench_longest_fit.py")
    probes: list[dict] = []

    def probe_and_write(seq: int) -> bool:
        """One probe, then the file as it stands: a search stopped part-way still leaves the probes it made."""
        fit = probe(args, seq, probes)
        fitted = [p["seq"] for p in probes if p["fits"]]
        write_run(out, {**record, "complete": False, "longest_fit_so_far": max(fitted, default=None), "probes": probes})
        return fit

    longest = longest_fit(probe_and_write, args.start, args.max, args.refine, args.granularity)
    print(f"longest fit: {longest} tokens ({args.bench} {args.model}, recompute {setting})")
    write_run(out, {**record, "complete": True, "longest_fit": longest, "probes": probes})


if __name__ == "__main__":
    main()
