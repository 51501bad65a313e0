"""Name tables between a Megatron model's state dict and a Hugging Face checkpoint.

An architecture's table is a list of rules, readable as data:

    Rule("decoder.layers.*.self_attention.linear_qkv.weight",
         ("model.layers.*.self_attn.q_proj.weight", "model.layers.*.self_attn.k_proj.weight",
          "model.layers.*.self_attn.v_proj.weight"),
         FusedQKV(heads, kv_heads, head_dim))

`*` stands for an integer (a layer index) and is carried from one side to the other in order. A rule of an
integer table that indexes something (`Indices`) says what its values may be; they are checked on the way in
and out.
`MappingTable.check_coverage` proves that every Megatron tensor and every checkpoint tensor is
claimed by exactly one rule.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from functools import cached_property

from modelzoo.conversion.errors import MappingError
from modelzoo.conversion.transforms import Direct, Transform


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A name pattern (`*` = an integer index) as a regex whose groups are the indices."""
    return re.compile("^" + r"(\d+)".join(re.escape(part) for part in pattern.split("*")) + "$")


def fill_pattern(pattern: str, indices: tuple[str, ...]) -> str:
    """The name a pattern stands for at the given wildcard indices."""
    parts = pattern.split("*")
    if len(parts) - 1 != len(indices):
        raise ValueError(f"pattern {pattern!r} has {len(parts) - 1} wildcards, got indices {indices}")
    return "".join(part + index for part, index in zip(parts, (*indices, "")))


@dataclasses.dataclass(frozen=True)
class Indices:
    """An integer tensor whose values index something of `end` entries (a hash router's token -> expert
    table): every value must lie in [0, end); `meaning` says what they name, for the message."""

    end: int
    meaning: str


@dataclasses.dataclass(frozen=True)
class Rule:
    megatron: str
    hf: str | tuple[str, ...]
    transform: Transform = dataclasses.field(default_factory=Direct)
    values: Indices | None = None  # an integer table's range, checked both ways

    @property
    def hf_patterns(self) -> tuple[str, ...]:
        return (self.hf,) if isinstance(self.hf, str) else self.hf

    def hf_names(self, indices: tuple[str, ...]) -> list[str]:
        return [fill_pattern(pattern, indices) for pattern in self.hf_patterns]

    def megatron_name(self, indices: tuple[str, ...]) -> str:
        return fill_pattern(self.megatron, indices)


class MappingTable:
    def __init__(self, rules: Iterable[Rule]):
        self.rules = list(rules)

    @cached_property
    def _megatron_regexes(self) -> list[tuple[re.Pattern[str], Rule]]:
        return [(compile_pattern(rule.megatron), rule) for rule in self.rules]

    @cached_property
    def _hf_regexes(self) -> list[tuple[re.Pattern[str], Rule]]:
        return [(compile_pattern(pattern), rule) for rule in self.rules for pattern in rule.hf_patterns]

    def for_megatron(self, name: str) -> tuple[Rule, tuple[str, ...]] | None:
        """The rule claiming a Megatron tensor name and its wildcard indices (None if unclaimed)."""
        matches = [(rule, m.groups()) for regex, rule in self._megatron_regexes if (m := regex.match(name))]
        if len(matches) > 1:
            raise MappingError(f"Megatron tensor {name} is claimed by {len(matches)} rules: {[r.megatron for r, _ in matches]}")
        return matches[0] if matches else None

    def for_hf(self, name: str) -> tuple[Rule, tuple[str, ...]] | None:
        matches = [(rule, m.groups()) for regex, rule in self._hf_regexes if (m := regex.match(name))]
        if len(matches) > 1:
            raise MappingError(f"checkpoint tensor {name} is claimed by {len(matches)} rules: {[r.megatron for r, _ in matches]}")
        return matches[0] if matches else None

    def hf_names_for(self, megatron_names: Iterable[str]) -> dict[str, list[str]]:
        """Megatron name -> the checkpoint names it is made from, for every given Megatron tensor."""
        names: dict[str, list[str]] = {}
        unmapped = []
        for name in megatron_names:
            found = self.for_megatron(name)
            if found is None:
                unmapped.append(name)
                continue
            rule, indices = found
            names[name] = rule.hf_names(indices)
        if unmapped:
            raise MappingError(f"no mapping rule for Megatron tensors: {_short_list(unmapped)}")
        return names

    def check_coverage(self, megatron_names: Iterable[str], hf_names: Iterable[str], where: str) -> dict[str, list[str]]:
        """Every Megatron tensor mapped once, every checkpoint tensor claimed once; else one clear error."""
        expected = self.hf_names_for(megatron_names)
        claimed: dict[str, str] = {}
        for megatron_name, sources in expected.items():
            for source in sources:
                if source in claimed:
                    raise MappingError(f"checkpoint tensor {source} is claimed by both {claimed[source]} and {megatron_name}")
                claimed[source] = megatron_name
        present = set(hf_names)
        missing = sorted(set(claimed) - present)
        unexpected = sorted(present - set(claimed))
        problems = []
        if missing:
            problems.append(f"missing tensors {_short_list(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors {_short_list(unexpected)}")
        if problems:
            raise MappingError(f"{where}: " + "; ".join(problems))
        return expected


def _short_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
