"""examples/lora_loopcoder_cpu.py runs as a user runs it, within a minute, and its loss goes down.

Loss criterion: the mean of the last five steps is at least 0.3 nats below the mean of the first five. A batch's
loss moves by ~0.1 from step to step; the example's adapters bring it down by ~0.9 over 40 steps; adapters that
do not train leave it at the start value (about log 256 = 5.5).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
WALL_CLOCK_LIMIT_S = 60
MIN_LOSS_DROP = 0.3


def test_example_fine_tunes_loopcoder_tiny_within_a_minute(tmp_path):
    start = time.perf_counter()
    command = [sys.executable, str(ROOT / "examples" / "lora_loopcoder_cpu.py"), "--out", str(tmp_path / "run")]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=2 * WALL_CLOCK_LIMIT_S)
    elapsed = time.perf_counter() - start
    assert run.returncode == 0, run.stderr[-2000:]
    assert elapsed < WALL_CLOCK_LIMIT_S
    losses = json.loads(run.stdout.strip().splitlines()[-1])["losses"]
    assert len(losses) == 40
    assert sum(losses[:5]) / 5 - sum(losses[-5:]) / 5 >= MIN_LOSS_DROP
    adapter = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 7 * 2  # A and B of seven projections in each of two layers
    assert (tmp_path / "run" / "checkpoint" / "lora.json").exists()
