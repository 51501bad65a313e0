"""Checkpoint conversion on the CPU: `modelzoo import` + `modelzoo export` against a read-and-write baseline.

    python benchmarks/bench_conversion.py [--workdir DIR] [--layers 16] [--rounds 3] [--against CHECKOUT]

Makes a synthetic LoopCoder-shaped bf16 checkpoint (hidden 2048, 16 layers: ~2 GB) in several
shards, then measures, each kind of step in its own process:
  baseline   read every tensor with safetensors and write the same bytes into shards with safetensors
  import     modelzoo import  HF -> Megatron torch_dist (bf16, TP 1)
  export     modelzoo export  Megatron -> HF (of the import's files)
  export from memory   the same with every tensor written from its memory map, not copied in the kernel
                       with os.copy_file_range (the writer's documented fallback; in process only: the
                       A/B of that copy)
twice: "in process" times the conversion alone, in a process that has imported its libraries and
converted the shipped tiny LoopCoder checkpoint first (library imports, lazy module loading and process
start-up are a fixed cost that does not grow with the checkpoint), `--rounds` times in turn with the
baseline in that same process, after one pair that is not reported: each ratio is the step's time over
the baseline's just before it (this VM's speed drifts within a minute: a baseline measured a minute
apart from the step explains more of a ratio than the conversion does); "CLI" times the whole command
from the child's start, baseline, import and export in turn, `--rounds` times, each ratio against the
baseline of its round. Each timed step starts with its input files read into the page cache (this VM's
host reclaims cached pages at random), after `sync` (no dirty pages left by an earlier step) and
`malloc_trim`; peak RSS is the step's own peak (VmHWM reset) above the RSS at its start; CPU seconds
are the process's user + system time over the step (medians, the step's and its baselines'). Prints a
table; writes JSON, with the VM's free page reporting settings (`page_reporting`).

`--against CHECKOUT` (another commit's tree, `git worktree add CHECKOUT COMMIT`): its in-process import and export
run too, each in its own child right after ours on the same files, and `time_vs_against` is our ratio to the
baseline over its ratio: a change's cost to a normal conversion, measured in one run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import run_record, write_run

ROOT = Path(__file__).resolve().parents[1]

CONFIG = {
    "architectures": ["IQuestLoopCoderForCausalLM"], "model_type": "iquestloopcoder", "vocab_size": 32000,
    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "loop_num": 2, "loop_window_size": 64, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# In each child: every measured step starts with its input files in the page cache, no dirty pages
# (the kernel throttles a writer once too many pile up, so a step run after another's writes would be
# slowed by them) and the peak RSS reset; it reports wall time, peak RSS above the RSS it started with
# and CPU time.
MEASURING = """
import ctypes, os, time
from pathlib import Path


def _rss_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def start(inputs):
    # the step's input files read into the page cache first: this VM's host reclaims cached pages at
    # random, and a step that happens to read from the disk measures the disk, not the step
    for path in sorted(Path(inputs).rglob("*")):
        if path.is_file():
            with open(path, "rb", buffering=0) as file:
                while file.read(64 << 20):
                    pass
    os.sync()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # memory an earlier step freed is not counted at this one's start
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    return time.perf_counter(), _rss_kib("VmRSS"), _cpu_seconds()


def _cpu_seconds():
    times = os.times()
    return times.user + times.system


def report(started, label="step"):
    seconds, start_kib, cpu_seconds = time.perf_counter() - started[0], started[1], _cpu_seconds() - started[2]
    print("MEASURED", label, seconds, start_kib, _rss_kib("VmHWM"), cpu_seconds)
"""

# The whole command, timed from the child's start.
MEASURE = MEASURING + """
import runpy, sys
started = start({inputs!r})
sys.argv = {argv!r}
try:
    {run}
except SystemExit as exit:
    assert not exit.code, exit.code
