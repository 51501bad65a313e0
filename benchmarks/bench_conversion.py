"""Checkpoint conversion on the CPU: `modelzoo import` + `modelzoo export` against a read-and-write baseline.

    python benchmarks/bench_conversion.py [--workdir DIR] [--layers 16]

Makes a synthetic LoopCoder-shaped bf16 checkpoint (hidden 2048, 16 layers: ~2 GB) in several
shards, then measures, each in its own process so peak RSS is that step's alone:
  baseline   read every tensor with safetensors and write the same bytes into shards
  import     modelzoo import  HF -> Megatron torch_dist (bf16, TP 1)
  export     modelzoo export  Megatron -> HF
Prints wall time, peak RSS above the process's start, and ratios to the baseline; writes JSON.
"""

from __future__ import annotations

import argparse
import json
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

# Run in a child process: report its own wall time and peak RSS above what it had at start.
MEASURE = """
import resource, sys, time, runpy
start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
sys.argv = {argv!r}
try:
    {run}
except SystemExit as exit:
    assert not exit.code, exit.code
print("MEASURED", time.perf_counter() - start, start_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

BASELINE = """
import sys
from conversion.safetensors_io import CheckpointReader, ShardedWriter
reader = CheckpointReader(sys.argv[1])
with ShardedWriter(sys.argv[2], max_shard_bytes=int(sys.argv[3])) as writer:
    for name in reader.names():
        writer.add(name, reader.get(name))
"""


def make_checkpoint(folder: Path, layers: int, shard_bytes: int) -> int:
    sys.path.insert(0, str(ROOT / "tiny_checkpoints"))
    import torch
    from make_tiny import loopcoder_shapes

    from conversion.safetensors_io import ShardedWriter

    config = {**CONFIG, "num_hidden_layers": layers}
    generator = torch.Generator().manual_seed(0)
    with ShardedWriter(folder, max_shard_bytes=shard_bytes) as writer:
        for name, shape in sorted(loopcoder_shapes(config).items()):
            writer.add(name, (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16))
        writer.write_json("config.json", config)
    return writer.total_bytes


def measure(label: str, run: str, argv: list[str]) -> dict:
    """`run`: the statement that runs the step (runpy of a module or a script) with `sys.argv = argv`."""
    code = MEASURE.format(argv=argv, run=run)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{label} failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("MEASURED"))
    seconds, start_kib, peak_kib = (float(value) for value in line.split()[1:])
    return {"step": label, "seconds": seconds, "peak_rss_above_start_gib": (peak_kib - start_kib) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--shard-bytes", type=int, default=512 * 2**20)
    parser.add_argument("--out", default="bench_conversion.json")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-conversion-"))
    source = work / "hf"
    size = make_checkpoint(source, args.layers, args.shard_bytes)
    baseline_script = work / "baseline.py"
    baseline_script.write_text(BASELINE)

    cli = 'runpy.run_module("conversion.cli", run_name="__main__")'
    results = [
        measure("baseline read+write", f"runpy.run_path({str(baseline_script)!r}, run_name='__main__')",
                [str(baseline_script), str(source), str(work / "copy"), str(args.shard_bytes)]),
        measure("modelzoo import", cli, ["modelzoo", "import", str(source), str(work / "megatron"), "--dtype", "bfloat16"]),
        measure("modelzoo export", cli, ["modelzoo", "export", str(work / "megatron"), str(work / "exported"),
                                         "--max-shard-bytes", str(args.shard_bytes)]),
    ]
    baseline = results[0]
    print(f"checkpoint: {size / 2**30:.2f} GiB bf16 in {len(list(source.glob('*.safetensors')))} shards, {work}")
    print(f"{'step':<22}{'seconds':>9}{'x baseline':>12}{'peak RSS GiB':>14}")
    for row in results:
        row["time_vs_baseline"] = row["seconds"] / baseline["seconds"]
        print(f"{row['step']:<22}{row['seconds']:>9.1f}{row['time_vs_baseline']:>12.2f}{row['peak_rss_above_start_gib']:>14.2f}")
    Path(args.out).write_text(json.dumps({"checkpoint_gib": size / 2**30, "results": results}, indent=2))


if __name__ == "__main__":
    main()
