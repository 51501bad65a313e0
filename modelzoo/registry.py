"""Which provider serves a checkpoint: looked up by config.json's `model_type` or `architectures`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conversion.validation import check_config
from modelzoo.provider import ModelProvider, read_hf_config

_PROVIDERS: dict[str, type[ModelProvider]] = {}


def register(provider: type[ModelProvider]) -> type[ModelProvider]:
    """Class decorator: make `provider` findable by its model types and architectures."""
    _PROVIDERS[provider.name] = provider
    return provider


def list_architectures() -> list[str]:
    _import_builtin_architectures()
    return sorted(_PROVIDERS)


def provider_class(config: dict[str, Any], where: str = "config") -> type[ModelProvider]:
    _import_builtin_architectures()
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    for provider in _PROVIDERS.values():
        if model_type in provider.hf_model_types:
            return provider
    for provider in _PROVIDERS.values():
        if set(architectures) & set(provider.hf_architectures):
            return provider
    known = sorted(t for p in _PROVIDERS.values() for t in p.hf_model_types)
    raise ValueError(f"{where}: unknown model_type {model_type!r} (architectures {architectures}); supported: {known}")


def build_provider(hf_dir_or_config: str | Path | dict[str, Any], **overrides: Any) -> ModelProvider:
    """The provider for a Hugging Face checkpoint folder (or a config dict).

    `overrides`: `attention="exact"|"fast"`, `params_dtype=torch.bfloat16`, or any Megatron
    TransformerConfig field (e.g. `recompute_granularity="selective"`).
    """
    if isinstance(hf_dir_or_config, dict):
        config, hf_dir, where = dict(hf_dir_or_config), None, "config"
    else:
        hf_dir = Path(hf_dir_or_config)
        config, where = read_hf_config(hf_dir), str(hf_dir / "config.json")
    provider = provider_class(config, where)
    check_config(config, provider.hf_config_class(), where)
    try:
        hf_config = provider.hf_config_class().from_dict(config)
    except Exception as error:  # noqa: BLE001 - whatever the config class's own validation raises is about this file
        raise ValueError(f"{where}: {' '.join(str(error).split())}") from None
    return provider(hf_config, hf_dir=hf_dir, **overrides)


def _import_builtin_architectures() -> None:
    # each architecture package registers its provider on import
    import modelzoo.deepseek_v4  # noqa: F401
    import modelzoo.llama  # noqa: F401
    import modelzoo.loopcoder.provider  # noqa: F401
