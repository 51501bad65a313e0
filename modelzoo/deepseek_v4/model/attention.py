"""DeepSeek-V4 attention (transformers' DeepseekV4Attention), tensor-parallel by heads.

    qr = q_norm(wq_a(x))                          wq_a replicated (qr also feeds the indexer)
    q  = rms(wq_b(qr) per head); rope(q)          wq_b column-parallel: this rank's heads
    kv = rope(kv_norm(wkv(x)))                    wkv replicated: one K=V head shared by all heads
    kv = [kv ; compressor entries]                CSA / HCA layers (compressor replicated)
    o  = softmax([q.kv^T * D^-0.5 + mask, sink]) . kv      sinks sharded by heads
    o  = rope^-1(o)                               undo the rope V carried on its rope slice
    x  = wo_b(wo_a_grouped(o))                    wo_a sharded by output group, wo_b row-parallel

`attention="exact"` is the eager math of transformers (the parity path), carried out in fp32 and
rounded once at the end like the fused kernel: it materialises the [B, heads, S, S + compressed] scores.
`attention="fast"` is `window_sink_attention` (model/window_attention.py): each block of `window` queries
against its window keys as batched GEMMs, with every complete HCA entry or each query's own CSA picks (never a
[S, entries] mask), the same math on CPU and GPU; in packed and padded batches it runs each sequence against its
own keys and entries.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from modelzoo.layers.attention import visible_keys
from modelzoo.layers.context_parallel import gather_in_row_order, gather_keys
from modelzoo.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Args
from modelzoo.deepseek_v4.model.compressor import CompressedVisibility, CSACompressor, HCACompressor, runs_of_sequence
from modelzoo.deepseek_v4.model.indexer import Indexer
from modelzoo.deepseek_v4.model.window_attention import QueryRun, attend_runs, window_sink_attention
from modelzoo.deepseek_v4.model.layers import (
    ReplicatedLinear,
    RMSNorm,
    RotaryTable,
    apply_rotary,
    fp32_param,
    init_sharded,
    mark_tensor_parallel,
    unweighted_rms_norm,
)
from modelzoo.layers.fused import fused
from modelzoo.layers.recompute import recomputed
from modelzoo.layers.sequences import TokenLayout, plain_layout

ATTENTION_IMPLEMENTATIONS = ("exact", "fast")


class GroupedOutputProjection(nn.Module):
    """wo_a: block-diagonal projection, each of this rank's output groups (H*D/G -> o_lora_rank).

    The weight rows are [group 0's o_lora_rank rows; group 1's; ...], exactly transformers' layout,
    so sharding rows by TP hands each rank whole groups (G/tp of them) = the groups of its heads.
    """

    def __init__(self, config, groups: int, in_per_group: int, rank: int, tp: int):
        super().__init__()
        self.local_groups = groups // tp
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(self.local_groups * rank, in_per_group, dtype=config.params_dtype)), dim=0)
        init_sharded(self.weight, config.init_method, "model-parallel-rng")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, G_local, H*D/G] -> [B, S, G_local, o_lora_rank] (transformers' bmm per group)."""
        tokens_first = _GroupedMatmul.apply(x.reshape(-1, *x.shape[-2:]), self.weight, self.local_groups)
        return tokens_first.view(*x.shape[:-1], -1)


class _GroupedMatmul(torch.autograd.Function):
    """y[t, g] = x[t, g] @ w[g]^T for tokens t and groups g, in the tokens-first layout throughout.

    One batched GEMM over the groups, each reading and writing strided token rows (`bmm(out=)` into a
    transposed view): a groups-first result transposed back to tokens-first would cost a copy of the
    activations forward and backward, and the backward needs no copies either.
    """

    @staticmethod
    def forward(ctx, x, weight, groups: int):
        """x [T, G, in], weight [G * out, in] -> [T, G, out]."""
        w = weight.view(groups, -1, weight.shape[-1])
        y = x.new_empty(x.shape[0], groups, w.shape[1])
        torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))
        ctx.save_for_backward(x, weight)
        ctx.groups = groups
        return y

    @staticmethod
    def backward(ctx, y_grad):
        x, weight = ctx.saved_tensors
        w = weight.view(ctx.groups, -1, weight.shape[-1])
        y_grad = y_grad.transpose(0, 1)                                                  # [G, T, out]
        x_grad = torch.empty_like(x)
        torch.bmm(y_grad, w, out=x_grad.transpose(0, 1))
        weight_grad = torch.bmm(y_grad.transpose(1, 2), x.transpose(0, 1))               # [G, out, in]
        return x_grad, weight_grad.view_as(weight), None


