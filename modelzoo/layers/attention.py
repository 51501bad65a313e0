"""Causal (optionally sliding-window) softmax attention with two implementations behind one switch.

- "exact": the eager math of transformers' `eager_attention_forward`, carried out in fp32 whatever
  the input dtype and rounded once at the end, as the fused kernels do. In fp32 it is op for op
  transformers' eager path (the CPU parity path); in bf16 it is the precision reference the fast
  path is checked against (bf16 scores would round each logit to 8 bits before the softmax).
- "fast": `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels on
  GPU) for causal attention, and `flex_attention` with a sliding-window block mask on GPU.

Tensors are [batch, heads, seq, head_dim]; keys and values may have fewer heads (GQA). Queries
and keys share positions (self-attention over the same tokens). A `TokenLayout` (modelzoo/layers/sequences.py)
says which tokens belong together in packed and padded batches: attention stays within a sequence. The fast
path then runs flex_attention with a block mask made from the sequence ids on a GPU (no [seq, seq] mask), and
SDPA with the layout's boolean mask on the CPU. Under context parallelism the layout holds this rank's share of
the rows: its queries attend over the keys and values of every rank of the group, gathered here
(modelzoo/layers/context_parallel.py), so every model with this attention runs context-parallel.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from modelzoo.layers.context_parallel import gather_keys_values
from modelzoo.layers.sequences import TokenLayout

AttentionImpl = Literal["exact", "fast"]
IMPLEMENTATIONS = ("exact", "fast")


def window_mask(seq_len: int, window: int | None, device: torch.device) -> Tensor:
    """[seq, seq] bool, True where query t may see key s: s <= t and (no window or s > t - window)."""
    query = torch.arange(seq_len, device=device)[:, None]
    key = torch.arange(seq_len, device=device)[None, :]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    return allowed


def _repeat_kv(tensor: Tensor, times: int) -> Tensor:
    return tensor if times == 1 else tensor.repeat_interleave(times, dim=1)


def _is_plain(layout: TokenLayout | None) -> bool:
    return layout is None or layout.plain


def visible_keys(seq_len: int, window: int | None, layout: TokenLayout | None, device) -> Tensor:
    """[seq, seq] (plain rows) or [batch, 1, seq, seq] bool: True where a query may see a key."""
    if _is_plain(layout):
        return window_mask(seq_len, window, device)
    return layout.visible(window)[:, None]


def eager_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None = None,
                    dropout: float = 0.0, layout: TokenLayout | None = None) -> Tensor:
    dtype = q.dtype
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.float(), _repeat_kv(k, groups).float(), _repeat_kv(v, groups).float()
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~visible_keys(q.shape[2], window, layout, q.device), float("-inf"))
    probs = F.dropout(torch.softmax(scores, dim=-1), p=dropout, training=dropout > 0)
    return torch.matmul(probs, v).to(dtype)


def fast_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None = None,
                   dropout: float = 0.0, layout: TokenLayout | None = None) -> Tensor:
    gqa = k.shape[1] != q.shape[1]
    if not _is_plain(layout):
        if q.is_cuda and dropout == 0.0 and layout.attention_mask is None:
            return _flex_documents(q, k, v, scale, window, layout)
        # CPU, dropout or a caller's general mask: SDPA with the boolean mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.visible(window)[:, None], scale=scale,
                                              dropout_p=dropout, enable_gqa=gqa)
    if window is None or window >= q.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout,
                                              enable_gqa=k.shape[1] != q.shape[1])
    if q.is_cuda and dropout == 0.0:
        return _flex_sliding_window(q, k, v, scale, window)
    # CPU (or dropout): SDPA with an explicit mask has the same math as the flex kernel
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(q.shape[2], window, q.device),
                                          scale=scale, dropout_p=dropout, enable_gqa=k.shape[1] != q.shape[1])


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None = None,
              impl: AttentionImpl = "exact", dropout: float = 0.0, layout: TokenLayout | None = None) -> Tensor:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {impl!r} is not one of {IMPLEMENTATIONS}")
    if layout is not None and layout.context_parallel_keys is not None:
        k, v = gather_keys_values(k, v, layout.context_parallel_keys.context_parallel)
    if impl == "exact":
        return eager_attention(q, k, v, scale, window, dropout, layout)
    return fast_attention(q, k, v, scale, window, dropout, layout)


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once per process (the uncompiled one is a slow reference on GPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def in_window(query, key, window: int):
    """flex_attention mask rule: key is at or before query and fewer than `window` positions back."""
    return (key <= query) & (key > query - window)


@functools.lru_cache(maxsize=16)
def sliding_block_mask(seq_len: int, window: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding_causal(batch, head, query, key):
        return in_window(query, key, window)

    # compiled: the eager create_block_mask evaluates the rule on the whole [seq, seq] grid (int64 indices), which
    # at 65536 tokens holds tens of GiB for a moment
    return create_block_mask(sliding_causal, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device,
                             _compile=True)


def _flex_sliding_window(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int) -> Tensor:
    block_mask = sliding_block_mask(q.shape[2], window, q.device)
    return compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale,
                                      enable_gqa=k.shape[1] != q.shape[1])


def document_block_mask(layout: TokenLayout, window: int | None):
    """flex_attention block mask of a layout: causal within each sequence (and its window); padding sees itself.

    Built from the [b, s] sequence ids and positions without a [s, s] tensor (compiled `create_block_mask`):
    blocks that straddle no sequence border are skipped or taken whole, as for one sequence. The keys are the
    layout's `keys` (every rank's tokens under context parallelism).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    segment_ids, positions, keys = layout.segment_ids, layout.positions, layout.keys

    def same_sequence(batch, head, query, key):
        query_at, key_at = keys.query_index[query], keys.index[key]
        allowed = (segment_ids[batch, query] == keys.segment_ids[batch, key]) & (key_at <= query_at)
        allowed = allowed & ((keys.segment_ids[batch, key] >= 0) | (query_at == key_at))
        if window is not None:
            allowed = allowed & (positions[batch, query] - keys.positions[batch, key] < window)
        return allowed

    batch, seq = layout.shape
    return create_block_mask(same_sequence, B=batch, H=None, Q_LEN=seq, KV_LEN=keys.index.shape[0],
                             device=segment_ids.device, _compile=True)


