"""Manifold-constrained hyper-connections (mHC) and the final hyper head (transformers' DeepseekV4HyperConnection / HyperHead).

The residual stream is `hc_mult` parallel copies [B, S, N, hidden]. Around each block a one-layer
map of the flattened, RMS-normalised streams gives
    pre  = sigmoid(.) + eps            [B, S, N]     collapse weights -> the block's input
    post = 2 sigmoid(.)                [B, S, N]     where the block's output is placed
    comb = sinkhorn(softmax(.) + eps)  [B, S, N, N]  doubly-stochastic residual mixer
and the new streams are `post * block(collapsed) + comb^T @ streams`.

All of it is replicated across tensor-parallel ranks (the mapping is [(2+N)N, N*hidden]: small),
in fp32 like transformers keeps it. The RMS norm of the flattened streams is a per-token scale, applied
to the map's output instead of its input (`mixes`): the same value up to fp32 rounding, and the bf16
streams go into the map as they are (`linear_fp32`), with no normalised fp32 copy of them.
"""

from __future__ import annotations

import torch
from torch import nn

from modelzoo.deepseek_v4.model.layers import fp32_param, inverse_rms, linear_fp32
from modelzoo.fused import fused


class HyperConnection(nn.Module):
    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 init_std: float = 0.02):
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = fp32_param(width, hc_mult * hidden_size)
        self.base = fp32_param(width, fill=0.0)
        self.scale = fp32_param(3, fill=1.0)
        with torch.no_grad():
            self.fn.normal_(0.0, init_std)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, S, N, hidden] -> (post [B, S, N], comb [B, S, N, N], collapsed [B, S, hidden])."""
        return hc_mix(streams, linear_fp32(streams.flatten(2), self.fn), self.base, self.scale, self.hc_mult,
                      self.sinkhorn_iters, self.hc_eps, self.norm_eps)


def mixes(streams: torch.Tensor, projected: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The map of the RMS-normalised flattened streams, from their unnormalised map `projected` (fp32)."""
    return projected * inverse_rms(streams.flatten(2), norm_eps)


@fused
def hc_mix(streams: torch.Tensor, projected: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pre_w, post_w, comb_w = mixes(streams, projected, norm_eps).split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_scale, post_scale, comb_scale = scale.unbind(0)
    comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
    comb_b = comb_b.view(hc, hc)

    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb = torch.softmax(comb_w * comb_scale + comb_b, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)

    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
    return post, comb, collapsed


@fused
def hc_residual(post: torch.Tensor, comb: torch.Tensor, block_output: torch.Tensor,
                streams: torch.Tensor) -> torch.Tensor:
    """New streams: post[n] * block_output + sum_j comb[j, n] * streams[j] (comb used transposed).

    The N x N mix is a broadcast product summed over j, not a matmul: per token it is a 4 x 4 by
    4 x hidden product, which batched GEMM kernels run far below bandwidth (compiled, it fuses).
    """
    dtype = streams.dtype
    mixed = (comb.to(dtype).unsqueeze(-1) * streams.unsqueeze(-2)).sum(dim=-3)
    return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """Collapse the N streams before the final norm: sigmoid weights, no Sinkhorn."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float, init_std: float = 0.02):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = fp32_param(hc_mult, hc_mult * hidden_size)
        self.base = fp32_param(hc_mult, fill=0.0)
        self.scale = fp32_param(1, fill=1.0)
        with torch.no_grad():
            self.fn.normal_(0.0, init_std)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return hc_head_collapse(streams, linear_fp32(streams.flatten(2), self.fn), self.base, self.scale, self.hc_eps,
                                self.norm_eps)


@fused
def hc_head_collapse(streams: torch.Tensor, projected: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     hc_eps: float, norm_eps: float) -> torch.Tensor:
    pre = torch.sigmoid(mixes(streams, projected, norm_eps) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