report(started)
"""

# The same steps as functions, run in process after a warm-up on the tiny checkpoint (see the docstring).
STEPS = """
from baseline import copy
from pathlib import Path

if "modelzoo.conversion" in Path("setup.py").read_text() if Path("setup.py").exists() else False:
    from modelzoo.conversion import cli
else:  # an --against checkout from before conversion/ was installed as modelzoo.conversion
    from conversion import cli
# the child runs in the checkout it measures: its code, not another one's an editable install points to
assert Path(cli.__file__).resolve().is_relative_to(Path.cwd().resolve()), (cli.__file__, Path.cwd())

OPTIONS = {"format": "hf", "quantize": None}


def baseline(source, out, shard_bytes):
    copy(source, out, shard_bytes)


def import_(source, out, shard_bytes):
    cli._import_rank(0, source, out, 1, 1, "bfloat16", None, {}, False, 1)


def export(source, out, shard_bytes):
    cli._export_rank(0, source, out, 1, 1, shard_bytes, OPTIONS)


def export_from_memory(source, out, shard_bytes):
    # the A/B of `export`: without os.copy_file_range the writer writes every tensor from its map
    import os

    if hasattr(os, "copy_file_range"):  # gone for the rest of the process
        del os.copy_file_range
    export(source, out, shard_bytes)
"""

WARM_AND_MEASURE = MEASURING + """
import shutil

from steps import baseline, export, export_from_memory, import_

if __name__ == "__main__":
    warm = {warm!r}
    import_({tiny!r}, warm + "/megatron", 2**30)
    export(warm + "/megatron", warm + "/hf", 2**30)
    baseline({tiny!r}, warm + "/copy", 2**30)
    hf, copy, source, out, shard_bytes = {args!r}
    # one pair more than reported, first: a process's first pass over 2 GB of fresh memory pays for pages
    # this VM's host took back (the first baseline of each child took 2-5x the others on 2026-12-03)
    for repeat in range({rounds} + 1):
        started = start(hf)
        baseline(hf, copy, shard_bytes)
        report(started, "baseline" if repeat else "warm-up")
        shutil.rmtree(copy)
        started = start(source)
        {step}(source, out, shard_bytes)
        report(started, "step" if repeat else "warm-up")
        if repeat < {rounds}:
            shutil.rmtree(out)
"""

BASELINE = """
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file


def copy(source, target, shard_bytes):
    # shards laid out as `ShardedWriter` does: in order, a shard closed before it would exceed shard_bytes
    source, target = Path(source), Path(target)
    target.mkdir()
    files = sorted(source.glob("*.safetensors"))
    shard, size, count = {}, 0, 0
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                if shard and size + tensor.nbytes > shard_bytes:
                    save_file(shard, target / f"shard-{count}.safetensors", metadata={"format": "pt"})
                    shard, size, count = {}, 0, count + 1
                shard[name] = tensor
                size += tensor.nbytes
    save_file(shard, target / f"shard-{count}.safetensors", metadata={"format": "pt"})


if __name__ == "__main__":
    copy(sys.argv[1], sys.argv[2], int(sys.argv[3]))
"""


PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")


def page_reporting() -> dict[str, str] | None:
    """The VM kernel's free page reporting settings, where it has them: memory the guest frees is
    handed back to the host, and the next write to it is ~10x slower than to memory the guest kept,
    the largest source of these figures' spread (docs/performance.md). Counters left out."""
    if not PAGE_REPORTING.is_dir():
        return None
    return {path.name: path.read_text().strip() for path in sorted(PAGE_REPORTING.iterdir())
            if path.name not in ("passes", "reported_kib", "walked")}


def make_checkpoint(folder: Path, layers: int, shard_bytes: int) -> int:
    sys.path.insert(0, str(ROOT))
    from tiny_checkpoints.make_tiny import write_sharded_loopcoder

    total_bytes, _ = write_sharded_loopcoder(folder, {**CONFIG, "num_hidden_layers": layers}, shard_bytes)
    return total_bytes