def eager_sink_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                         scaling: float) -> torch.Tensor:
    """q [B, h, S, D], kv [B, 1, T, D] (K = V), mask [B|1, 1, S, T] additive -> [B, S, h, D].

    transformers' eager_attention_forward with a per-head sink logit that takes probability mass
    but contributes no value.
    """
    batch, heads, seq_len, _ = q.shape
    dtype, q, kv = q.dtype, q.float(), kv.float()
    kv = kv.expand(batch, heads, *kv.shape[2:]).reshape(batch, heads, *kv.shape[2:])   # repeat_kv
    scores = torch.matmul(q, kv.transpose(2, 3)) * scaling
    scores = scores + mask
    sink = sinks.float().reshape(1, -1, 1, 1).expand(batch, -1, seq_len, -1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs, kv).to(dtype).transpose(1, 2).contiguous()


@fused
def normed_rotary_queries(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's RMS norm (no weight), then RoPE: q [B, S, h, D]. One kernel on a GPU, not two passes over q."""
    return apply_rotary.eager(unweighted_rms_norm.eager(q, eps), cos, sin, unsqueeze_dim=2)


class DeepseekV4Attention(nn.Module):
    def __init__(self, config, args: DeepseekV4Args, layer_type: str, attention: str = "exact",
                 recompute_core: bool = False):
        super().__init__()
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"DeepSeek-V4: attention={attention!r} is not one of {ATTENTION_IMPLEMENTATIONS}")
        self.attention = attention
        tp = config.tensor_model_parallel_size
        heads, head_dim = args.num_heads, args.head_dim
        if heads % tp or args.o_groups % tp:
            raise ValueError(f"DeepSeek-V4: tensor parallel size {tp} must divide num_attention_heads ({heads}) "
                             f"and o_groups ({args.o_groups})")
        self.layer_type, self.head_dim, self.local_heads = layer_type, head_dim, heads // tp
        self.sliding_window, self.eps, self.scaling = args.sliding_window, args.rms_norm_eps, head_dim**-0.5

        self.linear_q_down_proj = ReplicatedLinear(args.hidden_size, args.q_lora_rank, config)
        self.q_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.linear_q_up_proj = ColumnParallelLinear(
            args.q_lora_rank, heads * head_dim, config=config, init_method=config.init_method, bias=False,
            gather_output=False)
        self.linear_kv = ReplicatedLinear(args.hidden_size, head_dim, config)
        self.kv_layernorm = RMSNorm(head_dim, args.rms_norm_eps)
        self.linear_o_down_proj = GroupedOutputProjection(
            config, args.o_groups, heads * head_dim // args.o_groups, args.o_lora_rank, tp)
        self.linear_proj = RowParallelLinear(
            args.o_groups * args.o_lora_rank, args.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=False)
        self.sinks = mark_tensor_parallel(fp32_param(heads // tp, fill=0.0), dim=0)
        self.rotary = RotaryTable(*args.rope_table(args.rope_kind(layer_type)))
        self.compressor = (CSACompressor(config, args, Indexer) if layer_type == CSA else
                           HCACompressor(config, args) if layer_type == HCA else None)
        self.recompute_core = recompute_core  # selective recompute "core_attn"

    def attend_each_sequence(self, q: torch.Tensor, kv: torch.Tensor, compressed: CompressedVisibility | None,
                             layout: TokenLayout) -> torch.Tensor:
        """The fast path on a packed or padded batch: each sequence's queries against its own window keys and its
        own compressed entries, as it would run alone (work and memory in each sequence's own length, not the
        row's); padding tokens get zeros. q [B, S, h, D], kv [B, S + E, D] -> [B, S, h, D].

        Under context parallelism kv holds the whole rows (every rank's tokens in row order, then the entries) and
        a sequence's queries here are runs of consecutive positions (its chunks on this rank): each run attends
        with the window keys before it (the halo, other ranks' tokens) and the entries of its sequence
        (`attend_runs`: one gather of every run's queries and keys, one placement of the outputs)."""
        whole = layout.whole_rows()
        seq_len, keys_len, kv_len = q.shape[1], whole.shape[1], kv.shape[1]
        spans = compressed.windows.per_sequence(whole) if compressed is not None else None
        runs = []
        for number, (row, start, length) in enumerate(whole.sequences):
            for first, position, count in runs_of_sequence(layout, row, start, length):
                halo = min(position, self.sliding_window - 1)
                keys = torch.arange(start + position - halo, start + position + count)
                picks, ratio = None, None
                if compressed is not None:
                    first_entry, entries = spans[number]
                    keys = torch.cat((keys, torch.arange(entries) + keys_len + first_entry))
                    picks, ratio = compressed.of_sequence(row, first, count, first_entry)
                runs.append(QueryRun(torch.arange(count) + row * seq_len + first, keys + row * kv_len, picks, ratio,
                                     position, halo))
        return attend_runs(q, kv, runs, self.sinks, self.scaling, self.sliding_window)

    def _core(self, q: torch.Tensor, kv: torch.Tensor, hidden_states: torch.Tensor, q_residual: torch.Tensor,
              position_ids: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """Compressor, indexer and attention of the queries q [B, S, h, D] over the window's K = V kv [B, 1, S, D]
        and the compressed entries -> [B, S, h, D] (still rotated)."""
        batch, seq_len = q.shape[:2]
        keys = layout.context_parallel_keys
        if keys is not None:  # this rank's queries over every rank's window keys (exact: in the keys' order)
            kv = gather_keys(kv, keys.context_parallel) if self.attention == "exact" else \
                gather_in_row_order(kv[:, 0], keys).unsqueeze(1)
        compressed = None
        if self.compressor is not None:
            compressed_kv, compressed = self.compressor(hidden_states, q_residual, position_ids, layout)
            kv = torch.cat([kv, compressed_kv], dim=2)
        # K = V is computed on every rank but read only by this rank's heads: sum its gradients
        kv = tensor_parallel.copy_to_tensor_model_parallel_region(kv)

        if self.attention == "fast" and layout.plain:
            picks, ratio = (None, None) if compressed is None else (compressed.picks, compressed.windows.ratio)
            out = window_sink_attention(q, kv[:, 0], self.sinks, self.scaling, self.sliding_window, picks, ratio)
        elif self.attention == "fast":
            out = self.attend_each_sequence(q, kv[:, 0], compressed, layout)
        else:
            allowed = visible_keys(seq_len, self.sliding_window, layout, q.device)
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
            mask = mask.expand(batch, 1, seq_len, -1)
            if compressed is not None:
                compressed_bias = torch.zeros(compressed.dense(layout).shape, dtype=q.dtype, device=q.device)
                compressed_bias = compressed_bias.masked_fill(~compressed.dense(layout), float("-inf"))
                mask = torch.cat([mask, compressed_bias.unsqueeze(1)], dim=-1)
            out = eager_sink_attention(q.transpose(1, 2), kv, mask, self.sinks, self.scaling)
        return out

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                layout: TokenLayout | None = None) -> torch.Tensor:
        """hidden_states [B, S, hidden] (replicated over TP) -> [B, S, hidden] (all-reduced).

        position_ids [B|1, S]: RoPE positions; `layout`: which tokens form each sequence (modelzoo.layers.sequences),
        None for plain rows."""
        batch, seq_len, _ = hidden_states.shape
        if layout is None:
            layout = plain_layout(batch, seq_len, hidden_states.device)
        cos, sin = self.rotary(position_ids, hidden_states.dtype)

        q_residual = self.q_layernorm(self.linear_q_down_proj(hidden_states))
        q, _ = self.linear_q_up_proj(q_residual)
        q = q.view(batch, seq_len, -1, self.head_dim)                                    # [B, S, h, D]
        q = normed_rotary_queries(q, cos, sin, self.eps)

        kv = self.kv_layernorm(self.linear_kv(hidden_states)).view(batch, 1, seq_len, self.head_dim)
        kv = apply_rotary(kv, cos, sin)

        out = recomputed(self._core, self.recompute_core)(q, kv, hidden_states, q_residual, position_ids, layout)
        out = apply_rotary(out, cos, -sin, unsqueeze_dim=2)                               # [B, S, h, D]
        grouped = self.linear_o_down_proj(out.reshape(batch, seq_len, self.linear_o_down_proj.local_groups, -1))
        output, _ = self.linear_proj(grouped.flatten(2))
        return output
