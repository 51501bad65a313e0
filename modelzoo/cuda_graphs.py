"""CUDA graphs of a layer stack's forward and backward, captured for one input shape.

A launch-bound model (DeepSeek-V4: hyper-connection mixers, compressors, indexer, router, hundreds
of small kernels per layer) keeps the GPU waiting while the host launches kernels one by one.
`LayerGraphs` records each layer's forward and backward kernels once
(`torch.cuda.make_graphed_callables`) and replays each with a single launch.

What a graph needs, and how it is kept here:
- One input shape: the graphs are captured for the sample inputs; `matches(...)` says whether
  inputs can use them (same shapes, dtypes, device, training mode). Other inputs run eagerly.
- No host synchronisation and no Python-side decision inside a layer: Python runs once, at
  capture, and the replay repeats its kernels. The caller checks for hooks that must run each time.
- One forward in flight: the graphs keep one forward's activations in one memory pool, which the
  next replay overwrites. A graphed forward while the previous one still awaits its backward
  raises instead of corrupting that backward.
- Accumulating gradients: the graphed backward hands out its static gradient buffers, which a
  parameter whose `.grad` is None would adopt as its `.grad`, and the next backward's replay would
  then overwrite before adding to it. A hook on each parameter hands over a copy in that case.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn


class _LayerCall(nn.Module):
    """One layer as make_graphed_callables' module (it replaces this wrapper's forward, not the layer's)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.layer(*inputs)


class _InFlight:
    """Alive while a graphed forward's autograd graph is; `done` once its backward has run."""

    done = False


class _MarkBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, in_flight: _InFlight) -> torch.Tensor:
        ctx.in_flight = in_flight
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.in_flight.done = True
        return grad, None


def _copy_if_adopted(param: nn.Parameter):
    param_ref = weakref.ref(param)

    def hook(grad: torch.Tensor | None) -> torch.Tensor | None:
        # `.grad` None: autograd would keep `grad` itself, a graph's static buffer (None: a parameter
        # the layer did not differentiate, the indexer's)
        return grad.clone() if grad is not None and param_ref().grad is None else grad
    return hook


class LayerGraphs:
    """Graphed forward and backward of `layers`, each called as `hidden = layer(hidden, *extras)`.

    `sample_hidden` and `sample_extras` give the shapes; every layer gets its own static copies (a
    layer's saved activations may be its input itself). Capture runs each layer forward and backward
    three times first (torch.compile'd code compiles there) on a side stream.
    """

    def __init__(self, layers: Sequence[nn.Module], sample_hidden: torch.Tensor, *sample_extras: torch.Tensor):
        if not sample_hidden.is_cuda:
            raise ValueError("CUDA graphs need CUDA tensors: the sample inputs are on "
                             f"{sample_hidden.device}")
        self.signature = self._signature(sample_hidden, *sample_extras)
        self.training = layers[0].training
        self.layers = list(layers)
        calls = tuple(_LayerCall(layer) for layer in layers)
        sample_args = tuple(
            (sample_hidden.detach().clone().requires_grad_(sample_hidden.requires_grad),
             *(extra.detach().clone() for extra in sample_extras))
            for _ in calls)
        # the indexer's weights get no gradient (it picks indices under no_grad): unused inputs allowed
        self.calls = torch.cuda.make_graphed_callables(calls, sample_args, allow_unused_input=True)
        self.hooks = [param.register_hook(_copy_if_adopted(param))
                      for call in calls for param in call.parameters() if param.requires_grad]
        self.in_flight: weakref.ref[_InFlight] | None = None

    @staticmethod
    def _signature(*tensors: torch.Tensor) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)

    def matches(self, hidden: torch.Tensor, *extras: torch.Tensor) -> bool:
        return (self._signature(hidden, *extras) == self.signature
                and all(layer.training == self.training for layer in self.layers))

    def __call__(self, hidden: torch.Tensor, *extras: torch.Tensor) -> torch.Tensor:
        previous = self.in_flight() if self.in_flight is not None else None
        if previous is not None and not previous.done:
            raise RuntimeError("CUDA graphs: a forward ran before the previous graphed forward's backward. The "
                               "graphs hold one forward's activations at a time: run the backward first, or free "
                               "the previous forward's outputs")
        for index, call in enumerate(self.calls):
            hidden = call(hidden, *extras)
            if index == 0 and hidden.requires_grad:
                # the first layer's output is the last one the backward reaches before that layer's own graph
                in_flight = _InFlight()
                hidden = _MarkBackward.apply(hidden, in_flight)
                self.in_flight = weakref.ref(in_flight)
        return hidden

    def release(self) -> None:
        """Remove the parameter hooks (the graphs' memory goes with this object)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
