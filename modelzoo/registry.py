"""Which provider serves a checkpoint: looked up by config.json's `model_type` or `architectures`.

Each provider class declares its name, model types and architectures (`ModelProvider`). The built-in ones are
known without being imported: their declarations are read from their provider modules' source, so that a config
imports the code of the one architecture it names (torch, transformers' config class, the architecture's
provider), and listing them or refusing an unknown model type imports none.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelzoo.conversion.files import read_json

if TYPE_CHECKING:
    from modelzoo.provider import ModelProvider

# importing one registers its provider (`register`)
BUILTIN_PROVIDER_MODULES = ("modelzoo.deepseek_v4.provider", "modelzoo.deepseek_v41.provider", "modelzoo.llama.provider",
                            "modelzoo.loopcoder.provider")


@dataclasses.dataclass(frozen=True)
class BuiltinArchitecture:
    """A built-in provider class's declaration, as its source states it (literals only)."""

    module: str
    name: str
    hf_model_types: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    checkpoint_formats: dict[str, str] = dataclasses.field(default_factory=dict)
    cli_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def declared_architecture(module: str) -> BuiltinArchitecture:
    """The declaration of the provider class in `module` (a class of this package assigning `name`), read from its
    source without importing it."""
    path = Path(__file__).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    fields = [field.name for field in dataclasses.fields(BuiltinArchitecture) if field.name != "module"]
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ClassDef):
            values = {target.id: ast.literal_eval(statement.value) for statement in node.body
                      if isinstance(statement, ast.Assign) for target in statement.targets
                      if isinstance(target, ast.Name) and target.id in fields}
            if "name" in values:
                return BuiltinArchitecture(module, **values)
    raise ValueError(f"{path}: no provider class declaring `name`")


BUILTIN_ARCHITECTURES = {entry.name: entry for entry in map(declared_architecture, BUILTIN_PROVIDER_MODULES)}

_PROVIDERS: dict[str, type[ModelProvider]] = {}


def register(provider: type[ModelProvider]) -> type[ModelProvider]:
    """Class decorator: make `provider` findable by its model types and architectures."""
    _PROVIDERS[provider.name] = provider
    return provider


def list_architectures() -> list[str]:
    return sorted(BUILTIN_ARCHITECTURES.keys() | _PROVIDERS.keys())


def provider_class(config: dict[str, Any], where: str = "config") -> type[ModelProvider]:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(f"{where}: model_type is {_shown(model_type)}; it must be a string")
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise ValueError(f"{where}: architectures is {_shown(architectures)}; it must be a list of strings")
    # the built-in architectures first, then the others in the order they were registered
    candidates = {name: _PROVIDERS.get(name) or BUILTIN_ARCHITECTURES[name]
                  for name in [*BUILTIN_ARCHITECTURES, *_PROVIDERS]}
    for name, entry in candidates.items():
        if model_type in entry.hf_model_types:
            return _provider(name)
    for name, entry in candidates.items():
        if set(architectures) & set(entry.hf_architectures):
            return _provider(name)
    known = sorted(t for entry in candidates.values() for t in entry.hf_model_types)
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
    from modelzoo.conversion.validation import check_config  # here: it imports torch, which a refused model type does without

    check_config(config, provider.hf_config_class(), where, provider.config_bounds)
    try:
        hf_config = provider.hf_config_class().from_dict(config)
    except Exception as error:  # noqa: BLE001 - whatever the config class's own validation raises is about this file
        raise ValueError(f"{where}: {' '.join(str(error).split())}") from None
    return provider(hf_config, hf_dir=hf_dir, **overrides)


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint folder: a JSON object, read as `modelzoo.conversion.files` reads a checkpoint's files."""
    path = Path(folder) / "config.json"
    if not (path.exists() or path.is_symlink()):
        raise FileNotFoundError(f"{path} does not exist: is {folder} a Hugging Face checkpoint folder?")
    return read_json(path, folder)


def _shown(value) -> str:
    """A config value in a message: its JSON, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _provider(name: str) -> type[ModelProvider]:
    if name not in _PROVIDERS:
        importlib.import_module(BUILTIN_ARCHITECTURES[name].module)
    return _PROVIDERS[name]
