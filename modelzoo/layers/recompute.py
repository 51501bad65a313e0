"""Activation recompute as Megatron's TransformerConfig names it, for models built from our own layers.

    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=N   groups of N layers
    recompute_granularity="full", recompute_method="block",   recompute_num_layers=N   the first N layers
    recompute_granularity="selective", recompute_modules=[...]                         pieces inside a layer

Only a region's inputs are kept; its activations are recomputed in the backward. The checkpoints are
non-reentrant (torch.utils.checkpoint), so regions may take and return tensors that other regions also use
(LoopCoder's loop-1 K/V, DeepSeek-V4's residual streams) and parameters without gradients (frozen indexers).

A value a region computes without gradients and that costs time (DeepSeek-V4's indexer picks: projections, a
score over every compressed entry, a top-k) can be `kept_for_recompute`: the region's first run keeps it, and its
recompute gets it back instead of computing it again. The recompute then sees the forward's value by construction.
A value of a named kind (`ATTENTION_OUTPUT`: an attention kernel's output and log-sum-exp, what its backward reads
besides the inputs) is kept only by regions that keep that kind (`recomputed(..., keeps=...)`): it trades memory
for the recompute's time, which a setting chooses.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.checkpoint import checkpoint

T = TypeVar("T")

# kinds of value a region may keep (`recomputed(..., keeps=...)`); values without a kind are always kept
ATTENTION_OUTPUT = "attention_output"


class _Regions(threading.local):
    """The stack of checkpointed regions running in this thread (a backward runs in its own thread)."""

    def __init__(self):
        self.stack: list[_Phase] = []


class _Phase:
    """The context one checkpointed region's first run (replaying False) or its recompute (True) executes in. Both
    phases share `kept`, the values of the first run in call order; the checkpoint holds the recompute's context, so
    they live as long as the region's autograd graph and no longer. `keeps`: the kinds of value the region keeps."""

    regions = _Regions()

    def __init__(self, kept: list, replaying: bool, keeps: frozenset[str]):
        self.kept, self.replaying, self.keeps, self.cursor = kept, replaying, keeps, 0

    def __enter__(self):
        self.cursor = 0   # a second backward (retain_graph) replays from the first value again
        self.regions.stack.append(self)

    def __exit__(self, *exc):
        self.regions.stack.pop()


def _phases(keeps: frozenset[str]) -> tuple[_Phase, _Phase]:
    kept: list = []
    return _Phase(kept, replaying=False, keeps=keeps), _Phase(kept, replaying=True, keeps=keeps)


def kept_for_recompute(compute: Callable[[], T], kind: str | None = None) -> T:
    """`compute()`; inside a recomputed region's recompute, the value its first run computed at this call (calls
    in the same order). Only for values without gradients: the recompute must not need to differentiate them.
    A value of a `kind` is kept only where the innermost region keeps that kind; elsewhere it is computed."""
    if not _Phase.regions.stack:
        return compute()
    phase = _Phase.regions.stack[-1]
    if kind is not None and kind not in phase.keeps:
        return compute()
    if not phase.replaying:
        phase.kept.append(compute())
        return _aliases(phase.kept[-1])
    if phase.cursor >= len(phase.kept):
        raise RuntimeError("a recompute asked for more kept values than its first run kept: the region's "
                           "calls to kept_for_recompute must not depend on anything but its inputs")
    phase.cursor += 1
    return _aliases(phase.kept[phase.cursor - 1])


def _aliases(value):
    """A kept tensor (or tuple of them) as new tensor objects on the same memory: a caller that gives the object
    autograd history (an autograd Function returning it as its output) must not give it to the kept one, whose
    history would then hold the region's graph alive through the kept list."""
    if isinstance(value, tuple):
        return tuple(_aliases(item) for item in value)
    return value.detach() if isinstance(value, torch.Tensor) else value


def recomputed(fn: Callable, enabled: bool, keeps: frozenset[str] = frozenset()) -> Callable:
    """`fn`, or `fn` under an activation checkpoint when `enabled` and gradients are being recorded; `keeps`: the
    kinds of value (e.g. `ATTENTION_OUTPUT`) its first run keeps for its recompute."""
    if not enabled:
        return fn

    def run(*args):
        if torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False, context_fn=functools.partial(_phases, keeps))
        return fn(*args)

    return run


def selective_modules(config, model_name: str, supported: dict[str, str]) -> frozenset[str]:
    """The `recompute_modules` this model recomputes (empty unless granularity is selective). `supported` maps
    each name the model honours to what it recomputes; any other name Megatron accepts is refused by name."""
    if config.recompute_granularity != "selective":
        return frozenset()
    modules = frozenset(config.recompute_modules)
    unsupported = sorted(modules - supported.keys())
    if unsupported:
        choices = "; ".join(f"{name!r} ({what})" for name, what in supported.items())
        raise ValueError(f"{model_name}: recompute_modules {unsupported[0]!r} names no piece of this model; "
                         f"it recomputes {choices}")
    return modules


def full_recompute_groups(config, num_layers: int) -> list[tuple[range, bool]]:
    """The layers in runs, each with whether it runs under one checkpoint, as Megatron's full recompute splits
    them: `uniform` checkpoints every run of `recompute_num_layers` layers, `block` the first
    `recompute_num_layers` layers one by one and runs the rest as they are."""
    if config.recompute_granularity != "full" or num_layers == 0:
        return [(range(num_layers), False)]
    size = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(range(start, min(start + size, num_layers)), True) for start in range(0, num_layers, size)]
    recomputed_layers = min(size, num_layers)
    groups = [(range(index, index + 1), True) for index in range(recomputed_layers)]
    return groups + ([(range(recomputed_layers, num_layers), False)] if recomputed_layers < num_layers else [])
