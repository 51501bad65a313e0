"""The package's layout holds (docs/architecture.md): generic code imports no architecture, no module imports
itself back through others, and every registered architecture has the contract's files and declarations.

Imports are read from the source (ast), wherever they are in a module: at the top, inside a function, under
`if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from conftest import ROOT

from modelzoo import registry
from modelzoo.conversion.mapping import MappingTable
from modelzoo.conversion.sync import Naming
from modelzoo.provider import ModelProvider

PACKAGE = ROOT / "modelzoo"
# modelzoo's subpackages that are not architectures; integrations bind named architectures to other libraries
NOT_ARCHITECTURES = {"conversion", "layers", "lora", "provider", "integrations"}
CONTRACT_FILES = ("__init__.py", "config.py", "provider.py", "mapping.py", "lora.py", "sync.py")


def source_modules() -> dict[str, Path]:
    """Dotted module name -> file, for modelzoo and conversion/ (installed as modelzoo.conversion)."""
    modules = {}
    for root, package in ((PACKAGE, "modelzoo"), (ROOT / "conversion", "modelzoo.conversion")):
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports: `from a.b import c` is a.b.c where that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return found & known


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {name: imported_modules(name, path, set(modules)) - {name} for name, path in modules.items()}


def architecture_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir() and parts[1] not in NOT_ARCHITECTURES:
        return parts[1]
    return None


def test_generic_code_imports_no_architecture():
    wrong = sorted(f"{module} imports {target}" for module, targets in import_graph().items()
                   if architecture_of(module) is None and not module.startswith("modelzoo.integrations")
                   for target in targets if architecture_of(target) is not None)
    assert wrong == []


def test_no_module_imports_itself_back():
    graph = import_graph()
    cycles, state = [], {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*stack[stack.index(target):], target]))
            elif target not in state:
                visit(target, [*stack, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_checker_sees_imports_inside_functions_and_relative_ones(tmp_path):
    path = tmp_path / "__init__.py"
    path.write_text("def f():\n    from modelzoo.registry import register\n\nfrom .model import Model\n")
    assert imported_modules("modelzoo.llama", path, {"modelzoo.registry", "modelzoo.llama.model"}) == \
        {"modelzoo.registry", "modelzoo.llama.model"}


@pytest.mark.parametrize("name", sorted(registry.BUILTIN_ARCHITECTURES))
def test_every_registered_architecture_folder_has_the_contract(name):
    entry = registry.BUILTIN_ARCHITECTURES[name]
    folder = PACKAGE / entry.module.split(".")[1]
    assert entry.module == f"modelzoo.{folder.name}.provider"
    missing = [file for file in CONTRACT_FILES if not (folder / file).is_file()]
    assert missing == [] and ((folder / "model.py").is_file() or (folder / "model").is_dir()), missing

    provider = registry.provider_class({"model_type": entry.hf_model_types[0]})
    assert issubclass(provider, ModelProvider) and provider.__module__ == entry.module
    # what the generic code reads of it: the registry, the CLI, LoRA, weight sync, building and conversion
    assert (provider.name, provider.hf_model_types, provider.hf_architectures) == \
           (entry.name, entry.hf_model_types, entry.hf_architectures)
    assert (provider.checkpoint_formats, provider.cli_options) == (entry.checkpoint_formats, entry.cli_options)
    assert type(provider.lora_targets()).__name__ == "TargetTable"
    namings = provider.sync_namings()
    assert "hf" in namings and all(isinstance(naming, Naming) for naming in namings.values())
    assert set(namings) <= {"hf", provider.engine_naming, *provider.checkpoint_formats}
    for flag, option in provider.cli_options.items():
        assert flag.startswith("--") and option["passed_to"] in ("provider", "save") and option["commands"], flag
        assert "default" in option, flag  # an option is passed on only when it differs from its default
    for method in ("transformer_config_fields", "build_model", "mapping", "hf_model_class"):
        assert getattr(provider, method) is not getattr(ModelProvider, method), method
    assert inspect.signature(provider.mapping).return_annotation in (inspect.Signature.empty, MappingTable,
                                                                      "MappingTable")


def test_every_folder_of_the_package_is_a_regular_package():
    """setuptools installs only folders with an __init__.py (find_packages): another is left out of a wheel."""
    folders = [ROOT / "conversion", *(path for path in PACKAGE.rglob("*") if path.is_dir())]
    assert [folder for folder in folders if folder.name != "__pycache__" and not (folder / "__init__.py").is_file()] == []
