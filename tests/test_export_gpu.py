"""`save_hf` of a model on the GPU: the writer takes each HF tensor as row blocks of the GPU tensors (a fused
QKV's q, k and v per group, an fc1's halves) and moves them to the CPU block by block; the files must still
hold the checkpoint's tensors bit for bit (`pytest -m gpu tests/test_export_gpu.py`)."""

from pathlib import Path

import pytest
import torch

from modelzoo.conversion.safetensors_io import CheckpointReader
from modelzoo import build_provider, runtime

TINY = Path(__file__).resolve().parents[1] / "tiny_checkpoints"


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ["llama-tiny", "loopcoder-tiny", "deepseek-v4-tiny"])
def test_a_gpu_model_saves_the_checkpoint_it_loaded_bit_exactly(tmp_path, checkpoint):
    source = TINY / checkpoint
    with runtime.parallel():
        provider = build_provider(source)
        model = provider.provide()
        assert next(model.parameters()).is_cuda
        provider.load_hf_weights(model, progress=False)
        provider.save_hf(model, tmp_path / "out")
    original, saved = CheckpointReader(source), CheckpointReader(tmp_path / "out")
    assert set(saved.names()) == set(original.names())
    for name in original.names():
        assert torch.equal(saved.get(name), original.get(name)), name
