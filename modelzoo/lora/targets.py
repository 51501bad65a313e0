"""Which layers a LoRA adapts: an architecture's target table (data) and the resolution of user-given names.

A table lists the Megatron modules LoRA may adapt (`Target`) and the ones it refuses, with the reason
(`Refusal`). The names a user may give are derived from the weight mapping, so a table never repeats
them: every dotted suffix of a target's Megatron module path (`linear_qkv`, `self_attention.linear_qkv`)
adapts the whole module, every dotted suffix of one of its Hugging Face projections (`q_proj`,
`self_attn.q_proj`) adapts that projection only; layer indices are left out of the names. `all-linear`
is every target. Names the mapping does not give are added as `aliases`; an alias is matched exactly
and wins over every derived name, which is how a table settles a name that would otherwise be
ambiguous (e.g. DeepSeek-V4's bare `wq_b`, which both the attention and the indexer have).

Resolution order for one name: `all-linear`; an alias; the derived names. A derived name that hits
only targets selects them; one that hits only refusals raises their reason; one that hits both is
ambiguous and raises, listing the qualified names to choose from.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from modelzoo.conversion.mapping import MappingTable, Rule

ALL_LINEAR = "all-linear"


@dataclasses.dataclass(frozen=True)
class Target:
    """A Megatron linear that LoRA adapts as a whole; a fused one's projections share A (B is split per projection)."""

    module: str                     # Megatron module path, `*` for a layer index
    aliases: tuple[str, ...] = ()   # extra names for the whole module, matched before any derived name
    packed_as: str | None = None    # the serving engine's name for this fused module (vLLM packed_modules_mapping)
    # the HF model's module of this (one-projection) target where the checkpoint names its weight otherwise
    # (transformers renames some checkpoint names on load): the PEFT adapter's name, which peft looks up in the model
    transformers: str | None = None


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A module (or tensor) LoRA must not adapt, and why: asking for it by any of its names raises `reason`."""

    module: str
    reason: str
    aliases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class TargetTable:
    targets: tuple[Target, ...]
    refusals: tuple[Refusal, ...] = ()

    def __post_init__(self):
        aliases = [a for entry in (*self.targets, *self.refusals) for a in _aliases(entry)]
        repeated = sorted({a for a in aliases if aliases.count(a) > 1})
        if repeated:
            raise ValueError(f"LoRA target table: aliases {repeated} name more than one entry")


# Selected projections of each adapted module: module pattern -> indices into its mapping rule's HF names.
Selection = dict[str, tuple[int, ...]]


def _aliases(entry: Target | Refusal) -> tuple[str, ...]:
    packed = (entry.packed_as,) if isinstance(entry, Target) and entry.packed_as else ()
    return (*entry.aliases, *packed)


def _suffixes(path: str) -> set[str]:
    """Every dotted suffix of `path` with its index segments (`*`, digits) left out."""
    parts = [part for part in path.split(".") if part != "*" and not part.isdigit()]
    return {".".join(parts[i:]) for i in range(len(parts))}


def _module_of(hf_tensor: str) -> str:
    for suffix in (".weight", ".bias"):
        if hf_tensor.endswith(suffix):
            return hf_tensor[: -len(suffix)]
    return hf_tensor


def weight_rule(mapping: MappingTable, module: str) -> Rule:
    """The mapping rule of a target module's weight (its HF names are the module's projections)."""
    for rule in mapping.rules:
        if rule.megatron == f"{module}.weight":
            return rule
    raise ValueError(f"LoRA target table: target {module} has no `{module}.weight` rule in the weight mapping")


def projections(mapping: MappingTable, module: str) -> list[str]:
    """HF module patterns of a target's projections (`model.layers.*.self_attn.q_proj`), in its weight rule's order."""
    return [_module_of(hf) for hf in weight_rule(mapping, module).hf_patterns]


def _rules_under(mapping: MappingTable, module: str) -> list[Rule]:
    rules = [rule for rule in mapping.rules if rule.megatron == module or rule.megatron.startswith(module + ".")]
    if not rules:
        raise ValueError(f"LoRA target table: refusal {module} matches no tensor of the weight mapping")
    return rules


def resolve(table: TargetTable, mapping: MappingTable, names: Iterable[str], architecture: str) -> Selection:
    """Module pattern -> selected projection indices, for the requested names (see the module docstring)."""
    names = [names] if isinstance(names, str) else list(names)
    hf_modules = {t.module: projections(mapping, t.module) for t in table.targets}
    # derived name -> what it selects: (target, projection indices) or a refusal
    derived: dict[str, list[tuple[Target, tuple[int, ...]] | Refusal]] = {}
    for target in table.targets:
        every = tuple(range(len(hf_modules[target.module])))
        for name in _suffixes(target.module):
            derived.setdefault(name, []).append((target, every))
        for index, hf_module in enumerate(hf_modules[target.module]):
            for name in _suffixes(hf_module):
                derived.setdefault(name, []).append((target, (index,)))
    for refusal in table.refusals:
        paths = {refusal.module} | {_module_of(hf) for rule in _rules_under(mapping, refusal.module)
                                    for hf in rule.hf_patterns}
        for name in set().union(*map(_suffixes, paths)):
            derived.setdefault(name, []).append(refusal)
    aliases = {alias: entry for entry in (*table.targets, *table.refusals) for alias in _aliases(entry)}

    selection: dict[str, set[int]] = {}

    def select(target: Target, indices: Iterable[int]) -> None:
        selection.setdefault(target.module, set()).update(indices)

    for name in names:
        if name == ALL_LINEAR:
            for target in table.targets:
                select(target, range(len(hf_modules[target.module])))
            continue
        entry = aliases.get(name)
        if isinstance(entry, Refusal):
            raise ValueError(f"LoRA target {name!r} is refused for {architecture}: {entry.reason}")
        if isinstance(entry, Target):
            select(entry, range(len(hf_modules[entry.module])))
            continue
        hits = derived.get(name)
        if not hits:
            raise ValueError(f"unknown LoRA target {name!r} for {architecture}; valid names: "
                             f"{', '.join(valid_names(table, mapping))} (or a dotted qualification of one, "
                             f"e.g. 'self_attn.q_proj')")
        refusals = [hit for hit in hits if isinstance(hit, Refusal)]
        targets = [hit for hit in hits if not isinstance(hit, Refusal)]
        if refusals and targets:
            choices = sorted({t.module for t, _ in targets} | {r.module for r in refusals})
            raise ValueError(f"LoRA target {name!r} is ambiguous for {architecture}: it names {', '.join(choices)}; "
                             f"qualify it")
        if refusals:
            raise ValueError(f"LoRA target {name!r} is refused for {architecture}: "
                             + "; ".join(dict.fromkeys(r.reason for r in refusals)))
        for target, indices in targets:
            select(target, indices)
    return {module: tuple(sorted(indices)) for module, indices in selection.items()}


def valid_names(table: TargetTable, mapping: MappingTable) -> list[str]:
    """The short names a user may give: leaf names of targets and their projections, aliases, all-linear."""
    leaves = {ALL_LINEAR}
    for target in table.targets:
        leaves.add(target.module.rsplit(".", 1)[-1])
        leaves.update(hf_module.rsplit(".", 1)[-1] for hf_module in projections(mapping, target.module))
        leaves.update(_aliases(target))
    return sorted(leaves)


def compile_module_pattern(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + r"\d+".join(re.escape(part) for part in pattern.split("*")) + "$")
