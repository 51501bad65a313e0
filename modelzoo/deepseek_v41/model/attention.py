"""DeepSeek-V4.1 attention with CSA2 layer roles, tensor-parallel by heads.

    qr = q_norm(wq_a x)                         wq_a replicated (qr also feeds the indexer)
    q  = rope(wq_b qr)                          wq_b column-parallel: this rank's heads; no per-head norm (V4 has one)
    kv = rope(kv_norm(wkv x))                   wkv replicated: one K = V head shared by all heads
    o  = softmax([q.[kv ; selected latents]^T / sqrt(D), sink]) . [kv ; latents]      sinks sharded by heads
    x  = wo_b(grouped wo_a(rope^-1(o)))         V4's GroupedOutputProjection (by output group) and row-parallel wo_b

CSA2 (see modelzoo/deepseek_v41/config.py for the roles): a KV source's compressor pools its latents and publishes
them, rotated, with its indexer keys; an index source scores the published keys and publishes its top-k; the
candidate source also publishes its best blocks, which restrict every later index source; a reuse layer reads the
published latents and top-k. That state lives for one forward (`CompressedState`, the reference's own class): the
latents stay in the graph, so the gradients of every layer that reads them reach the source's compressor.

Under tensor parallelism the compressor and the indexer are replicated: every rank computes the same latents,
scores and picks from the same (all-reduced) input, and the latents' gradient, which each rank has only for its own
heads, is summed over the ranks where the keys enter the heads (`copy_to_tensor_model_parallel_region`). The
selection rules (stable top-k, newest candidate block kept) are the reference's functions: they choose indices,
and parity needs the same choice, ties included.

`fake_quant`: the release's inference storage, applied in the forward with straight-through gradients (the
reference's `fake_quant_fp8` / `fake_quant_fp4`, where the reference applies them): the window K/V rounded to FP8
(E4M3, a power-of-two scale per 32 channels), the compressed K/V to FP4 (E2M1, an E4M3 scale per 16) and the
indexer's queries and keys to FP4 (E2M1, a power-of-two scale per 32). Every rounded tensor is a replicated
computation (K/V, latents, indexer), so every TP rank rounds the same values alike.

Activation recompute: the compressed entries and the attention over them (`core`, selective "core_attn") take the
state they read as explicit inputs and return the state after this layer, so that their recompute in the backward
re-reads what the forward read and publishes nothing; the indexer's picks (no gradient) are kept from the
forward (`kept_for_recompute`).

`attention="fast"` keeps the picks as ids rather than masks (`CompressedState.selected` [B, S, k] latent ids,
`.candidates` [B, S, kb] block ids, -1 for an empty slot; the same choice as the masks, ties included) and scores
the queries in chunks, so that nothing of size queries x latents outlives a chunk: memory linear in the length.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from modelzoo.deepseek_v4.model import indexer as v4_indexer
from modelzoo.deepseek_v4.model.attention import GroupedOutputProjection
from modelzoo.deepseek_v4.model.layers import (
    ReplicatedLinear,
    RMSNorm,
    RotaryTable,
    apply_rotary,
    fp32_param,
    mark_tensor_parallel,
)
from modelzoo.deepseek_v4.model.window_attention import QueryRun, attend_runs, window_sink_attention
from modelzoo.deepseek_v41.config import DeepseekV41Args
from modelzoo.deepseek_v41.model.context_parallel import SequenceShares
from modelzoo.deepseek_v41.hf_model import (
    CompressedState,
    fake_quant_fp4,
    fake_quant_fp8,
    rope_inverse_frequencies,
    candidate_block_scores,
    select_candidate_blocks,
    top_k_mask,
)
from modelzoo.layers.recompute import kept_for_recompute, recomputed


def state_values(state: CompressedState) -> tuple:
    """The state's fields in order (`CompressedState(*values)` rebuilds it): a checkpointed region's explicit
    inputs and outputs."""
    return tuple(getattr(state, field.name) for field in dataclasses.fields(state))


def rotary_table(args: DeepseekV41Args, kind: str) -> RotaryTable:
    """cos/sin of the "main" (ratio-0 layers) or "compress" RoPE (DeepSeek's YaRN, no magnitude scaling)."""
    return RotaryTable(rope_inverse_frequencies(args.text, kind), 1.0)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the trailing rope channels of x [B, S, D] or [B, S, H, D]; cos / sin [S, R / 2], or [B, S, R / 2]
    where each row has its own positions (negate sin to undo)."""
    if x.dim() == 3:
        return rotate(x.unsqueeze(2), cos, sin).squeeze(2)
    return apply_rotary(x, cos, sin, unsqueeze_dim=cos.dim() - 1)


class Compressor(nn.Module):
    """A KV source's latents, before RoPE: per token at ratio 1, softmax-gated pooling of disjoint groups of r tokens
    (in fp32) above it; a trailing partial group is not a latent yet."""

    def __init__(self, config, args: DeepseekV41Args, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.linear_kv = ReplicatedLinear(args.hidden_size, args.head_dim, config)
        self.linear_gate = ReplicatedLinear(args.hidden_size, args.head_dim, config) if ratio > 1 else None
        self.kv_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.project(x), x.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Per token: the latent at ratio 1, else [kv ; gate] in fp32 [B, S, 2 D] (what `pool` groups)."""
        if self.linear_gate is None:
            return self.kv_norm(self.linear_kv(x))
        x = x.float()
        return torch.cat((F.linear(x, self.linear_kv.weight.float()), F.linear(x, self.linear_gate.weight.float())),
                         dim=-1)

    def pool(self, projected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.linear_gate is None:
            return projected
        usable = projected.shape[1] // self.ratio * self.ratio
        kv, gate = projected[:, :usable].unflatten(1, (-1, self.ratio)).chunk(2, dim=-1)
        return self.kv_norm((kv * gate.softmax(dim=2)).sum(dim=2).to(dtype))


class Indexer(nn.Module):
    """sum_h w_h(x) relu(q_h . k) of every query against every published key. Only a KV source owns the key
    projection (`linear_k`, `k_layernorm`: its keys come from its own latents). Replicated and frozen (its scores
    only feed a top-k, which passes no gradient). `fake_quant`: queries and keys rounded to FP4."""

    def __init__(self, config, args: DeepseekV41Args, owns_keys: bool, fake_quant: bool = False):
        super().__init__()
        self.num_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.fake_quant = fake_quant
        self.linear_q_up_proj = ReplicatedLinear(args.q_lora_rank, self.num_heads * self.head_dim, config)
        self.linear_weights = ReplicatedLinear(args.hidden_size, self.num_heads, config)
        if owns_keys:
            self.linear_k = ReplicatedLinear(args.head_dim, self.head_dim, config)
            self.k_layernorm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def keys(self, latents: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        keys = rotate(self.k_layernorm(self.linear_k(latents)), cos, sin)
        return fake_quant_fp4(keys, 32, False, "the indexer keys") if self.fake_quant else keys

    def forward(self, x, q_residual, keys, cos, sin, visible: torch.Tensor, kernel: bool = False) -> torch.Tensor:
        """Scores [B, S, T] (fp32) of the queries x [B, S, hidden] against the published keys [B, T, d]; -inf at the
        latents j >= visible [S, 1] or [B, S, 1] (not complete at the query). `kernel` (the fast attention): on a
        GPU, DeepSeek-V4's Triton kernel, which sums the heads in registers instead of writing [B, S, h, T]."""
        queries = rotate(self.linear_q_up_proj(q_residual).unflatten(-1, (self.num_heads, self.head_dim)), cos, sin)
        if self.fake_quant:
            queries = fake_quant_fp4(queries, 32, False, "the indexer queries")
        scaling = self.head_dim**-0.5 * self.num_heads**-0.5
        kernels = v4_indexer.index_kernels_for(queries) if kernel else None
        if kernels is not None:
            complete = visible.squeeze(-1).expand(queries.shape[:2])
            return kernels.masked_index_scores(queries, keys.to(queries.dtype), self.linear_weights(x), complete, 1.0,
                                               scaling)
        weights = self.linear_weights(x).float() * scaling
        scores = (torch.einsum("bshd,btd->bsht", queries.float(), keys.float()).relu() * weights[..., None]).sum(dim=2)
        return scores.masked_fill(torch.arange(scores.shape[-1], device=x.device) >= visible, float("-inf"))


def sink_attention(queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """softmax over [allowed keys, sink] of q.k * scaling, the sink's share dropped, in fp32: queries [..., Q, h, D],
    keys [..., K, D] (K = V), allowed [..., Q, K] bool -> [..., Q, h, D] in the queries' dtype."""
    logits = torch.einsum("...qhd,...kd->...hqk", queries.float(), keys.float()) * scaling
    logits = logits.masked_fill(~allowed.unsqueeze(-3), float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(*logits.shape[:-1], 1)
    probabilities = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("...hqk,...kd->...qhd", probabilities, keys.float()).to(queries.dtype)


PICK_CHUNK_SCORES = 1 << 26  # the fast path scores this many (query, latent) pairs at a time: 256 MiB of fp32


def top_k_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`top_k_mask`'s choice (the k best finite entries along the last dim, ties to the lower index) as ids
    [..., min(k, T)], -1 for an empty slot."""
    order = scores.sort(dim=-1, descending=True, stable=True)
    return torch.where(order.values[..., :k] > float("-inf"), order.indices[..., :k], -1)


def latents_in_blocks(block_ids: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """Block ids [..., kb] (-1: none) -> the mask [..., width] of the latents in those blocks."""
    blocks = picked_mask(block_ids, -(-width // block_size))
    return blocks.repeat_interleave(block_size, dim=-1)[..., :width]


def picked_mask(ids: torch.Tensor, width: int) -> torch.Tensor:
    """Ids [..., k] (-1: none) -> the mask [..., width] they mark."""
    slots = torch.where(ids >= 0, ids, width)
    kept = torch.zeros(*ids.shape[:-1], width + 1, dtype=torch.bool, device=ids.device)
    return kept.scatter_(-1, slots, True)[..., :width]


def query_positions(x: torch.Tensor, shares: SequenceShares | None) -> torch.Tensor:
    """The queries' positions in their sequences: [S] for whole rows x [B, S, ...], [B, S] for this CP rank's."""
    return torch.arange(x.shape[1], device=x.device) if shares is None else shares.positions


class DeepseekV41Attention(nn.Module):
    """One layer's attention; `layer_idx` >= num_layers is a DSpark draft layer (sliding window only).
    `fake_quant`: the release's FP8 / FP4 rounding of the K/V and indexer inputs (the module docstring)."""

    def __init__(self, config, args: DeepseekV41Args, layer_idx: int, fake_quant: bool = False,
                 recompute_core: bool = False, attention: str = "exact"):
        super().__init__()
        self.attention = attention  # "exact": dense [S, S + T] masks (the parity path); "fast": `attend_picks`
        self.recompute_core = recompute_core  # selective recompute "core_attn"
        text, tp = args.text, config.tensor_model_parallel_size
        if args.num_heads % tp or args.o_groups % tp:
            raise ValueError(f"deepseek_v41: tensor parallel size {tp} must divide num_attention_heads "
                             f"({args.num_heads}) and o_groups ({args.o_groups})")
        self.layer_idx, self.head_dim, self.local_heads = layer_idx, args.head_dim, args.num_heads // tp
        self.sliding_window, self.scaling = args.sliding_window, args.head_dim**-0.5
        self.ratio = text.compress_ratios[layer_idx]
        backbone = layer_idx < args.num_layers
        self.is_kv_source = backbone and layer_idx in text.kv_source_layer_ids
        self.is_index_source = backbone and layer_idx in text.index_source_layer_ids
        self.is_candidate_source = backbone and layer_idx == text.candidate_source_layer_id
        self.uses_candidates = backbone and 0 <= text.candidate_source_layer_id < layer_idx
        self.candidate_topk_blocks, self.candidate_block_size = text.candidate_topk_blocks, text.candidate_block_size
        self.index_topk = args.index_topk
        self.fake_quant = fake_quant

        self.linear_q_down_proj = ReplicatedLinear(args.hidden_size, args.q_lora_rank, config)
        self.q_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.linear_q_up_proj = ColumnParallelLinear(
            args.q_lora_rank, args.num_heads * args.head_dim, config=config, init_method=config.init_method,
            bias=False, gather_output=False)
        self.linear_kv = ReplicatedLinear(args.hidden_size, args.head_dim, config)
        self.kv_layernorm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.linear_o_down_proj = GroupedOutputProjection(
            config, args.o_groups, args.num_heads * args.head_dim // args.o_groups, args.o_lora_rank, tp)
        self.linear_proj = RowParallelLinear(
            args.o_groups * args.o_lora_rank, args.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=False)
        self.sinks = mark_tensor_parallel(fp32_param(self.local_heads, fill=0.0), dim=0)
        self.rotary = rotary_table(args, "compress" if self.ratio else "main")
        self.compress_rotary = rotary_table(args, "compress") if self.ratio else None
        self.compressor = Compressor(config, args, self.ratio) if self.is_kv_source else None
        self.indexer = (Indexer(config, args, owns_keys=self.is_kv_source, fake_quant=fake_quant)
                        if self.is_index_source else None)

    def project_q(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's rotated query heads [B, S, h, D], the query latent qr [B, S, q_lora_rank])."""
        q_residual = self.q_layernorm(self.linear_q_down_proj(x))
        queries, _ = self.linear_q_up_proj(q_residual)
        return rotate(queries.unflatten(-1, (self.local_heads, self.head_dim)), cos, sin), q_residual

    def project_kv(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        kv = rotate(self.kv_layernorm(self.linear_kv(x)), cos, sin)
        return fake_quant_fp8(kv) if self.fake_quant else kv

    def attend(self, queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        # K = V is computed on every rank but read only by this rank's heads: sum its gradients
        keys = tensor_parallel.copy_to_tensor_model_parallel_region(keys)
        return sink_attention(queries, keys, allowed, self.sinks, self.scaling)

    def output(self, attended: torch.Tensor, cos, sin) -> torch.Tensor:
        """Undo the query's rotation (K = V carried RoPE), then wo_b(grouped wo_a(.)) (all-reduced)."""
        attended = rotate(attended, cos, -sin)
        grouped = self.linear_o_down_proj(attended.flatten(-2).unflatten(-1, (self.linear_o_down_proj.local_groups,
                                                                               -1)))
        output, _ = self.linear_proj(grouped.flatten(-2))
        return output

    def forward(self, x: torch.Tensor, state: CompressedState, shares: SequenceShares | None = None) -> torch.Tensor:
        """x [B, S, hidden] (replicated) -> [B, S, hidden] (all-reduced); `state`: what earlier layers published,
        updated with what this layer publishes. With `shares` (context parallelism) x is this rank's tokens of each
        sequence, the keys every rank's."""
        positions = query_positions(x, shares)
        cos, sin = self.rotary(positions, x.dtype)
        queries, q_residual = self.project_q(x, cos, sin)
        keys = self.project_kv(x, cos, sin)
        if shares is not None:
            keys = shares.whole(keys)
        attended, *published = recomputed(self.core, self.recompute_core)(x, q_residual, queries, keys, shares,
                                                                           *state_values(state))
        for field, value in zip(dataclasses.fields(state), published):
            setattr(state, field.name, value)
        return self.output(attended, cos, sin)

    def core(self, x, q_residual, queries, keys, shares: SequenceShares | None, *read) -> tuple:
        """The compressed entries and the attention over them and the window, from explicit inputs (`read`: the
        state's values before this layer) -> (attended [B, S, h, D], *the state's values after it)."""
        state = CompressedState(*read)
        latents = self.compressed_keys(x, q_residual, state, shares) if self.ratio else None
        if self.attention == "fast":
            picks = None if latents is None else state.selected
            return self.attend_picks(queries, keys, latents, picks, state.ratio, shares), *state_values(state)
        positions = query_positions(x, shares)
        offset = positions[..., :, None] - torch.arange(keys.shape[1], device=x.device)
        allowed = ((offset >= 0) & (offset < self.sliding_window)).expand(x.shape[0], -1, -1)
        if latents is not None:
            keys = torch.cat((keys, latents), dim=1)
            allowed = torch.cat((allowed, state.selected), dim=-1)
        return self.attend(queries, keys, allowed), *state_values(state)

    def attend_picks(self, queries: torch.Tensor, keys: torch.Tensor, latents: torch.Tensor | None,
                     picks: torch.Tensor | None, ratio: int, shares: SequenceShares | None) -> torch.Tensor:
        """`attention="fast"`: DeepSeek-V4's `window_sink_attention`, each query over its window keys and its
        picked latents (the sparse kernels on a GPU: work in S x (window + k), no [S, S + T] mask or scores).
        queries [B, S, h, D]; keys [B, L, D] (L = S, or under context parallelism the whole sequences); latents
        [B, T, D] and picks [B, S, k] (latent ids, -1 for none) or None."""
        kv = keys if latents is None else torch.cat((keys, latents), dim=1)
        # K = V is computed on every rank but read only by this rank's heads: sum its gradients
        kv = tensor_parallel.copy_to_tensor_model_parallel_region(kv)
        ratio = ratio if latents is not None else None
        if shares is None:
            return window_sink_attention(queries, kv, self.sinks, self.scaling, self.sliding_window, picks, ratio)
        # this rank's queries of a sequence are runs of consecutive positions: each run attends with the window keys
        # before it (other ranks' tokens: its halo) and its sequence's latents
        seq_len, kv_len, latents_len = queries.shape[1], kv.shape[1], kv.shape[1] - keys.shape[1]
        runs = []
        for row, slot, position, count in shares.runs:
            halo = min(position, self.sliding_window - 1)
            run_keys = torch.cat((torch.arange(position - halo, position + count),
                                  torch.arange(latents_len) + keys.shape[1]))
            runs.append(QueryRun(torch.arange(count) + row * seq_len + slot, run_keys + row * kv_len,
                                 None if picks is None else picks[row:row + 1, slot:slot + count], ratio, position,
                                 halo))
        return attend_runs(queries, kv, runs, self.sinks, self.scaling, self.sliding_window)

    def compressed_keys(self, x: torch.Tensor, q_residual: torch.Tensor, state: CompressedState,
                        shares: SequenceShares | None = None):
        """Publish (KV source) and select (index source) latents; returns the published latents, None while a row
        has none yet. Under context parallelism the latents pool the whole sequences; the selection is per query."""
        if self.is_kv_source:
            latents = self.compressor(x) if shares is None else \
                self.compressor.pool(shares.whole(self.compressor.project(x)), x.dtype)
            latent_positions = torch.arange(latents.shape[1], device=x.device) * self.ratio  # latent j sits at j * r
            cos, sin = self.compress_rotary(latent_positions, x.dtype)
            state.ratio = self.ratio
            state.index_keys = self.indexer.keys(latents, cos, sin)
            rotated = rotate(latents, cos, sin)
            state.kv = fake_quant_fp4(rotated, 16, True, "the compressed K/V") if self.fake_quant else rotated
        if state.kv is None or state.kv.shape[1] == 0:
            return None
        if self.is_index_source:
            # an activation recompute reuses the forward's picks (masks: no gradient)
            state.candidates, state.selected = kept_for_recompute(lambda: self.pick(x, q_residual, state, shares))
        return state.kv

    @torch.no_grad()  # picks: what the scores feed passes no gradient
    def pick(self, x: torch.Tensor, q_residual: torch.Tensor, state: CompressedState,
             shares: SequenceShares | None = None):
        """(the candidate blocks after this layer, its top-k) from the indexer's scores of this rank's queries:
        [B, S, T] bool masks, or under `attention="fast"` ids, [B, S, kb] of blocks and [B, S, k] of latents (-1: an
        empty slot), scored a chunk of queries at a time so that no [S, T] tensor lives."""
        fast = self.attention == "fast"
        positions = query_positions(x, shares)
        chunk = max(1, PICK_CHUNK_SCORES // (x.shape[0] * state.index_keys.shape[1])) if fast else x.shape[1]
        picks = [self.pick_queries(x[:, part], q_residual[:, part], positions[..., part], state.index_keys,
                                   None if state.candidates is None else state.candidates[:, part], fast)
                 for part in (slice(start, start + chunk) for start in range(0, x.shape[1], chunk))]
        candidates, selected = zip(*picks)
        return (state.candidates if candidates[0] is None else torch.cat(candidates, dim=1)), torch.cat(selected, 1)

    def pick_queries(self, x, q_residual, positions, index_keys, candidates, fast: bool):
        """`pick` for the queries at `positions` ([S] or [B, S]); `candidates`: theirs so far, or None."""
        ratio, block_size, width = self.ratio, self.candidate_block_size, index_keys.shape[1]
        cos, sin = self.compress_rotary(positions, x.dtype)
        visible = (positions[..., None] + 1) // ratio  # latent j < (t + 1) // r
        scores = self.indexer(x, q_residual, index_keys, cos, sin, visible, kernel=fast)
        if self.is_candidate_source:
            candidates = (top_k_ids(candidate_block_scores(scores, visible, block_size), self.candidate_topk_blocks)
                          if fast else select_candidate_blocks(scores, visible, self.candidate_topk_blocks, block_size))
        elif self.uses_candidates and candidates is not None:
            allowed = latents_in_blocks(candidates, width, block_size) if fast else candidates
            scores = scores.masked_fill(~allowed, float("-inf"))
        return candidates, top_k_ids(scores, self.index_topk) if fast else top_k_mask(scores, self.index_topk)
