"""Pack a stream of named tensors into size-bounded chunks that never split an atomic update group.

Inference engines fuse some tensors as they load them: vLLM packs q, k, v into `qkv_proj` and gate,
up into `gate_up_proj`; SGLang fuses DeepSeek-V3 MLA's `q_a_proj` + `kv_a_proj_with_mqa` into
`fused_qkv_a_proj_with_mqa`, but only when both halves arrive in one `load_weights` call. A chunk
boundary between them silently corrupts that layer on the engine. An architecture declares those sets
as `UpdateGroup`s, data next to its mapping table (`modelzoo/<name>/sync.py`, `*` for an integer as in
a mapping `Rule`), and `pack_chunks` only ever places whole groups in a chunk:

    UpdateGroup("gate_up_proj", ("model.layers.*.mlp.gate_proj.weight", "model.layers.*.mlp.up_proj.weight"))

Architecture-agnostic; `modelzoo/sync.py` is the entry point that picks the tables and the tensor
stream of a provider.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator

import torch

from modelzoo.conversion.mapping import compile_pattern, fill_pattern

Tensors = list[tuple[str, torch.Tensor]]

# what PEFT puts before a module's name in an adapter file
PEFT_PREFIX = "base_model.model."


class UpdateGroupError(ValueError):
    """A declared group is broken: a member missing from the stream, a tensor in two groups, a duplicate."""


@dataclasses.dataclass(frozen=True)
class UpdateGroup:
    """Tensors an engine fuses on load, so they must arrive in one `load_weights` call."""

    fused: str                  # what the engine fuses them into (for messages), e.g. "qkv_proj"
    members: tuple[str, ...]    # name patterns; every member has the same `*` wildcards

    def __post_init__(self):
        if len(self.members) < 2:
            raise ValueError(f"update group {self.fused}: a group needs at least two members, got {self.members}")
        if len({pattern.count("*") for pattern in self.members}) != 1:
            raise ValueError(f"update group {self.fused}: members differ in their `*` wildcards: {self.members}")


@dataclasses.dataclass(frozen=True)
class Naming:
    """One engine naming of an architecture's weights: its update groups, and how to get its names."""

    groups: tuple[UpdateGroup, ...]
    rename: Callable[[str], str] | None = None  # exported HF name -> this naming's name; None: HF names as they are


def adapter_groups(groups: Iterable[UpdateGroup]) -> tuple[UpdateGroup, ...]:
    """The PEFT adapter tensors (lora_A, lora_B) of a group's weights travel together too."""
    adapters = []
    for group in groups:
        members = tuple(f"{PEFT_PREFIX}{pattern.removesuffix('.weight')}.lora_{half}.weight"
                        for pattern in group.members if pattern.endswith(".weight") for half in "AB")
        if members:
            adapters.append(UpdateGroup(group.fused, members))
    return tuple(adapters)


def peft_target_filter(peft_config: dict) -> Callable[[str], bool]:
    """Whether an adapter tensor's module is adapted under `peft_config["target_modules"]` (PEFT's rule)."""
    targets = peft_config["target_modules"]

    def targeted(adapter_name: str) -> bool:
        module = adapter_name.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0]
        if targets == "all-linear":  # every member of an update group is a linear layer
            return True
        if isinstance(targets, str):
            return re.fullmatch(targets, module) is not None
        return any(module == target or module.endswith("." + target) for target in targets)

    return targeted


class GroupIndex:
    """Which group, and which instance of it (the wildcard indices), claims a tensor name.

    `expects(name)` says whether a member must be in the stream: always for full weights; for
    adapters, only the members whose module the PEFT config adapts.
    """

    def __init__(self, groups: Iterable[UpdateGroup], expects: Callable[[str], bool] = lambda name: True):
        self.groups = tuple(dict.fromkeys(groups))
        owners: dict[str, str] = {}
        for group in self.groups:
            for pattern in group.members:
                if pattern in owners:
                    raise UpdateGroupError(f"{pattern} is a member of both update groups {owners[pattern]} and {group.fused}")
                owners[pattern] = group.fused
        self._regexes = [(compile_pattern(pattern), group) for group in self.groups for pattern in group.members]
        self.expects = expects

    def find(self, name: str) -> tuple[UpdateGroup, tuple[str, ...]] | None:
        matches = [(group, match.groups()) for regex, group in self._regexes if (match := regex.match(name))]
        if len(matches) > 1:
            raise UpdateGroupError(f"tensor {name} belongs to {len(matches)} update groups: "
                                   f"{[group.fused for group, _ in matches]}")
        return matches[0] if matches else None

    def expected_members(self, group: UpdateGroup, indices: tuple[str, ...]) -> list[str]:
        return [name for pattern in group.members if self.expects(name := fill_pattern(pattern, indices))]


def nbytes(tensors: Tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in tensors)


def _units(tensors: Iterable[tuple[str, torch.Tensor]], index: GroupIndex) -> Iterator[Tensors]:
    """Lone tensors as they come; a group, in declared member order, once its last member arrives."""
    open_groups: dict[tuple[UpdateGroup, tuple[str, ...]], dict[str, torch.Tensor]] = {}
    seen: set[str] = set()
    for name, tensor in tensors:
        if name in seen:
            raise UpdateGroupError(f"tensor {name} appears twice in one weight sync")
        seen.add(name)
        found = index.find(name)
        if found is None:
            yield [(name, tensor)]
            continue
        group, indices = found
        expected = index.expected_members(group, indices)
        if name not in expected:
            raise UpdateGroupError(f"tensor {name} of update group {group.fused} is not expected "
                                   f"(the group's expected members are {expected})")
        held = open_groups.setdefault((group, indices), {})
        held[name] = tensor
        if len(held) == len(expected):
            del open_groups[(group, indices)]
            # pop: once yielded, a group's tensors are held by the chunk alone
            yield [(member, held.pop(member)) for member in expected]
    if open_groups:
        (group, indices), held = next(iter(open_groups.items()))
        missing = [name for name in index.expected_members(group, indices) if name not in held]
        raise UpdateGroupError(f"update group {group.fused} ({', '.join(held)}) is incomplete: "
                               f"missing {', '.join(missing)}" +
                               (f"; {len(open_groups) - 1} more groups are incomplete" if len(open_groups) > 1 else ""))


def pack_chunks(tensors: Iterable[tuple[str, torch.Tensor]], index: GroupIndex,
                chunk_bytes: int) -> Iterator[tuple[Tensors, bool]]:
    """Yield `(chunk, is_last)`: whole groups and lone tensors, greedily, in stream order.

    A chunk holds at most `chunk_bytes`, except a single group or tensor larger than that, which
    travels alone. A chunk is yielded once the next unit is known not to fit, so while the consumer
    holds a chunk this generator holds one more unit (plus any group still being assembled); a
    missing group member raises before the chunk marked last.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes}")
    chunk: Tensors = []
    size = 0
    for unit in _units(tensors, index):
        unit_bytes = nbytes(unit)
        if chunk and size + unit_bytes > chunk_bytes:
            yield chunk, False
            chunk, size = [], 0
        chunk += unit
        size += unit_bytes
    yield chunk, True
