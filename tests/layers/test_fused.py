"""`modelzoo.layers.fused.fused`: which torch.compile call it makes (the compiled kernels are tested on a GPU in
tests/deepseek_v4/test_fused_gpu.py and the DeepSeek-V4 GPU tests)."""

import torch

from modelzoo.layers.fused import fused


class _OnGpu:
    is_cuda = True


def _compile_calls(monkeypatch, decorate):
    calls = []

    def compile(fn, **options):
        calls.append(options)
        return fn

    monkeypatch.setattr(torch, "compile", compile)
    function = decorate(lambda x: "ran")
    assert function(_OnGpu()) == "ran" and function(_OnGpu()) == "ran"
    return calls


def test_fused_compiles_once_for_static_shapes(monkeypatch):
    """dynamic=False: torch's automatic dynamic shapes gave wrong gradients on a GPU (modelzoo/layers/fused.py)."""
    assert _compile_calls(monkeypatch, fused) == [{"dynamic": False}]


def test_cpu_tensors_run_the_function_itself(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **options: 1 / 0)
    assert fused(lambda x: x + 1)(torch.ones(1)).item() == 2
