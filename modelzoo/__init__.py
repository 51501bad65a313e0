"""Megatron-Core implementations of new LLM architectures, with Hugging Face bridges and parity tests."""

from modelzoo.provider import ModelProvider
from modelzoo.registry import build_provider, list_architectures, register

__all__ = ["ModelProvider", "build_provider", "list_architectures", "register"]
