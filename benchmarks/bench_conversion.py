"""Checkpoint conversion on the CPU: `modelzoo import` + `modelzoo export` against a read-and-write baseline.

    python benchmarks/bench_conversion.py [--workdir DIR] [--layers 16] [--rounds 3]

Makes a synthetic LoopCoder-shaped bf16 checkpoint (hidden 2048, 16 layers: ~2 GB) in several
shards, then measures, each in its own process so peak RSS is that step's alone:
  baseline   read every tensor with safetensors and write the same bytes into shards with safetensors
  import     modelzoo import  HF -> Megatron torch_dist (bf16, TP 1)
  export     modelzoo export  Megatron -> HF
  export from memory   the same with every tensor written from its memory map, not copied in the kernel
                       with os.copy_file_range (in process only: the A/B of that copy)
twice: "in process" times the conversion alone, in a process that has imported its libraries and
converted the shipped tiny LoopCoder checkpoint first (library imports, lazy module loading and process
start-up are a fixed cost that does not grow with the checkpoint); "CLI" times the whole command from the
child's start. Each timed step starts after `sync` (no dirty pages left by an earlier step); peak RSS
is the step's own peak (VmHWM reset) above the RSS at its start. The steps run `--rounds` times
in turn, and each ratio is taken against the baseline of its own round (this machine's write speed
drifts over minutes). Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = {
    "architectures": ["IQuestLoopCoderForCausalLM"], "model_type": "iquestloopcoder", "vocab_size": 32000,
    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "loop_num": 2, "loop_window_size": 64, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# In each child: every measured step starts with no dirty pages (the kernel throttles a writer once
# too many pile up, so a step run after another's writes would be slowed by them) and with the peak
# RSS reset; it reports wall time and peak RSS above the RSS it started with.
MEASURING = """
import os, time


def _rss_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def start():
    os.sync()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    return time.perf_counter(), _rss_kib("VmRSS")


def report(started):
    seconds, start_kib = time.perf_counter() - started[0], started[1]
    print("MEASURED", seconds, start_kib, _rss_kib("VmHWM"))
"""

# The whole command, timed from the child's start.
MEASURE = MEASURING + """
import runpy, sys
started = start()
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
from conversion import cli

OPTIONS = {"format": "hf", "quantize": None}


def baseline(source, out, shard_bytes):
    copy(source, out, shard_bytes)


def import_(source, out, shard_bytes):
    cli._import_rank(0, source, out, 1, 1, "bfloat16", None)


def export(source, out, shard_bytes):
    cli._export_rank(0, source, out, 1, 1, shard_bytes, OPTIONS)


def export_from_memory(source, out, shard_bytes):
    # the A/B of `export`: without os.copy_file_range the writer writes every tensor from its map
    import os

    del os.copy_file_range
    export(source, out, shard_bytes)
"""

WARM_AND_MEASURE = MEASURING + """
from steps import baseline, export, export_from_memory, import_

if __name__ == "__main__":
    warm = {warm!r}
    import_({tiny!r}, warm + "/megatron", 2**30)
    export(warm + "/megatron", warm + "/hf", 2**30)
    baseline({tiny!r}, warm + "/copy", 2**30)
    started = start()
    {step}(*{args!r})
    report(started)
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


def make_checkpoint(folder: Path, layers: int, shard_bytes: int) -> int:
    sys.path.insert(0, str(ROOT / "tiny_checkpoints"))
    from make_tiny import write_sharded_loopcoder

    total_bytes, _ = write_sharded_loopcoder(folder, {**CONFIG, "num_hidden_layers": layers}, shard_bytes)
    return total_bytes


def measure(label: str, code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{label} failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("MEASURED"))
    seconds, start_kib, peak_kib = (float(value) for value in line.split()[1:])
    return {"step": label, "seconds": seconds, "peak_rss_above_start_gib": (peak_kib - start_kib) / 2**20}


