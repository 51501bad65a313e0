"""`linear_fp32` on a GPU with bf16 inputs (one bf16 GEMM over the weight's bf16 parts) against float64.

Run on the accelerator: `pytest -m gpu tests/deepseek_v4/test_split_linear_gpu.py`. On CPU (and for fp32
inputs) `linear_fp32` is `F.linear(x.float(), weight.float())`, which the CPU parity tests run.
"""

import pytest
import torch
import torch.nn.functional as F

from modelzoo.deepseek_v4.model.layers import linear_fp32

pytestmark = pytest.mark.gpu

# Relative to each tensor's largest value. fp32 results (the output; an fp32 weight's gradient): with an
# fp32 weight (and the output gradient) carried to 2^-18 by hi + lo, 1e-5 holds them to fp32-GEMM quality,
# where the weight rounded to bf16 alone misses by ~2^-9 = 2e-3 (checked below, so the bound can fail).
# bf16 results (x's gradient; a bf16 weight's gradient): one rounding, 2^-8 of the largest value.
FP32_RESULT, BF16_RESULT = 1e-5, 2**-8


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["fp32-weight", "bf16-weight"])
def test_bf16_parts_linear_matches_float64_forward_and_backward(weight_dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 512, 4 * 2048, generator=generator).to(torch.bfloat16).cuda().requires_grad_()
    weight = (torch.randn(24, 4 * 2048, generator=generator) * 0.02).to(weight_dtype).cuda().requires_grad_()
    upstream = torch.randn(2, 512, 24, generator=generator).cuda()
    out = linear_fp32(x, weight)
    out.backward(upstream)

    x64, weight64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    reference = F.linear(x64, weight64)
    reference.backward(upstream.double())

    assert out.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and weight.grad.dtype == weight_dtype
    assert _relative(out, reference) <= FP32_RESULT
    assert _relative(x.grad, x64.grad) <= BF16_RESULT
    assert _relative(weight.grad, weight64.grad) <= (FP32_RESULT if weight_dtype == torch.float32 else BF16_RESULT)
    if weight_dtype == torch.float32:  # the bound sees the lo part: the weight rounded to bf16 misses it
        assert _relative(F.linear(x.detach().float(), weight.detach().to(torch.bfloat16).float()), reference) > FP32_RESULT
