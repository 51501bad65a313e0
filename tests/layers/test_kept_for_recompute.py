"""modelzoo.layers.recompute.kept_for_recompute: a region's recompute gets back what its first run kept.

The oracle is the same function run without a checkpoint: gradients must be equal bit for bit, while the kept
computation runs once per forward (not again in the backward) and nothing is kept outside a region.
"""

import pytest
import torch

from modelzoo.layers.recompute import kept_for_recompute, recomputed


def _region(calls: list):
    def pick(x):
        calls.append(1)
        return x.detach().abs().argmax(dim=-1, keepdim=True)   # integers, no gradient: an indexer's picks

    def fn(x, w):
        index = kept_for_recompute(lambda: pick(x))
        return (torch.tanh(x @ w).gather(-1, index) * x.sum(-1, keepdim=True)).sum()
    return fn


def _grads(enabled: bool, backwards: int = 1):
    torch.manual_seed(0)
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    calls = []
    loss = recomputed(_region(calls), enabled)(x, w)
    for number in range(backwards):
        loss.backward(retain_graph=number + 1 < backwards)
    return x.grad, w.grad, len(calls)


def test_the_recompute_gets_the_kept_value_and_the_same_gradients():
    x_grad, w_grad, calls = _grads(enabled=False)
    assert calls == 1
    kept_x_grad, kept_w_grad, kept_calls = _grads(enabled=True)
    assert kept_calls == 1                    # not computed again in the backward's recompute
    assert torch.equal(kept_x_grad, x_grad) and torch.equal(kept_w_grad, w_grad)


def test_a_second_backward_replays_from_the_first_kept_value():
    x_grad, w_grad, _ = _grads(enabled=False, backwards=2)
    kept_x_grad, kept_w_grad, kept_calls = _grads(enabled=True, backwards=2)
    assert kept_calls == 1
    assert torch.equal(kept_x_grad, x_grad) and torch.equal(kept_w_grad, w_grad)


def test_outside_a_recomputed_region_it_computes_every_time():
    calls = []
    for _ in range(2):
        kept_for_recompute(lambda: calls.append(1))
    with torch.no_grad():                      # a region that records no gradients runs without a checkpoint
        recomputed(_region(calls), True)(torch.randn(2, 6), torch.randn(6, 6))
    assert len(calls) == 3


def test_a_recompute_that_asks_for_more_than_was_kept_is_refused():
    runs = []

    def fn(x):
        runs.append(1)
        for _ in range(len(runs)):             # the recompute (second run) asks twice, the first run once
            kept_for_recompute(lambda: x.detach().argmax())
        return (x * x).sum()

    loss = recomputed(fn, True)(torch.randn(3, requires_grad=True))
    with pytest.raises(RuntimeError, match="a recompute asked for more kept values than its first run kept"):
        loss.backward()


def test_a_value_of_a_kind_is_kept_only_where_the_region_keeps_that_kind():
    def runs_of(keeps):
        calls = []

        def fn(x):
            scale = kept_for_recompute(lambda: calls.append(1) or x.detach().abs().max(), kind="scale")
            return (torch.sin(x) / scale).sum()

        recomputed(fn, True, keeps)(torch.randn(5, requires_grad=True)).backward()
        return len(calls)

    assert runs_of(frozenset()) == 2          # computed again by the recompute
    assert runs_of(frozenset({"scale"})) == 1


def test_kept_tensors_are_handed_out_as_new_objects_on_the_same_memory():
    """An autograd Function that returns a kept tensor as its output gives that object its history: the kept one
    must stay without it (else it would hold the region's graph through the kept list)."""
    made, handed = [], []

    def fn(x):
        out, lse = kept_for_recompute(lambda: made.append((x.detach() * 2, x.detach().sum())) or made[-1])
        handed.append((out, lse))
        return (x * out).sum() + lse

    recomputed(fn, True)(torch.randn(4, requires_grad=True)).backward()
    assert len(made) == 1 and len(handed) == 2      # computed once; handed to the first run and the recompute
    for out, lse in handed:
        assert out is not made[0][0] and lse is not made[0][1]
        assert out.data_ptr() == made[0][0].data_ptr() and lse.data_ptr() == made[0][1].data_ptr()
