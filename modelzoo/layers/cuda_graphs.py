"""CUDA graphs of a layer stack's forward and backward, captured for one input shape.

A launch-bound model (DeepSeek-V4: hyper-connection mixers, compressors, indexer, router, hundreds
of small kernels per layer) keeps the GPU waiting while the host launches kernels one by one.
`LayerGraphs` records the whole stack's forward kernels as one graph and its backward kernels as
another (`torch.cuda.make_graphed_callables`), and replays each with a single launch: one copy of
the stack's input and of its output gradient into the graphs' buffers per step, not one per layer.

What a graph needs, and how it is kept here:
- One input shape: the graphs are captured for the sample inputs; `matches(...)` says whether
  inputs can use them (same shapes, dtypes, device, training mode). Other inputs run eagerly.
- No host synchronisation and no Python-side decision inside a layer: Python runs once, at
  capture, and the replay repeats its kernels. The caller checks for hooks that must run each time.
- One forward in flight: the graphs keep one forward's activations in one memory pool, which the
  next replay overwrites. A graphed forward while the previous one still awaits its backward
  raises instead of corrupting that backward.
- Parameter gradients: the graphed backward writes them into its static buffers. A parameter whose
  `.grad` is None adopts its buffer as `.grad`, with no copy, so zero_grad(set_to_none=True) before
  each step costs nothing (autograd still copies a buffer whose strides differ from the parameter's).
  The next replay overwrites the buffers: the backward with new gradients, and already the forward,
  whose intermediates share the graphs' memory pool with them. So before each forward replay, a
  `.grad` that is still one of them is replaced by a copy, and gradients accumulate over
  micro-batches as in eager mode. An old `.grad` kept elsewhere (not as the parameter's `.grad`) is
  overwritten.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn


class _StackCall(nn.Module):
    """The layers called in turn, as make_graphed_callables' module: `hidden = layer(hidden, *extras)`."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, hidden: torch.Tensor, *extras: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, *extras)
        return hidden


class _InFlight:
    """Alive while a graphed forward's autograd graph is; `done` once its backward has started."""

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


class LayerGraphs:
    """Graphed forward and backward of `layers`, each called as `hidden = layer(hidden, *extras)`.

    `sample_hidden` and `sample_extras` give the shapes. Capture runs the stack forward and backward
    three times first (torch.compile'd code compiles there) on a side stream.
    """

    def __init__(self, layers: Sequence[nn.Module], sample_hidden: torch.Tensor, *sample_extras: torch.Tensor):
        if not sample_hidden.is_cuda:
            raise ValueError("CUDA graphs need CUDA tensors: the sample inputs are on "
                             f"{sample_hidden.device}")
        self.signature = self._signature(sample_hidden, *sample_extras)
        self.training = layers[0].training
        self.layers = list(layers)
        stack = _StackCall(layers)
        sample_args = (sample_hidden.detach().clone().requires_grad_(sample_hidden.requires_grad),
                       *(extra.detach().clone() for extra in sample_extras))
        # the indexer's weights get no gradient (it picks indices under no_grad): unused inputs allowed
        self.call = torch.cuda.make_graphed_callables(stack, sample_args, allow_unused_input=True)
        self.params = [param for param in stack.parameters() if param.requires_grad]
        # data_ptr of the buffer each parameter adopted as its .grad in the last backward
        self.adopted: dict[int, int] = {}
        self.hooks = [param.register_hook(self._hand_over(index, param)) for index, param in enumerate(self.params)]
        self.in_flight: weakref.ref[_InFlight] | None = None

    def _hand_over(self, index: int, param: nn.Parameter):
        # no reference to self: a hook left on the parameter must not keep the graphs' memory alive
        param_ref, adopted = weakref.ref(param), self.adopted

        def hook(grad: torch.Tensor | None) -> torch.Tensor | None:
            # None: a parameter the layers did not differentiate (the indexer's)
            if grad is not None and param_ref().grad is None:
                adopted[index] = grad.data_ptr()
            return grad
        return hook

    def _copy_adopted_grads(self) -> None:
        """Before a replay: a .grad that is still a graph buffer becomes a copy (the replay overwrites it)."""
        for index, pointer in self.adopted.items():
            grad = self.params[index].grad
            if grad is not None and grad.data_ptr() == pointer:
                self.params[index].grad = grad.clone()
        self.adopted.clear()

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
        self._copy_adopted_grads()
        hidden = self.call(hidden, *extras)
        if hidden.requires_grad:
            in_flight = _InFlight()
            hidden = _MarkBackward.apply(hidden, in_flight)
            self.in_flight = weakref.ref(in_flight)
        return hidden

    def release(self) -> None:
        """Remove the parameter hooks (the graphs' memory goes with this object)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