def measure(label: str, code: str, checkout: Path = ROOT) -> list[dict]:
    """Run `code` in a child; its MEASURED lines but the warm-up's, in order, as {step, seconds, CPU
    seconds, peak RSS above start}."""
    done = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{label} failed:\n{done.stderr[-3000:]}")
    results = []
    for line in done.stdout.splitlines():
        if line.startswith("MEASURED") and not line.startswith("MEASURED warm-up"):
            kind, seconds, start_kib, peak_kib, cpu_seconds = line.split()[1:]
            results.append({"step": "baseline read+write" if kind == "baseline" else label, "seconds": float(seconds),
                            "cpu_seconds": float(cpu_seconds),
                            "peak_rss_above_start_gib": (float(peak_kib) - float(start_kib)) / 2**20})
    # as each child ends: a run stopped early (a time limit) still shows what it measured
    print(f"{label}: " + ", ".join(f"{result['step']} {result['seconds']:.2f} s" for result in results), flush=True)
    return results


def summarise(pairs: list[tuple[dict, dict]]) -> dict:
    """A step against its baselines: median seconds, the median of the per-pair ratios, the largest peak RSS."""
    steps = [step for _, step in pairs]
    ratios = [step["seconds"] / baseline["seconds"] for baseline, step in pairs]
    return {"step": steps[0]["step"], "seconds": statistics.median(step["seconds"] for step in steps),
            "baseline_seconds": statistics.median(baseline["seconds"] for baseline, _ in pairs),
            "time_vs_baseline": statistics.median(ratios), "time_vs_baseline_per_round": ratios,
            "seconds_per_round": [step["seconds"] for step in steps],
            "baseline_seconds_per_round": [baseline["seconds"] for baseline, _ in pairs],
            "cpu_seconds": statistics.median(step["cpu_seconds"] for step in steps),
            "baseline_cpu_seconds": statistics.median(baseline["cpu_seconds"] for baseline, _ in pairs),
            "peak_rss_above_start_gib": max(step["peak_rss_above_start_gib"] for step in steps)}


