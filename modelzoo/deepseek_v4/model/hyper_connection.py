"""Manifold-constrained hyper-connections (mHC) and the final hyper head (transformers' DeepseekV4HyperConnection / HyperHead).

The residual stream is `hc_mult` parallel copies [B, S, N, hidden]. Around each block a one-layer
map of the flattened, RMS-normalised streams gives
    pre  = sigmoid(.) + eps            [B, S, N]     collapse weights -> the block's input
    post = 2 sigmoid(.)                [B, S, N]     where the block's output is placed
    comb = sinkhorn(softmax(.) + eps)  [B, S, N, N]  doubly-stochastic residual mixer
and the new streams are `post * block(collapsed) + comb^T @ streams`.

All of it is replicated across tensor-parallel ranks (the mapping is [(2+N)N, N*hidden]: small),
in fp32 like transformers keeps it. The RMS norm of the flattened streams is a per-token scale, applied
to the map's output instead of its input (`map_mixes`): the same value up to fp32 rounding, and the bf16
streams go into the map as they are (`linear_fp32`), with no normalised fp32 copy of them. On a GPU
the passes over the streams (map, collapse, residual, each way) are Triton kernels (`hc_kernels.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from modelzoo.deepseek_v4.model.layers import fp32_param, inverse_rms, linear_fp32
from modelzoo.layers.fused import fused


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

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, S, N, hidden] -> (post [B, S, N], comb [B, S, N, N], collapsed [B, S, hidden], streams).

        Give the returned streams to `hc_residual`: on a GPU they are an alias through which the
        residual's gradient reaches this map's backward kernels (`hc_kernels`), instead of a sum by autograd.
        """
        pre, post, comb, streams = self.mix(streams)
        collapsed, streams = collapse(streams, pre)
        return post, comb, collapsed, streams

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams -> (pre, post, comb, streams): the map's weights, without the collapse (DeepSeek-V4.1 collapses
        with another site's pre); the returned streams as in `forward`."""
        kernels = _kernels(streams)
        if kernels is not None:
            mixes, streams = kernels.StreamsMap.apply(streams, self.fn, self.norm_eps)
        else:
            mixes = map_mixes(streams, linear_fp32(streams.flatten(2), self.fn), self.norm_eps)
        pre, post, comb = hc_mixing(mixes, self.base, self.scale, self.hc_mult, self.sinkhorn_iters, self.hc_eps)
        return pre, post, comb, streams


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_n pre[n] * streams[n], streams): the block's input, and the streams to hand on (an alias on a GPU)."""
    kernels = _kernels(streams)
    if kernels is not None:
        return kernels.Collapse.apply(streams, pre)
    return plain_collapse(pre, streams), streams


def _kernels(streams: torch.Tensor):
    """The Triton kernels' module where they apply (contiguous CUDA streams, N a power of two), else None."""
    hc = streams.shape[-2]
    if not (streams.is_cuda and streams.is_contiguous() and hc & (hc - 1) == 0):
        return None
    from modelzoo.deepseek_v4.model import hc_kernels
    return hc_kernels


def map_mixes(streams: torch.Tensor, projected: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The map of the RMS-normalised flattened streams, from their unnormalised map `projected` (fp32)."""
    return projected * inverse_rms(streams.flatten(2), norm_eps)


def hc_mixing(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, sinkhorn_iters: int,
              hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The map's outputs [.., (2 + N) N] -> pre [.., N], post [.., N], comb [.., N, N] (all fp32)."""
    pre, post, comb_logits = mixing_weights(mixes, base, scale, hc, hc_eps)
    kernels = _kernels(comb_logits)
    if kernels is not None:
        return pre, post, kernels.Sinkhorn.apply(comb_logits, sinkhorn_iters, hc_eps)
    return pre, post, plain_sinkhorn(comb_logits, sinkhorn_iters, hc_eps)


@fused
def mixing_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                   hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre, post and the logits of comb (before its softmax and Sinkhorn iterations)."""
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_scale, post_scale, comb_scale = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb_logits = comb_w.view(*comb_w.shape[:-1], hc, hc) * comb_scale + comb_b.view(hc, hc)
    return pre, post, comb_logits


def plain_sinkhorn(logits: torch.Tensor, sinkhorn_iters: int, hc_eps: float) -> torch.Tensor:
    """softmax over each row + eps, then alternately normalise columns and rows: doubly stochastic."""
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return comb


def plain_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_n pre[n] * streams[n] in fp32, in the streams' dtype: the block's input."""
    return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


def hc_residual(post: torch.Tensor, comb: torch.Tensor, block_output: torch.Tensor,
                streams: torch.Tensor) -> torch.Tensor:
    """New streams: post[n] * block_output + sum_j comb[j, n] * streams[j] (comb used transposed)."""
    kernels = _kernels(streams)
    if kernels is not None:
        return kernels.Residual.apply(post, comb, block_output, streams)
    return plain_residual(post, comb, block_output, streams)


def plain_residual(post: torch.Tensor, comb: torch.Tensor, block_output: torch.Tensor,
                   streams: torch.Tensor) -> torch.Tensor:
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
    pre = torch.sigmoid(map_mixes(streams, projected, norm_eps) * scale.float() + base.float()) + hc_eps
    return plain_collapse(pre, streams)
