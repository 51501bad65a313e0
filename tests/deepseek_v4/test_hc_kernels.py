"""The hyper-connections' Triton kernels (`hc_kernels.py`) against the plain ops they replace.

One block: map, mixing, collapse, a block function of the collapsed input, residual; forward outputs
and every input's gradient. The plain composition (what the CPU parity tests check against
transformers) is the oracle. On CPU the kernels run in Triton's interpreter (a subprocess with
TRITON_INTERPRET=1, which must be set before triton is imported); on a GPU, compiled:
`pytest -m gpu tests/deepseek_v4/test_hc_kernels.py`.
"""

from unittest import mock

import pytest
import torch

from modelzoo.deepseek_v4.model import hyper_connection
from modelzoo.deepseek_v4.model.hyper_connection import HyperConnection, hc_residual

# fp32: the same fp32 formulas, summed in another order (the stream mix, the sums over hidden, the
# map's 24-term dot): 1e-5 of each tensor's largest magnitude. A dropped term or a wrong axis is > 1e-2.
FP32_TOLERANCE = 1e-5
# bf16 against the fp32 oracle (the same bf16 input values): the kernels round each output once, the
# plain bf16 ops round every intermediate, so the kernels' error must not exceed the plain ops'
# by more than one bf16 rounding of the tensor's largest value (2^-8 relative).
BF16_ROUNDING = 2.0 ** -8

# (batch, seq, hidden): token counts and widths that do not fill the kernels' tiles; 600 hidden: two column chunks
SHAPES = [(2, 37, 600), (1, 64, 64)]


def _block(streams, hc: HyperConnection, upstream):
    post, comb, collapsed, carried = hc(streams)
    block_output = torch.tanh(collapsed.float()).to(streams.dtype)
    new_streams = hc_residual(post, comb, block_output, carried)
    return (new_streams.float() * upstream).sum() + collapsed.float().square().sum(), [post, comb, collapsed, new_streams]


def run_block(device: str, dtype: torch.dtype, kernels: bool, shape, values: torch.dtype = torch.float32,
              seed: int = 0) -> list[torch.Tensor]:
    """Forward outputs and the gradients of streams, fn, base, scale, all as fp32. The streams' values
    are rounded to `values` first (the oracle of a bf16 run computes in fp32 on bf16 values)."""
    batch, seq, hidden = shape
    generator = torch.Generator().manual_seed(seed)
    hc = HyperConnection(hidden, 4, 20, 1e-6, 1e-6)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=generator) * 0.05)
        hc.base.copy_(torch.randn(hc.base.shape, generator=generator) * 0.1)
        hc.scale.copy_(torch.rand(3, generator=generator) + 0.5)
    streams = torch.randn(batch, seq, 4, hidden, generator=generator)
    upstream = torch.randn(batch, seq, 4, hidden, generator=generator).to(device)
    hc = hc.to(device)
    streams = streams.to(values).to(device, dtype).requires_grad_()
    from modelzoo.deepseek_v4.model import hc_kernels
    with mock.patch.object(hyper_connection, "_kernels", lambda _: hc_kernels if kernels else None):
        loss, outputs = _block(streams, hc, upstream)
    loss.backward()
    return [t.detach().float().cpu() for t in (*outputs, streams.grad, hc.fn.grad, hc.base.grad, hc.scale.grad)]


NAMES = ["post", "comb", "collapsed", "new streams", "grad streams", "grad fn", "grad base", "grad scale"]


def relative_errors(results, reference):
    return {name: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            for name, a, b in zip(NAMES, results, reference, strict=True)}


def check(device: str, bf16: bool) -> None:
    for shape in SHAPES:
        plain = run_block(device, torch.float32, False, shape)
        errors = relative_errors(run_block(device, torch.float32, True, shape), plain)
        assert max(errors.values()) <= FP32_TOLERANCE, (shape, errors)
        if not bf16:
            continue
        # bf16: the oracle is the fp32 plain ops on the same bf16-rounded inputs
        oracle = run_block(device, torch.float32, False, shape, values=torch.bfloat16)
        kernel_errors = relative_errors(run_block(device, torch.bfloat16, True, shape), oracle)
        plain_errors = relative_errors(run_block(device, torch.bfloat16, False, shape), oracle)
        for name in NAMES:
            assert kernel_errors[name] <= plain_errors[name] + BF16_ROUNDING, (shape, name, kernel_errors, plain_errors)


def test_kernels_match_the_plain_ops_in_triton_interpreter(run_in_triton_interpreter):
    """CPU tensors through Triton's interpreter: the kernels' indexing and maths, without a GPU. fp32 only:
    the interpreter truncates fp32 to bf16 (502 of 1000 random values differ from round-to-nearest, triton
    3.8), so bf16 is checked on the GPU."""
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_kernels_match_the_plain_ops_on_the_gpu():
    check("cuda", bf16=True)


if __name__ == "__main__":
    check("cpu", bf16=False)
