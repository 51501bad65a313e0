"""The hyper-connection's own backward (`_HyperMix`: map, mixer and the previous residual as one autograd
node) against autograd through the plain composition of the same functions.

The model runs `HyperConnection.forward` (a layer's first mix) and `after_residual` (the previous block's
residual, then the mix); their backward sums the streams' gradient terms itself and writes the map's input
gradient as a sum over its rows. The oracle differentiates `linear_fp32`, `hc_mix` and `hc_residual`
with autograd. Both compute in fp32 (like transformers, these functions upcast to fp32 whatever the
input dtype); the forward is bit-identical, the gradients agree to TOLERANCE = 1e-5 of each gradient's
largest entry: fp32 rounding of differently ordered sums (a wrong term or axis is off by O(1)).
"""

import torch

from modelzoo.deepseek_v4.model.hyper_connection import HyperConnection, hc_mix, hc_residual
from modelzoo.deepseek_v4.model.layers import linear_fp32

TOLERANCE = 1e-5
HC, HIDDEN, ITERS, HC_EPS, NORM_EPS = 4, 32, 20, 1e-6, 1e-6


def _inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float32) * std).requires_grad_()
    streams = randn(2, 8, HC, HIDDEN)
    previous = (torch.rand(2, 8, HC, generator=generator, dtype=torch.float32).requires_grad_(),
                torch.rand(2, 8, HC, HC, generator=generator, dtype=torch.float32).requires_grad_(),
                randn(2, 8, HIDDEN))
    return streams, previous


def _module(seed: int) -> HyperConnection:
    torch.manual_seed(seed)
    module = HyperConnection(HIDDEN, HC, ITERS, HC_EPS, NORM_EPS, init_std=0.3)
    with torch.no_grad():
        module.base.normal_(0, 0.5)
        module.scale.uniform_(0.5, 1.5)
    return module


def _reference(module, streams, previous):
    if previous is not None:
        streams = hc_residual.eager(*previous, streams)
    projected = linear_fp32(streams.flatten(2), module.fn)
    return (*hc_mix.eager(streams, projected, module.base, module.scale, *module.settings()), streams)


def _loss(post, comb, collapsed, streams, seed):
    generator = torch.Generator().manual_seed(seed)
    return sum((t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum()
               for t in (post, comb, collapsed, streams))


def _grads(outputs, leaves, seed):
    return torch.autograd.grad(_loss(*outputs, seed), leaves)


def _assert_close(ours, reference):
    for index, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        scale = theirs.abs().max().item()
        assert scale > 0, f"gradient {index} is zero: the test would not see a wrong one"
        assert (mine - theirs).abs().max().item() <= TOLERANCE * scale, f"gradient {index}"


def test_first_mix_gradients_match_autograd_of_the_composition():
    module, (streams, _) = _module(0), _inputs(0)
    leaves = (streams, module.fn, module.base, module.scale)
    post, comb, collapsed = module(streams)
    reference = _reference(module, streams, None)
    for mine, theirs in zip((post, comb, collapsed), reference):
        assert torch.equal(mine, theirs)
    ours = _grads((post, comb, collapsed, streams * 0), leaves, 1)
    _assert_close(ours, _grads((*reference[:3], streams * 0), leaves, 1))


def test_residual_then_mix_gradients_match_autograd_of_the_composition():
    module, (streams, previous) = _module(1), _inputs(1)
    leaves = (streams, *previous, module.fn, module.base, module.scale)
    new_streams, post, comb, collapsed = module.after_residual(*previous, streams)
    reference = _reference(module, streams, previous)
    for mine, theirs in zip((post, comb, collapsed, new_streams), reference):
        assert torch.equal(mine, theirs)
    # the new streams' own gradient (from the next residual) is one of the summed terms
    _assert_close(_grads((post, comb, collapsed, new_streams), leaves, 2), _grads(reference, leaves, 2))
