"""Small building blocks shared by the DeepSeek-V4 modules: norms, RoPE, replicated linears, sharded params.

Every formula follows transformers' `modeling_deepseek_v4.py` op for op (same order, same dtype
casts), because the fp32 parity tests compare against it at 1e-5.

Parameters that transformers keeps in fp32 whatever the model dtype (`_keep_in_fp32_modules_strict`:
norm weights, hyper-connection mappings, attention sinks, compressor position biases, the router's
correction bias) are made fp32 here too (`fp32_param`), but `provide()` casts them to the model's dtype
like every parameter (as Megatron-LM's Float16Module does): in a bf16 model they are bf16, where
transformers keeps them fp32. The RoPE frequencies stay fp32 (`keep_fp32`): rounded to bf16, a frequency
is off by up to 2^-9 of itself, its angle at position 4096 by radians.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modelzoo.layers import sequence_parallel
from modelzoo.layers.fused import fused
from modelzoo.provider import keep_fp32


def fp32_param(*shape: int, fill: float | None = None) -> nn.Parameter:
    tensor = torch.empty(*shape, dtype=torch.float32)
    if fill is not None:
        tensor.fill_(fill)
    return nn.Parameter(tensor)


def mark_tensor_parallel(param: nn.Parameter, dim: int) -> nn.Parameter:
    """Tag `param` as this rank's shard along `dim` of the tensor-parallel group (Megatron's attributes)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
    return param


def init_sharded(param: torch.Tensor, init_method, tracker: str | None = None) -> None:
    """Initialise a sharded tensor under Megatron's per-rank RNG stream (different values per shard).

    The parameters are built on the CPU, but Megatron's tracker forks the *CUDA* generator when there
    is one (the CPU generator only under modelzoo's CPU runtime): the values are drawn on that device,
    or every rank would draw the same shard from the shared CPU generator.
    """
    from megatron.core import tensor_parallel

    from modelzoo import runtime

    with torch.no_grad():
        if tracker is None:
            init_method(param)
        elif not param.is_meta:
            with tensor_parallel.get_cuda_rng_tracker().fork(tracker):
                values = torch.empty_like(param, device=runtime.device())
                init_method(values)
            param.copy_(values)


class RMSNorm(nn.Module):
    """transformers' DeepseekV4RMSNorm: fp32 statistics, fp32 weight, one cast back at the end."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = fp32_param(size, fill=1.0)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    return (weight * (x * inverse_rms(x, eps))).to(dtype)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a @ b accumulated and returned in fp32; on CUDA bf16 inputs stay bf16 (no fp32 copies, tensor cores).

    The products of bf16 values are exact in fp32, so this is the fp32 matmul of the same values up to
    the order of the fp32 sums.
    """
    if a.is_cuda and a.dtype != torch.float32:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x.float(), weight.float())`: accumulated and returned in fp32.

    On CUDA with a bf16 `x` it makes no fp32 copy of x, which F.linear would need, and runs on tensor
    cores: an fp32 weight is split into two bf16 parts, hi + lo (`_bf16_parts`), and one bf16 GEMM with
    fp32 output multiplies x by all parts (products of bf16 values are exact in fp32); the gradients are
    made the same way. An fp32 weight is then carried to 2^-18 of its value instead of fp32's 2^-24. For
    DeepSeek-V4's hyper-connection maps ([tokens, 4 x hidden] by 24 outputs) the fp32 copy and the fp32
    GEMMs cost more than all the mixing they feed.
    """
    if x.is_cuda and x.dtype == torch.bfloat16:
        return _Bf16PartsLinear.apply(x, weight)
    return F.linear(x.float(), weight.float())


def _bf16_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """bf16 tensors summing to `t`: itself if bf16, else hi and lo (hi's rounding error, rounded): 2^-18 of t."""
    if t.dtype == torch.bfloat16:
        return [t]
    hi = t.to(torch.bfloat16)
    return [hi, (t.float() - hi.float()).to(torch.bfloat16)]


def _bf16_parts_product(a_parts: list[torch.Tensor], b_parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands of one GEMM that sums a_i @ b_j over the part pairs but lo x lo (2^-18 of 2^-18):
    [a_i ...] concatenated along columns, [b_j ...] along rows."""
    pairs = [(a, b) for i, a in enumerate(a_parts) for j, b in enumerate(b_parts) if i + j < 2]
    return torch.cat([a for a, _ in pairs], dim=1), torch.cat([b for _, b in pairs], dim=0)


class _Bf16PartsLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        rows = x.reshape(-1, x.shape[-1])                                                  # [M, K] bf16
        parts = _bf16_parts(weight)
        per_part = matmul_fp32(rows[None], torch.cat(parts).t()[None])[0]                  # [M, parts * n]
        ctx.save_for_backward(x, weight)
        return sum(per_part.chunk(len(parts), dim=1)).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_parts = _bf16_parts(grad.reshape(-1, weight.shape[0]).float())
        x_grad = torch.mm(*_bf16_parts_product(grad_parts, _bf16_parts(weight)))           # bf16 out, like x
        return x_grad.view_as(x), _weight_grad_of_parts(grad_parts, x, weight)


def linear_fp32_weight_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weight's gradient of `linear_fp32(x, weight)` for its output gradient `grad`, in weight's dtype."""
    grad = grad.reshape(-1, weight.shape[0]).float()
    if not (x.is_cuda and x.dtype == torch.bfloat16):
        return (grad.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
    return _weight_grad_of_parts(_bf16_parts(grad), x, weight)


def _weight_grad_of_parts(grad_parts: list[torch.Tensor], x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_i grad_part_i^T @ x as one bf16 GEMM with fp32 output, in weight's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    per_part = matmul_fp32(torch.cat(grad_parts, dim=1).t()[None], rows[None])[0]          # [parts * n, K]
    return sum(per_part.chunk(len(grad_parts), dim=0)).to(weight.dtype)


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS over the last dim, fp32, kept as a dim of size 1 (the scale of an unweighted RMS norm)."""
    return torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)


@fused
def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * inverse_rms(x, eps).to(x.dtype)


class ReplicatedLinear(nn.Module):
    """A bias-free linear whose full weight lives on every tensor-parallel rank.

    Its inputs are replicated, so its output is too; a caller that feeds the output into
    head-sharded math must wrap it in `copy_to_tensor_model_parallel_region` so the backward pass
    sums the per-rank gradients (each rank only sees the gradient of its own heads).
    """

    def __init__(self, input_size: int, output_size: int, config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        with torch.no_grad():
            config.init_method(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RotaryTable(nn.Module):
    """cos/sin of one V4 rope kind ("main" or "compress") at given positions (transformers' rotary)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        super().__init__()
        self.register_buffer("inv_freq", keep_fp32(inv_freq.float().clone()), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return cos.to(dtype=dtype), sin.to(dtype=dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


@fused
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """V4's interleaved RoPE on the *trailing* rope slice of each head: `[nope | rope]`."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = ((rope.float() * cos) + (_rotate_half(rope).float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def per_token(module: nn.Module, config) -> nn.Module:
    """A module that acts on each token alone: under sequence parallelism on this rank's tokens only."""
    return sequence_parallel.mark_sequence_parallel(module, config)
