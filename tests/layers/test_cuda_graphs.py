"""modelzoo.layers.cuda_graphs on CPU: what it refuses, and its gradient hand-over against a stand-in for the graphs.

The replay itself is tested on the GPU (tests/deepseek_v4/test_cuda_graphs_gpu.py). Here
`torch.cuda.make_graphed_callables` is replaced by `_graphed_on_cpu`, which keeps what LayerGraphs relies
on: the backward returns its static gradient buffers (detached, as torch's does), and the forward replay
overwrites them, as the real one may (its intermediates share the graphs' memory pool with them; on the
H200 a version of LayerGraphs that copied them only before the next backward lost accumulated gradients).
"""

import pytest
import torch
from torch import nn

from modelzoo.layers.cuda_graphs import LayerGraphs


def test_capture_of_cpu_tensors_is_refused_with_the_device_named():
    with pytest.raises(ValueError, match="CUDA graphs need CUDA tensors: the sample inputs are on cpu"):
        LayerGraphs([torch.nn.Linear(4, 4)], torch.zeros(2, 4))


class _ClaimsCuda(torch.Tensor):
    """A CPU sample tensor that passes LayerGraphs' CUDA check (the graphs are `_graphed_on_cpu`)."""

    @property
    def is_cuda(self):
        return True


def _graphed_on_cpu(module, sample_args, allow_unused_input=False):
    params = tuple(module.parameters())
    grad_buffers = [torch.zeros_like(param) for param in params]
    count = len(sample_args)

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for buffer in grad_buffers:
                buffer.fill_(float("nan"))  # the forward replay's intermediates reuse this memory
            with torch.enable_grad():
                hidden = inputs[0].detach().requires_grad_()
                ctx.hidden, ctx.output = hidden, module(hidden, *inputs[1:count])
            return ctx.output.detach()

        @staticmethod
        def backward(ctx, grad):
            grads = torch.autograd.grad(ctx.output, (ctx.hidden, *params), grad, allow_unused=allow_unused_input)
            for buffer, param_grad in zip(grad_buffers, grads[1:], strict=True):
                buffer.copy_(param_grad)
            return grads[0], *(None,) * (count - 1), *(buffer.detach() for buffer in grad_buffers)

    def call(*args):
        return Graphed.apply(*args, *params)
    call.grad_buffers = grad_buffers
    return call


class _ScaledLinear(nn.Linear):
    def forward(self, hidden, scale):
        return super().forward(hidden) * scale


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", _graphed_on_cpu)
    torch.manual_seed(0)
    layers = [_ScaledLinear(8, 8) for _ in range(3)]
    sample = torch.zeros(4, 8).as_subclass(_ClaimsCuda)
    return layers, LayerGraphs(layers, sample.requires_grad_(), torch.tensor(0.5))


def _backward(graphs: LayerGraphs, seed: int) -> None:
    hidden = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    graphs(hidden, torch.tensor(0.5)).square().sum().backward()


def test_a_grad_that_was_none_becomes_the_graph_buffer_without_a_copy(graphs):
    layers, graphed = graphs
    buffers = graphed.call.grad_buffers
    _backward(graphed, 0)
    params = [param for layer in layers for param in layer.parameters()]
    assert [param.grad.data_ptr() for param in params] == [buffer.data_ptr() for buffer in buffers]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    _backward(graphed, 1)
    assert [param.grad.data_ptr() for param in params] == [buffer.data_ptr() for buffer in buffers]


def test_gradients_accumulate_over_micro_batches_as_eagerly(graphs):
    layers, graphed = graphs
    eager = [_ScaledLinear(8, 8) for _ in layers]
    for mine, reference in zip(layers, eager, strict=True):
        reference.load_state_dict(mine.state_dict())
    for seed in (0, 1, 2):  # no zero_grad: each backward adds to the gradients before it
        _backward(graphed, seed)
        hidden = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        for layer in eager:
            hidden = layer(hidden, torch.tensor(0.5))
        hidden.square().sum().backward()
    for mine, reference in zip(layers, eager, strict=True):
        for param, expected in zip(mine.parameters(), reference.parameters(), strict=True):
            assert torch.equal(param.grad, expected.grad)  # the same products, summed in the same order