def _flex_documents(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None, layout: TokenLayout) -> Tensor:
    key = ("flex block mask", window)
    if key not in layout.derived:  # once per forward, read by every layer
        layout.derived[key] = document_block_mask(layout, window)
    return compiled_flex_attention()(q, k, v, block_mask=layout.derived[key], scale=scale,
                                      enable_gqa=k.shape[1] != q.shape[1])


class CoreAttention(torch.nn.Module):
    """Megatron-Core `core_attention` submodule backed by `attention()` (no parameters).

    Drop-in for the local spec's DotProductAttention: takes [seq, batch, heads, head_dim] query, key
    and value for this rank's heads and returns [seq, batch, heads * head_dim]. Always causal;
    `window` makes it sliding-window, `impl` picks the exact or the fast kernel. The batch's `TokenLayout`
    arrives as Megatron's `packed_seq_params` (`modelzoo.compat.PassedAsPackedSeqParams`).
    """

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type=None,
                 softmax_scale: float | None = None, impl: AttentionImpl = "exact",
                 window: int | None = None, **unused_megatron_kwargs):
        super().__init__()
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"attention implementation {impl!r} is not one of {IMPLEMENTATIONS}")
        self.config, self.impl, self.window = config, impl, window
        head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else head_dim**-0.5

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask=None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if attention_mask is not None or attention_bias is not None or not (
                packed_seq_params is None or isinstance(packed_seq_params, TokenLayout)):
            raise ValueError("CoreAttention reads the batch's TokenLayout (modelzoo.layers.sequences), which modelzoo's "
                             "models build from attention_mask / packed_seq_params: call the model, not its decoder")
        layout = packed_seq_params
        dropout = self.config.attention_dropout if self.training else 0.0
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if dropout > 0:
            from megatron.core import tensor_parallel

            # heads are split across TP ranks: each rank draws its own dropout mask (Megatron's rule)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = attention(q, k, v, self.scale, self.window, self.impl, dropout, layout)
        else:
            out = attention(q, k, v, self.scale, self.window, self.impl, layout=layout)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