def summarise(per_round: list[list[dict]]) -> list[dict]:
    """Per step: median seconds, median of the per-round ratios to that round's baseline, the largest peak RSS."""
    summary = []
    for index, step in enumerate(per_round[0]):
        rows = [results[index] for results in per_round]
        ratios = [results[index]["seconds"] / results[0]["seconds"] for results in per_round]
        summary.append({"step": step["step"], "seconds": statistics.median(row["seconds"] for row in rows),
                        "time_vs_baseline": statistics.median(ratios), "time_vs_baseline_per_round": ratios,
                        "seconds_per_round": [row["seconds"] for row in rows],
                        "peak_rss_above_start_gib": max(row["peak_rss_above_start_gib"] for row in rows)})
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--shard-bytes", type=int, default=512 * 2**20)
    parser.add_argument("--out", default="bench_conversion.json")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-conversion-"))
    source = work / "hf"
    size = make_checkpoint(source, args.layers, args.shard_bytes)
    (work / "baseline.py").write_text(BASELINE)
    (work / "steps.py").write_text(STEPS)
    tiny = str(ROOT / "tiny_checkpoints" / "loopcoder-tiny")

    def in_process(label: str, step: str, source_dir: Path, out_name: str) -> dict:
        warm = work / f"warm-{out_name}"
        shutil.rmtree(warm, ignore_errors=True)
        warm.mkdir()
        code = f"import sys; sys.path.insert(0, {str(work)!r})\n" + WARM_AND_MEASURE.format(
            warm=str(warm), tiny=tiny, step=step, args=(str(source_dir), str(work / out_name), args.shard_bytes))
        return measure(label, code)

    def cli(label: str, argv: list[str]) -> dict:
        return measure(label, MEASURE.format(argv=argv, run='runpy.run_module("conversion.cli", run_name="__main__")'))

    baseline_cli = MEASURE.format(argv=[str(work / "baseline.py"), str(source), str(work / "copy-cli"), str(args.shard_bytes)],
                                  run=f"runpy.run_path({str(work / 'baseline.py')!r}, run_name='__main__')")

    def removing(result: dict, *outputs: str) -> dict:
        """`result` of a step, after removing the outputs no later step reads (tmpfs holds them in memory)."""
        for output in outputs:
            shutil.rmtree(work / output)
        return result

    rounds = {"in process": [], "CLI": []}
    for _ in range(args.rounds):  # baseline, import, export, then again: each ratio is taken within its round
        rounds["in process"].append([
            removing(in_process("baseline read+write", "baseline", source, "copy"), "copy"),
            in_process("modelzoo import", "import_", source, "megatron"),
            removing(in_process("modelzoo export", "export", work / "megatron", "exported"), "exported"),
            removing(in_process("export from memory", "export_from_memory", work / "megatron", "exported"),
                     "megatron", "exported"),
        ])
        rounds["CLI"].append([
            removing(measure("baseline read+write", baseline_cli), "copy-cli"),
            cli("modelzoo import", ["modelzoo", "import", str(source), str(work / "megatron-cli"),
                                    "--dtype", "bfloat16"]),
            removing(cli("modelzoo export", ["modelzoo", "export", str(work / "megatron-cli"),
                                             str(work / "exported-cli"), "--max-shard-bytes", str(args.shard_bytes)]),
                     "megatron-cli", "exported-cli"),
        ])
    groups = {timing: summarise(per_round) for timing, per_round in rounds.items()}
    print(f"checkpoint: {size / 2**30:.2f} GiB bf16 in {len(list(source.glob('*.safetensors')))} shards, {work}")
    for timing, results in groups.items():
        print(f"\n{timing}, median of {args.rounds} rounds (ratio: median of the per-round ratios)\n"
              f"{'step':<22}{'seconds':>9}{'x baseline':>12}{'per round':>24}{'peak RSS GiB':>14}")
        for row in results:
            per_round = " ".join(f"{ratio:.2f}" for ratio in row["time_vs_baseline_per_round"])
            print(f"{row['step']:<22}{row['seconds']:>9.1f}{row['time_vs_baseline']:>12.2f}{per_round:>24}"
                  f"{row['peak_rss_above_start_gib']:>14.2f}")
    Path(args.out).write_text(json.dumps({"checkpoint_gib": size / 2**30, "shard_bytes": args.shard_bytes,
                                          "results": groups}, indent=2))


if __name__ == "__main__":
    main()
