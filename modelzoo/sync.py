"""Weight sync to inference engines: the trainer's weights in size-bounded chunks, in engine naming.

    sync = modelzoo.sync.WeightSync(provider, chunk_bytes=1 << 30)   # one per trainer: owns the version
    for step in range(steps):
        ...                                                           # train
        for chunk in sync.chunks(model):                              # every TP rank iterates (gathers)
            if rank == 0:
                engine.load_weights(chunk.tensors)                    # chunk.version / .index / .is_last

Chunks never split an atomic update group (`conversion/sync.py`): the groups are data in
`modelzoo/<architecture>/sync.py` (`NAMINGS`: engine naming -> `Naming`), declared by its provider
(`sync_namings`).
See docs/weight_sync.md.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator

import torch

from modelzoo.conversion.sync import (GroupIndex, Naming, Tensors, adapter_groups, nbytes, pack_chunks,
                             peft_target_filter)
from modelzoo.provider import ModelProvider

LORA_MODES = ("none", "merged", "adapter")


@dataclasses.dataclass(frozen=True)
class WeightChunk:
    """One `load_weights` call's worth of full tensors."""

    tensors: Tensors
    version: int                     # the sync this chunk belongs to: 1, 2, 3, ...
    index: int                       # 0, 1, ... within the sync
    is_last: bool                    # the sync is complete once this chunk is loaded
    peft_config: dict | None = None  # lora="adapter" only: the adapter's PEFT config

    @property
    def nbytes(self) -> int:
        return nbytes(self.tensors)


class WeightSync:
    """Repeated weight syncs of one model; the version counts completed syncs.

    A sync's chunks carry version = completed syncs + 1; the count goes up once the consumer asks
    for more after the last chunk (a `for` loop that ends normally). An abandoned sync (an error in
    the engine call, a `break`) leaves the count where it was, so the retry carries the same version.
    """

    def __init__(self, provider: ModelProvider, chunk_bytes: int, naming: str | None = None, lora: str = "none"):
        if lora not in LORA_MODES:
            raise ValueError(f"lora={lora!r} is not one of {LORA_MODES}")
        if lora == "adapter" and naming is not None:
            raise ValueError(f"lora='adapter' sends PEFT tensors named after the engine's modules (the checkpoint's "
                             f"module names, `modelzoo.lora.save_adapter(naming='release')`): naming={naming!r} does "
                             f"not apply")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes}")
        self.provider = provider
        self.chunk_bytes = chunk_bytes
        # the adapter's groups are the fused modules of the weights' "hf" names, which the release names keep
        naming = naming or ("hf" if lora == "adapter" else provider.engine_naming)
        self.naming = engine_naming(provider, naming)
        self.lora = lora
        self.version = 0

    def chunks(self, model: torch.nn.Module) -> Iterator[WeightChunk]:
        """One sync: every weight once, in a deterministic order; collective across TP ranks."""
        version = self.version + 1
        tensors, index, peft_config = self._tensors_and_groups(model)
        # a plain counter, not enumerate(): enumerate's cached result tuple would keep the previous
        # chunk alive while the next one fills
        chunk_index = 0
        for chunk, is_last in pack_chunks(tensors, index, self.chunk_bytes):
            yield WeightChunk(chunk, version, chunk_index, is_last, peft_config)
            del chunk  # the engine has it; hold nothing of it while the next chunk fills
            chunk_index += 1
        self.version = version

    def _tensors_and_groups(self, model) -> tuple[Iterator[tuple[str, torch.Tensor]], GroupIndex, dict | None]:
        if self.lora == "none":
            if _has_lora_adapters(model):
                raise ValueError("this model has LoRA adapters: sync it with lora='merged' (W + (alpha/r) B A) "
                                 "or lora='adapter' (the adapter tensors)")
            return _renamed(self.provider.export_hf_weights(model), self.naming), GroupIndex(self.naming.groups), None
        from modelzoo import lora  # only the LoRA modes need it

        if self.lora == "merged":  # W + (alpha/r) B A, merged in fp32, through the same path as full weights
            merged = lora.export_merged_hf_weights(model, self.provider)
            return _renamed(merged, self.naming), GroupIndex(self.naming.groups), None
        # the update groups name the checkpoint's tensors, so the adapters keep those names ("release")
        config = lora.peft_config(model, self.provider, naming="release")
        index = GroupIndex(adapter_groups(self.naming.groups), expects=peft_target_filter(config))
        return lora.adapter_hf_weights(model, self.provider, naming="release"), index, config


def iter_weight_chunks(model: torch.nn.Module, provider: ModelProvider, chunk_bytes: int, naming: str | None = None,
                       lora: str = "none") -> Iterator[WeightChunk]:
    """One sync, version 1. A trainer that syncs every step keeps one `WeightSync` instead."""
    return WeightSync(provider, chunk_bytes, naming, lora).chunks(model)


def engine_naming(provider: ModelProvider, naming: str) -> Naming:
    """The architecture's `Naming` called `naming` (`provider.sync_namings()`)."""
    namings = provider.sync_namings()
    if naming not in namings:
        raise ValueError(f"{provider.name} has no {naming!r} naming (it has {sorted(namings)})")
    return namings[naming]


def _renamed(tensors: Iterator[tuple[str, torch.Tensor]], naming: Naming) -> Iterator[tuple[str, torch.Tensor]]:
    if naming.rename is None:
        return tensors
    return ((naming.rename(name), tensor) for name, tensor in tensors)


def _has_lora_adapters(model: torch.nn.Module) -> bool:
    lora = sys.modules.get("modelzoo.lora")  # no adapters unless modelzoo.lora was imported
    return lora is not None and any(True for _ in lora.lora_layers(model))
