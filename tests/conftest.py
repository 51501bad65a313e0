"""Shared test helpers: paths of the shipped tiny checkpoints and the deterministic generator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_checkpoints import make_tiny as make_tiny_module

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tiny_checkpoints"


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu need a CUDA device: skipped without one (the marker alone selects them, `-m gpu`)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def make_tiny():
    return make_tiny_module


@pytest.fixture(scope="session")
def llama_tiny() -> Path:
    return TINY / "llama-tiny"


def write_llama_variant(folder: Path, make_tiny, **changes) -> Path:
    """A llama-tiny with some config fields changed, written by the shipped generator."""
    config = {**make_tiny.LLAMA_TINY, **changes}
    make_tiny.write_checkpoint(folder, config, make_tiny.llama_shapes(config))
    return folder


def tiny_with_vocab(architecture: str, folder: Path, vocab_size: int) -> Path:
    """A tiny checkpoint whose vocabulary is `vocab_size` (not a multiple of 128: Megatron pads it), written by the
    shipped generator; DeepSeek-V4's and V4.1's tiny ones have 250 tokens already."""
    shipped = {"deepseek_v4": "deepseek-v4-tiny", "deepseek_v41": "deepseek-v41-tiny"}
    if architecture in shipped:
        assert vocab_size == 250, f"{shipped[architecture]} has 250 tokens"
        return TINY / shipped[architecture]
    make_tiny = make_tiny_module
    base, shapes = {"llama": (make_tiny.LLAMA_TINY, make_tiny.llama_shapes),
                    "loopcoder": (make_tiny.LOOPCODER_TINY, make_tiny.loopcoder_shapes)}[architecture]
    config = {**base, "vocab_size": vocab_size}
    make_tiny.write_checkpoint(folder / architecture, config, shapes(config))
    return folder / architecture


@pytest.fixture
def run_in_triton_interpreter():
    """`run(test_file)`: the file's `__main__` in a subprocess under Triton's CPU interpreter (TRITON_INTERPRET=1,
    which must be set before triton is imported); fails the test with its output if it fails."""
    pytest.importorskip("triton")

    def run(test_file: str) -> None:
        # the repository and tests/ on the path, as pytest puts them there: the file's imports resolve alike
        path = os.pathsep.join(filter(None, (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH"))))
        # the interpreter runs kernels on CPU tensors: no GPU, also where one is present (models go to the GPU)
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run
