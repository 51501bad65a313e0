"""`@fused` functions on a GPU: the compiled kernels against the same functions run eagerly (fp32).

Run on the accelerator: `pytest -m gpu tests/deepseek_v4/test_fused_gpu.py`. On CPU `@fused` runs the
eager function itself, which every CPU parity test exercises.
"""

import pytest
import torch

from modelzoo.deepseek_v4.model.attention import normed_rotary_queries
from modelzoo.deepseek_v4.model.hyper_connection import mixing_weights

pytestmark = pytest.mark.gpu

# FUSED_TOLERANCE = 1e-5 of each tensor's largest magnitude (absolute below magnitude 1): the same fp32
# formulas; fusion only reorders
# the reductions (the RMS statistic's). A dropped term or a wrong axis moves them by > 1e-2.
FUSED_TOLERANCE = 1e-5


def _inputs(seed: int, batch: int = 2, seq: int = 256):
    generator = torch.Generator().manual_seed(seed)
    mixes = torch.randn(batch, seq, 24, generator=generator)
    base, scale = torch.randn(24, generator=generator) * 0.1, torch.rand(3, generator=generator) + 0.5
    return [t.cuda().requires_grad_() for t in (mixes, base, scale)]


def _forward_and_grads(mixing, inputs):
    pre, post, comb_logits = mixing(*inputs, 4, 1e-6)
    loss = pre.square().mean() + post.square().mean() + (comb_logits * torch.arange(16, device="cuda").view(4, 4)).mean()
    grads = torch.autograd.grad(loss, inputs)
    return [t.detach() for t in (pre, post, comb_logits, *grads)]


def _assert_close(fused: list[torch.Tensor], eager: list[torch.Tensor]):
    for compiled, reference in zip(fused, eager, strict=True):
        scale = max(reference.abs().max().item(), 1.0)
        assert (compiled - reference).abs().max().item() / scale <= FUSED_TOLERANCE


# A model calls each function with several shapes (its layers, another model's hidden size): every
# shape after the first is where torch's default would have compiled a kernel for symbolic sizes, whose
# backward gave wrong gradients on the H200 (modelzoo/layers/fused.py).
SHAPES = [(2, 256, 512), (2, 64, 64), (1, 128, 96)]


def test_compiled_hyper_connection_weights_match_eager_forward_and_backward():
    """The sigmoids and comb's logits from the map's outputs (the passes over the streams and the
    Sinkhorn iterations are Triton kernels, tests/deepseek_v4/test_hc_kernels.py)."""
    for batch, seq, _ in SHAPES:
        _assert_close(_forward_and_grads(mixing_weights, _inputs(0, batch, seq)),
                      _forward_and_grads(mixing_weights.eager, _inputs(0, batch, seq)))


def test_compiled_normed_rotary_queries_match_eager_forward_and_backward():
    """The queries' RMS norm and RoPE as one compiled kernel against the eager ops (fp32)."""
    for batch, seq, head_dim in SHAPES:
        generator = torch.Generator().manual_seed(1)
        q = torch.randn(batch, seq, 4, head_dim, generator=generator)
        angles = torch.rand(batch, seq, 8, generator=generator) * 6.28
        upstream = torch.randn(batch, seq, 4, head_dim, generator=generator).cuda()
        results = []
        for run in (normed_rotary_queries, normed_rotary_queries.eager):
            leaf = q.cuda().requires_grad_()
            out = run(leaf, angles.cos().cuda(), angles.sin().cuda(), 1e-6)
            out.backward(upstream)
            results.append([out.detach(), leaf.grad])
        _assert_close(*results)
