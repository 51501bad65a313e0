"""Shared helpers of the DeepSeek-V4.1 tests (a plain module, not a conftest, so it cannot shadow tests/conftest.py)."""

from __future__ import annotations

import importlib.util

import torch

from conftest import TINY

V41_TINY = TINY / "deepseek-v41-tiny"


def load_tiny():
    """Our reference model from the shipped tiny checkpoint (fp32, eval)."""
    from modelzoo.deepseek_v41 import DeepseekV41ForCausalLM

    return DeepseekV41ForCausalLM.from_pretrained(V41_TINY, dtype=torch.float32).eval()


def tiny_generator():
    """tiny_checkpoints/deepseek_v41_tiny.py, loaded by path (it lives outside the package)."""
    spec = importlib.util.spec_from_file_location("deepseek_v41_tiny", TINY / "deepseek_v41_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_rows(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token ids of ordinary tokens (ids 0-5 are the special tokens)."""
    return torch.randint(6, 250, (batch, length), generator=torch.Generator().manual_seed(seed))


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)
