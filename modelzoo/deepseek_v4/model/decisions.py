"""Recording and replaying the discrete decisions of a forward: routed experts and indexer picks.

A top-k is discontinuous: two numerically different runs of the same weights (exact vs fast
attention, bf16 vs fp32, an inference engine vs the trainer) pick different experts or compressed
entries wherever two candidates are closer than the runs' rounding difference, and one swapped
expert moves that token's output by a whole expert's share. Recording the choices of one run and
replaying them in the other separates numerical agreement from those flips; RL trainers call the
same thing routing replay (train on the experts the rollout used).

    with recording_decisions(model) as decisions:
        model(input_ids)                     # decisions: {module name: indices}
    with replaying_decisions(other_model, decisions):
        other_model(input_ids)               # every Router / Indexer returns the recorded indices

Only the indices are replayed: the router's weights are still gathered from the replaying model's
own scores, and gradients are unchanged. One decision per module per forward (activation
recompute re-runs a module and gets the same decision back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


class Decider(nn.Module):
    """A module whose output depends on a discrete choice of indices, routed through `decide`."""

    decision_hook: Callable[[torch.Tensor], torch.Tensor] | None = None

    def decide(self, indices: torch.Tensor) -> torch.Tensor:
        return indices if self.decision_hook is None else self.decision_hook(indices)


def _deciders(model: nn.Module) -> dict[str, Decider]:
    return {name: module for name, module in model.named_modules() if isinstance(module, Decider)}


def deciding(model: nn.Module) -> bool:
    """Whether a decision is being recorded or replayed in `model` (Python that must run every forward)."""
    return any(module.decision_hook is not None for module in _deciders(model).values())


@contextmanager
def _hooks(deciders: dict[str, Decider], make_hook: Callable[[str], Callable]) -> Iterator[None]:
    try:
        for name, module in deciders.items():
            module.decision_hook = make_hook(name)
        yield
    finally:
        for module in deciders.values():
            module.decision_hook = None


@contextmanager
def recording_decisions(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Yields a dict that fills, during forwards inside the block, with each decider's indices."""
    decisions: dict[str, torch.Tensor] = {}

    def make_hook(name):
        def record(indices):
            decisions[name] = indices.detach().clone()
            return indices
        return record

    with _hooks(_deciders(model), make_hook):
        yield decisions


@contextmanager
def replaying_decisions(model: nn.Module, decisions: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block every decider of `model` returns the indices recorded under its name."""
    def make_hook(name):
        def replay(indices):
            if name not in decisions:  # checked at the call: modules a forward skips (MTP) need no recording
                raise KeyError(f"no recorded decision for {name}: record a forward of the same model layout")
            recorded = decisions[name]
            if recorded.shape != indices.shape:
                raise ValueError(f"{name}: recorded decision has shape {tuple(recorded.shape)}, this forward "
                                 f"needs {tuple(indices.shape)} (same batch and sequence length as the recording)")
            return recorded.to(indices.device)
        return replay

    with _hooks(_deciders(model), make_hook):
        yield