def checkout_commit(checkout: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--shard-bytes", type=int, default=512 * 2**20)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "conversion_cpu.json"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, default=None,
                        help="a checkout of another commit (git worktree add DIR COMMIT): its in-process import and "
                             "export are timed in this run, each right after ours")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-conversion-"))
    source = work / "hf"
    size = make_checkpoint(source, args.layers, args.shard_bytes)
    (work / "baseline.py").write_text(BASELINE)
    (work / "steps.py").write_text(STEPS)
    tiny = str(ROOT / "tiny_checkpoints" / "loopcoder-tiny")

    def in_process(label: str, step: str, source_dir: Path, out_name: str, *remove: str, checkout: Path = ROOT) -> dict:
        """`step` timed `--rounds` times, each right after the baseline, in one warmed-up child running the code of
        `checkout` (the child's working directory comes first on its sys.path)."""
        warm = work / f"warm-{out_name}"
        shutil.rmtree(warm, ignore_errors=True)
        warm.mkdir()
        code = f"import sys; sys.path.insert(0, {str(work)!r})\n" + WARM_AND_MEASURE.format(
            warm=str(warm), tiny=tiny, step=step, rounds=args.rounds,
            args=(str(source), str(work / "copy"), str(source_dir), str(work / out_name), args.shard_bytes))
        results = measure(label, code, checkout)
        for output in remove:  # outputs no later step reads (tmpfs holds them in memory)
            shutil.rmtree(work / output)
        return summarise(list(zip(results[0::2], results[1::2])))

    def cli(label: str, argv: list[str], inputs: Path) -> dict:
        return measure(label, MEASURE.format(argv=argv, inputs=str(inputs),
                                             run='runpy.run_module("modelzoo.conversion.cli", run_name="__main__")'))[0]

    baseline_cli = MEASURE.format(argv=[str(work / "baseline.py"), str(source), str(work / "copy-cli"), str(args.shard_bytes)],
                                  inputs=str(source),
                                  run=f"runpy.run_path({str(work / 'baseline.py')!r}, run_name='__main__')")

    groups = {"in process": [in_process("modelzoo import", "import_", source, "megatron")]}
    if args.against:  # the same step of the other checkout right after ours, its import read by our export
        groups["in process, --against"] = [in_process("modelzoo import", "import_", source, "megatron-against",
                                                      "megatron-against", checkout=args.against)]
    groups["in process"].append(in_process("modelzoo export", "export", work / "megatron", "exported", "exported"))
    if args.against:
        groups["in process, --against"].append(in_process("modelzoo export", "export", work / "megatron", "exported",
                                                          "exported", checkout=args.against))
    groups["in process"].append(in_process("export from memory", "export_from_memory", work / "megatron", "exported",
                                           "megatron", "exported"))
    cli_pairs = {"modelzoo import": [], "modelzoo export": []}
    for _ in range(args.rounds):  # baseline, import, export, then again: each ratio is taken within its round
        baseline = measure("baseline read+write", baseline_cli)[0]
        shutil.rmtree(work / "copy-cli")
        cli_pairs["modelzoo import"].append((baseline, cli("modelzoo import", [
            "modelzoo", "import", str(source), str(work / "megatron-cli"), "--dtype", "bfloat16"], source)))
        cli_pairs["modelzoo export"].append((baseline, cli("modelzoo export", [
            "modelzoo", "export", str(work / "megatron-cli"), str(work / "exported-cli"),
            "--max-shard-bytes", str(args.shard_bytes)], work / "megatron-cli")))
        for output in ("megatron-cli", "exported-cli"):
            shutil.rmtree(work / output)
    groups["CLI"] = [summarise(pairs) for pairs in cli_pairs.values()]

    print(f"checkpoint: {size / 2**30:.2f} GiB bf16 in {len(list(source.glob('*.safetensors')))} shards, {work}; "
          f"free page reporting: {page_reporting()}")
    for timing, results in groups.items():
        print(f"\n{timing}, {args.rounds} rounds (ratio: median of the per-round ratios to the baseline)\n"
              f"{'step':<20}{'seconds':>9}{'baseline s':>12}{'x baseline':>12}{'CPU s':>7}{'baseline':>10}"
              f"{'peak RSS GiB':>14}  per round")
        for row in results:
            per_round = " ".join(f"{ratio:.2f}" for ratio in row["time_vs_baseline_per_round"])
            print(f"{row['step']:<20}{row['seconds']:>9.1f}{row['baseline_seconds']:>12.1f}"
                  f"{row['time_vs_baseline']:>12.2f}{row['cpu_seconds']:>7.1f}{row['baseline_cpu_seconds']:>10.1f}"
                  f"{row['peak_rss_above_start_gib']:>14.2f}  {per_round}")
    against = {}
    if args.against:  # each step's ratio to its baseline over the other checkout's, both measured in this run
        against = {"against": {"checkout": str(args.against), "commit": checkout_commit(args.against),
                               "time_vs_against": {ours["step"]: ours["time_vs_baseline"] / theirs["time_vs_baseline"]
                                                   for ours, theirs in zip(groups["in process"],
                                                                           groups["in process, --against"])}}}
        print(f"\nagainst {against['against']['commit']} (x baseline, ours over theirs): " + ", ".join(
            f"{step} {ratio:.3f}" for step, ratio in against["against"]["time_vs_against"].items()))
    write_run(args.out, {**run_record("bench_conversion.py"), "checkpoint_gib": size / 2**30,
                         "shard_bytes": args.shard_bytes, "page_reporting": page_reporting(), "results": groups,
                         **against})


if __name__ == "__main__":
    main()
