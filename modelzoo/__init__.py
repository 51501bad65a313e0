"""Megatron-Core implementations of new LLM architectures, with Hugging Face bridges and parity tests."""

from modelzoo.registry import build_provider, list_architectures, register

__all__ = ["ModelProvider", "build_provider", "list_architectures", "register"]


def __getattr__(name: str):
    # ModelProvider on first use: importing it brings torch and transformers, which `modelzoo list` and a
    # refused input do without
    if name == "ModelProvider":
        from modelzoo.provider import ModelProvider

        return ModelProvider
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
