"""The benchmark scripts' own machinery (CPU): probes that do not outlive their limit, scratch folders that go away
when a run is stopped, the recorded command, result files of runs, the longest-fit search, the context-parallel
benchmark's ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import harness  # noqa: E402
from bench_longest_fit import longest_fit, run_probe  # noqa: E402


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, exited but not reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_probe_past_its_limit_is_killed_with_the_processes_it_started(tmp_path):
    grandchild_file = tmp_path / "grandchild.pid"
    probe = textwrap.dedent(f"""
        import subprocess, sys, tempfile, time
        sleeper = subprocess.Popen(["sleep", "120"])
        open({str(grandchild_file)!r}, "w").write(str(sleeper.pid))
        print(tempfile.gettempdir(), file=sys.stderr, flush=True)
        time.sleep(60)
    """)
    with pytest.raises(subprocess.TimeoutExpired):
        run_probe([sys.executable, "-c", probe], str(tmp_path), timeout=15)  # time for the child to start its own
    grandchild = int(grandchild_file.read_text())
    deadline = time.monotonic() + 5
    while running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(grandchild), "the probe's own child outlived the probe's limit"


def test_a_probe_runs_with_its_temporary_files_in_the_scratch_folder(tmp_path):
    status, stderr = run_probe([sys.executable, "-c", "import sys, tempfile; print(tempfile.gettempdir(), "
                                "file=sys.stderr); sys.exit(3)"], str(tmp_path), timeout=60)
    assert status == 3
    assert Path(stderr.strip()) == tmp_path


def test_a_stopped_benchmark_removes_its_scratch_folder(tmp_path):
    run = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(BENCHMARKS)!r})
        from harness import scratch_folder
        with scratch_folder("checkpoint") as folder:
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(b"weights")
            print(folder, flush=True)
            time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", run], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    folder = Path(child.stdout.readline().strip())
    assert folder.parent.parent == tmp_path and (folder / "model.safetensors").exists()
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert not folder.parent.exists(), f"{folder.parent} was left behind by a stopped run"


def test_the_recorded_command_can_be_typed_again(monkeypatch):
    """An empty argument (`--paths ''`: transformers' model alone) survives; `--out`, naming where one machine wrote
    the file, is left out in both spellings."""
    monkeypatch.setattr(harness.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(harness.torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    monkeypatch.setenv("MODELZOO_COMMIT", "abc1234")
    monkeypatch.setattr(sys, "argv", ["bench_deepseek_v4.py", "--paths", "", "--out", "/x/y.json", "--seq", "7168",
                                      "--out=/x/z.json"])
    record = harness.run_record("bench_deepseek_v4.py")
    assert record["command"] == "python3 benchmarks/bench_deepseek_v4.py --paths '' --seq 7168"
    assert (record["machine"], record["commit"]) == ("NVIDIA H200", "abc1234")
    assert record["versions"]["torch"] == torch.__version__ and set(harness.PROVENANCE) <= set(record)


def test_a_run_replaces_the_run_of_its_command_and_joins_the_others(tmp_path):
    """One file per benchmark, configuration and machine: a rerun of a command replaces its figures, a run of another
    command (a longest-fit probe at another length) is added to them."""
    out = tmp_path / "longest_fit_dense_x_full_h100.json"
    harness.write_run(out, {"command": "probe --start 8", "ms": 1})
    harness.write_run(out, {"command": "probe --start 16", "ms": 2})
    harness.write_run(out, {"command": "probe --start 8", "ms": 3})
    assert json.loads(out.read_text())["runs"] == [{"command": "probe --start 16", "ms": 2},
                                                   {"command": "probe --start 8", "ms": 3}]


def test_the_deepseek_v4_bench_model_has_positions_for_its_row():
    """A row past the config's positions is refused by the model: the benchmark gives it `--seq` positions there,
    and keeps the release attention's (and its RoPE) for shorter rows."""
    from bench_deepseek_v4 import CONFIGS, model_config

    release = CONFIGS["large"]["max_position_embeddings"]
    assert model_config("large", release // 2)["max_position_embeddings"] == release
    longer = model_config("large", 2 * release)
    assert longer["max_position_embeddings"] == 2 * release
    assert longer["rope_parameters"] == CONFIGS["large"]["rope_parameters"]


def test_longest_fit_doubles_then_bisects_on_the_granularity():
    tried = []

    def fits(seq):
        tried.append(seq)
        return seq <= 45_000

    assert longest_fit(fits, 4096, 262144, refine=3, granularity=4096) == 40960
    assert tried == [4096, 8192, 16384, 32768, 65536, 49152, 40960, 45056]
    assert longest_fit(lambda seq: False, 4096, 262144, refine=2, granularity=4096) is None
    assert longest_fit(lambda seq: True, 4096, 20000, refine=2, granularity=4096) == 20000


def test_the_context_parallel_benchmark_runs_its_two_layouts_on_cpu_ranks(tmp_path):
    """The weak-scaling benchmark's code (the trainer's call on each rank's share, the gradient sum over the
    context-parallel group) on gloo ranks: one rank on 64 tokens, two on 128. A check that it runs, not a timing."""
    out = tmp_path / "cp.json"
    finished = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_context_parallel.py"), "--model", str(BENCHMARKS.parent /
         "tiny_checkpoints" / "loopcoder-tiny"), "--seq", "64", "--cp", "2", "--dtype", "float32", "--steps", "1",
         "--warmup", "0", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    [result] = json.loads(out.read_text())["runs"]
    assert [(r["gpus"], r["seq"]) for r in (result["one_gpu"], result["context_parallel"])] == [(1, 64), (2, 128)]


def test_a_stopped_search_leaves_the_probes_it_made(tmp_path, monkeypatch):
    """The result file is written after every probe, so a search stopped part-way keeps what it measured."""
    import bench_longest_fit

    def fake_probe(args, seq, probes):
        if len(probes) == 3:
            raise SystemExit(143)  # stopped (SIGTERM) during the fourth probe
        probes.append({"seq": seq, "fits": seq <= 16384})
        return seq <= 16384

    out = tmp_path / "longest.json"
    monkeypatch.setattr(bench_longest_fit, "probe", fake_probe)
    monkeypatch.setattr(harness.torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # main's SIGTERM handler stays out of this process
    monkeypatch.setattr(sys, "argv", ["bench_longest_fit.py", "dense", "megatron-loopcoder", "--start", "4096",
                                      "--out", str(out)])
    with pytest.raises(SystemExit):
        bench_longest_fit.main()
    [written] = json.loads(out.read_text())["runs"]
    assert written["complete"] is False and written["longest_fit_so_far"] == 16384
    assert [p["seq"] for p in written["probes"]] == [4096, 8192, 16384]


def test_block_recompute_reaches_the_probed_script():
    from argparse import Namespace

    from bench_longest_fit import probe_command

    for bench, model, script in (("dense", "megatron-loopcoder", "bench_dense.py"),
                                 ("deepseek_v4", "ours", "bench_deepseek_v4.py")):
        args = Namespace(bench=bench, model=model, config="large", recompute="full", recompute_layers=13)
        command = probe_command(args, 65536, Path("result.json"))
        assert Path(command[1]).name == script
        assert command[command.index("--recompute") + 1] == "full"
        assert command[command.index("--recompute-layers") + 1] == "13"
        assert command[command.index("--seq") + 1] == "65536"


def test_saved_activations_counts_each_saved_storage_once_under_the_module_that_saved_it():
    """Linear saves its input, ReLU its output; the second Linear's input is that same output (counted once, under
    the ReLU) and parameters are not activations."""
    from saved_activations import saved_bytes_by_module

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    by_module, out = saved_bytes_by_module(model, lambda: model(x).sum())
    out.backward()
    assert dict(by_module) == {"0": 5 * 8 * 4, "1": 5 * 16 * 4}
