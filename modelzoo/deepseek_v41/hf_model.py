"""DeepSeek-V4.1 text model for Hugging Face transformers: our reference implementation (no `trust_remote_code`).

It follows DeepSeek's own inference code (the release semantics) and is written as a full-sequence forward
without a cache, for training and as the oracle of the Megatron model. Math, per row of S tokens
(h: [S, N, D] residual streams, N = hc_mult):

  h = embed(x) copied into N streams;  pre = one-hot on stream 0
  per layer l:
    at Engram layers: h_n += gate_n * value, value = wkv(table[hash ids of the 2..N-grams ending here])
    (a_pre, a_post, a_comb) = mixes(h);  x = attn_norm(sum_n pre_n h_n)           <- the previous site's pre
    h = a_post * attn(x) + a_comb^T h
    (f_pre, f_post, f_comb) = mixes(h);  x = ffn_norm(sum_n a_pre_n h_n)            <- the attention site's pre
    h = f_post * moe(x) + f_comb^T h;     pre = f_pre
  logits = head(norm(sum_n pre_n h_n))                                              (no hc_head)

  mixes(h) = one projection of rms(flatten(h)): pre = sigmoid(.) + eps, post = 2 sigmoid(.),
             comb = Sinkhorn(softmax(.) + eps)

  attention: q = wq_b(q_norm(wq_a x)) (no per-head norm), kv = kv_norm(wkv x) is both K and V, RoPE interleaved on
    the last qk_rope_head_dim channels ("main" rope at ratio-0 layers, "compress" rope + YaRN elsewhere).
    One softmax over the sliding window (t - W < u <= t) plus the selected compressed latents, with a per-head
    sink logit in the denominator only; the output is inverse-rotated, then wo_b(grouped wo_a(.)).
  CSA2 roles of a layer with compress ratio r > 0:
    KV source (ratio 2): latent j = norm(sum_{i<2} softmax_i(wgate x_{2j+i}) wkv x_{2j+i}) (fp32, disjoint pairs)
    KV source (ratio 1): latent j = norm(wkv x_j)
      a source publishes its rotated latents and its indexer keys k_norm(wk(latent)), replacing the previous ones
    index source: scores s[t, j] = sum_h w_h(x_t) relu(q_h(t) . k_j) over latents with j < (t + 1) // r, keeps its
      top index_topk; the candidate source also keeps its top candidate_topk_blocks blocks (block score = max,
      the block of the newest latent always kept), and every later index source scores only inside them
    reuse: the compressed K/V of its KV source and the top-k of the last index source
  MoE: s = sqrt(softplus(logits / gate_temp)); experts = top-k(s + bias) (bias_vl at image tokens);
    weights = s / sum * routed_scaling_factor; plus one shared expert; SwiGLU clamped at swiglu_limit.
  DSpark (`mtp.*`, frozen): the stream means of the target layers' inputs -> main_proj -> main_norm give K/V of
    the main positions; each anchor's block [token, noise, ...] attends the last W main positions and its whole
    block, through the draft layers, to head(norm(.)) plus a Markov bias from the previous draft token.

Where transformers main's `modeling_deepseek_v41.py` differs, this follows DeepSeek's code:
  - without a cache, transformers concatenates the compressed K/V and indexer keys of successive KV sources;
    here each source replaces them, as DeepSeek's shared state does;
  - the FP8 / FP4 fake quantisation (window K/V, compressed K/V, indexer q and k) is off unless asked for
    (`fake_quant=True`), and then its gradients pass straight through instead of being rounded;
  - DSpark draft layers are built and run (transformers ignores `mtp.*`);
  - Engram's dead tokens (image tokens, padding) stop the n-gram look-back and shut the gate.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from transformers import AutoModelForCausalLM
from transformers import initialization as init
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import PreTrainedModel

from .config import (
    ENGRAM_SCALE_BLOCK,
    TRANSFORMERS_HAS_DEEPSEEK_V41,
    DeepseekV41Config,
    DeepseekV41TextConfig,
    engram_bucket_primes,
)

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
FP4_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---------------------------------------------------------------------------------------------------------------
# Fake quantisation (opt-in): the values DeepSeek's kernels store, with straight-through gradients
# ---------------------------------------------------------------------------------------------------------------
def _power_of_two_ceiling(value: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= value (value > 0, normal): an E8M0 scale."""
    mantissa, exponent = torch.frexp(value)
    return torch.ldexp(torch.ones_like(value), exponent - (mantissa == 0.5).to(exponent.dtype))


def _round_to_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the FP4 E2M1 grid; `scaled` is already clamped to [-6, 6]."""
    grid = torch.tensor(FP4_E2M1_GRID, device=scaled.device)
    midpoints = (grid[1:] + grid[:-1]) / 2
    magnitude = scaled.abs()
    index = torch.bucketize(magnitude, midpoints)  # a tie lands on the lower grid point
    tie = magnitude == midpoints[index.clamp_max(len(midpoints) - 1)]
    index = index + (tie & (index % 2 == 1)).long()  # ...and moves up when the lower one has an odd code
    return torch.copysign(grid[index], scaled)


def _blocks(x: torch.Tensor, block_size: int, what: str) -> torch.Tensor:
    if x.shape[-1] % block_size:
        raise ValueError(f"fake quantisation of {what} needs its width ({x.shape[-1]}) to be a multiple of "
                         f"{block_size}, the block of one scale.")
    return x.float().unflatten(-1, (-1, block_size))


def _straight_through(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    # forward: the quantised values; backward: identity (rounding the gradients would zero them)
    return x + (quantized.flatten(-2).to(x.dtype) - x).detach()


def fake_quant_fp8(x: torch.Tensor, what: str = "the window K/V") -> torch.Tensor:
    """E4M3 with one power-of-two scale per 32 channels (DeepSeek's `act_quant(.., 32, "ue8m0")`)."""
    blocks = _blocks(x, 32, what)
    scale = _power_of_two_ceiling(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1 / FP8_E4M3_MAX))
    quantized = (blocks / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return _straight_through(x, quantized)


def fake_quant_fp4(x: torch.Tensor, block_size: int, e4m3_scale: bool, what: str) -> torch.Tensor:
    """E2M1 per block: an E4M3 scale per 16 (compressed K/V) or a power-of-two scale per 32 (indexer q, k)."""
    blocks = _blocks(x, block_size, what)
    amax = blocks.abs().amax(-1, keepdim=True)
    if e4m3_scale:
        scale = (amax.clamp_min(FP4_E2M1_MAX * 2.0**-9) / FP4_E2M1_MAX).to(torch.float8_e4m3fn).float()
    else:
        scale = _power_of_two_ceiling(amax.clamp_min(FP4_E2M1_MAX * 2.0**-126) * (1 / FP4_E2M1_MAX))
    quantized = _round_to_e2m1((blocks / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)) * scale
    return _straight_through(x, quantized)


# ---------------------------------------------------------------------------------------------------------------
# Norms and RoPE
# ---------------------------------------------------------------------------------------------------------------
class DeepseekV41RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).to(x.dtype)


def rope_inverse_frequencies(config: DeepseekV41TextConfig, kind: str) -> torch.Tensor:
    """Inverse frequencies of the "main" or "compress" RoPE, with DeepSeek's YaRN (no magnitude scaling):
    dimensions whose wavelength fits the original context keep their frequency, those far beyond it are divided
    by `factor`, with a linear ramp between the beta_fast and beta_slow corrections."""
    parameters = config.rope_parameters[kind]
    dim, base = config.qk_rope_head_dim, parameters["rope_theta"]
    frequencies = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if parameters["rope_type"] == "yarn":
        original = parameters["original_max_position_embeddings"]

        def corrected_dim(rotations: float) -> float:
            return dim * np.log(original / (rotations * 2 * np.pi)) / (2 * np.log(base))

        low = max(int(np.floor(corrected_dim(parameters["beta_fast"]))), 0)
        high = min(int(np.ceil(corrected_dim(parameters["beta_slow"]))), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        frequencies = frequencies / parameters["factor"] * ramp + frequencies * (1 - ramp)
    return frequencies


def rope_table(inverse_frequencies: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.float()[:, None] * inverse_frequencies.to(positions.device)[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2 * cos.shape[-1] channels of x as complex numbers (adjacent pairs). cos/sin: [S, R/2],
    x: [B, S, C] or [B, S, H, C]; `inverse` undoes the rotation."""
    rope_dim = 2 * cos.shape[-1]
    if x.dim() == 4:
        cos, sin = cos[:, None], sin[:, None]
    if inverse:
        sin = -sin
    real, imaginary = x[..., -rope_dim:].float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((real * cos - imaginary * sin, real * sin + imaginary * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# CSA2: compressor, indexer, the state handed down the layers, attention
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class CompressedState:
    """What the layers hand down the stack in one forward (DeepSeek's `SharedAttentionRuntime`)."""

    ratio: int = 0
    kv: torch.Tensor | None = None             # [B, T, head_dim] the last KV source's rotated latents
    index_keys: torch.Tensor | None = None     # [B, T, index_head_dim] its indexer keys
    selected: torch.Tensor | None = None       # [B, S, T] bool, the last index source's top-k
    candidates: torch.Tensor | None = None     # [B, S, T] bool, the candidate source's blocks


class DeepseekV41Compressor(nn.Module):
    """Per-token latents at ratio 1; softmax-gated pooling of disjoint groups of r tokens in fp32 above it.
    Returns the latents before RoPE (the indexer keys are made from them)."""

    def __init__(self, config: DeepseekV41TextConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        self.wgate = nn.Linear(config.hidden_size, config.head_dim, bias=False) if ratio > 1 else None
        self.norm = DeepseekV41RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wgate is None:
            return self.norm(self.wkv(x))
        usable = x.shape[1] // self.ratio * self.ratio  # a trailing partial group is not a latent yet
        kv = F.linear(x[:, :usable].float(), self.wkv.weight.float()).unflatten(1, (-1, self.ratio))
        gate = F.linear(x[:, :usable].float(), self.wgate.weight.float()).unflatten(1, (-1, self.ratio))
        return self.norm((kv * gate.softmax(dim=2)).sum(dim=2).to(x.dtype))


class DeepseekV41Indexer(nn.Module):
    """Scores latents for each query: sum_h w_h relu(q_h . k). Only a KV source owns `wk`/`k_norm` (its keys come
    from its own latents); the other index sources score the published keys with their own queries."""

    def __init__(self, config: DeepseekV41TextConfig, owns_keys: bool):
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = DeepseekV41RMSNorm(self.head_dim, config.rms_norm_eps)

    def keys(self, latents: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fake_quant: bool) -> torch.Tensor:
        keys = apply_rope(self.k_norm(self.wk(latents)), cos, sin)
        return fake_quant_fp4(keys, 32, False, "the indexer keys") if fake_quant else keys

    def forward(self, x, q_residual, keys, cos, sin, fake_quant: bool) -> torch.Tensor:
        """Scores [B, S, T] (fp32) of every query against every latent, visibility not yet applied."""
        queries = self.wq_b(q_residual).unflatten(-1, (self.num_heads, self.head_dim))
        queries = apply_rope(queries, cos, sin)
        if fake_quant:
            queries = fake_quant_fp4(queries, 32, False, "the indexer queries")
        weights = self.weights_proj(x).float() * (self.head_dim**-0.5 * self.num_heads**-0.5)
        scores = torch.einsum("bshd,btd->bsht", queries.float(), keys.float()).relu()
        return (scores * weights[..., None]).sum(dim=2)


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """A bool mask of the k best finite entries along the last dim. Ties go to the lower index (a stable sort):
    scores are often exactly equal (every head's relu at 0), and torch.topk would then pick by the tensor's
    width, so a query's choice would change when the row grows."""
    order = scores.sort(dim=-1, descending=True, stable=True)
    chosen, finite = order.indices[..., :k], order.values[..., :k] > float("-inf")
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, finite)


def candidate_block_scores(scores: torch.Tensor, visible: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each block of `block_size` latents scored by its best latent, +inf for the block of the query's newest visible
    latent (always kept: it is partly filled and holds the most recent tokens). scores: [B, S, T] with -inf where not
    visible; visible: [S, 1] counts of visible latents. Returns [B, S, ceil(T / block_size)]."""
    block_scores = F.pad(scores, (0, -scores.shape[-1] % block_size), value=float("-inf"))
    block_scores = block_scores.unflatten(-1, (-1, block_size)).amax(dim=-1)
    newest = (visible - 1) // block_size  # -1 (no block) while nothing is visible
    block_ids = torch.arange(block_scores.shape[-1], device=scores.device)
    return block_scores.masked_fill(block_ids == newest, float("inf"))


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int):
    """First level of the two-level top-k: the `topk_blocks` best blocks per query (`candidate_block_scores`).
    Returns a [B, S, T] bool mask of their latents."""
    keep = top_k_mask(candidate_block_scores(scores, visible, block_size), topk_blocks)
    return keep.repeat_interleave(block_size, dim=-1)[..., :scores.shape[-1]]


class DeepseekV41Attention(nn.Module):
    """Shared-latent attention over the sliding window plus, for ratio > 0, the selected compressed latents."""

    def __init__(self, config: DeepseekV41TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.o_groups, self.o_lora_rank = config.o_groups, config.o_lora_rank
        self.sliding_window = config.sliding_window
        self.ratio = config.compress_ratios[layer_idx]
        backbone = layer_idx < config.num_hidden_layers
        self.is_kv_source = backbone and layer_idx in config.kv_source_layer_ids
        self.is_index_source = backbone and layer_idx in config.index_source_layer_ids
        self.is_candidate_source = backbone and layer_idx == config.candidate_source_layer_id
        # the restriction to the candidate blocks; tests switch it off to show that it matters
        self.uses_candidates = backbone and 0 <= config.candidate_source_layer_id < layer_idx
        self.reads_compressed = self.ratio > 0  # False: window only (ratio 0, or a test removing reuse)
        self.rope = "compress" if self.ratio else "main"
        self.candidate_topk_blocks = config.candidate_topk_blocks
        self.candidate_block_size = config.candidate_block_size
        self.index_topk = config.index_topk

        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = DeepseekV41RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = DeepseekV41RMSNorm(self.head_dim, config.rms_norm_eps)
        # block-diagonal: group g of o_groups projects only its own heads to o_lora_rank
        self.wo_a = nn.Linear(self.num_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora_rank,
                              bias=False)
        self.wo_b = nn.Linear(self.o_groups * self.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads))
        self.compressor = DeepseekV41Compressor(config, self.ratio) if self.is_kv_source else None
        self.indexer = DeepseekV41Indexer(config, owns_keys=self.is_kv_source) if self.is_index_source else None

    def project_kv(self, x: torch.Tensor, cos, sin, fake_quant: bool) -> torch.Tensor:
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        return fake_quant_fp8(kv) if fake_quant else kv

    def project_q(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        q_residual = self.q_norm(self.wq_a(x))
        queries = self.wq_b(q_residual).unflatten(-1, (self.num_heads, self.head_dim))
        return apply_rope(queries, cos, sin), q_residual

    def output(self, attended: torch.Tensor, cos, sin) -> torch.Tensor:
        """Undo the query's rotation (K = V carried RoPE), then wo_b(grouped wo_a)."""
        attended = apply_rope(attended, cos, sin, inverse=True)
        grouped = attended.flatten(-2).unflatten(-1, (self.o_groups, -1))
        wo_a = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)
        return self.wo_b(torch.einsum("...gd,grd->...gr", grouped, wo_a).flatten(-2))

    def attend(self, queries, keys, allowed) -> torch.Tensor:
        """softmax over [allowed keys, sink] of q.k / sqrt(head_dim), sink dropped: queries [..., Q, H, D],
        keys [..., K, D] (one K = V head), allowed [..., Q, K] -> [..., Q, H, D]."""
        logits = torch.einsum("...qhd,...kd->...hqk", queries.float(), keys.float()) * self.head_dim**-0.5
        logits = logits.masked_fill(~allowed.unsqueeze(-3), float("-inf"))
        sink = self.attn_sink.float().view(-1, 1, 1).expand(*logits.shape[:-1], 1)
        probabilities = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("...hqk,...kd->...qhd", probabilities, keys.float()).to(queries.dtype)

    def forward(self, x, ropes: dict, state: CompressedState, fake_quant: bool) -> torch.Tensor:
        seq_len = x.shape[1]
        cos, sin = ropes[self.rope]
        cos, sin = cos[:seq_len], sin[:seq_len]
        queries, q_residual = self.project_q(x, cos, sin)
        keys = self.project_kv(x, cos, sin, fake_quant)
        positions = torch.arange(seq_len, device=x.device)
        offset = positions[:, None] - positions[None, :]
        allowed = (offset >= 0) & (offset < self.sliding_window)  # [S, S]
        allowed = allowed.expand(x.shape[0], -1, -1)
        if self.reads_compressed:
            compressed = self.compressed_keys(x, q_residual, ropes, state, fake_quant)
            if compressed is not None:
                keys = torch.cat((keys, compressed), dim=1)
                allowed = torch.cat((allowed, state.selected), dim=-1)
        return self.output(self.attend(queries, keys, allowed), cos, sin)

    def compressed_keys(self, x, q_residual, ropes, state: CompressedState, fake_quant: bool):
        """Publish (KV source) and select (index source) compressed latents; returns the shared latents."""
        cos, sin = ropes["compress"]
        seq_len, ratio = x.shape[1], self.ratio
        if self.is_kv_source:
            latents = self.compressor(x)
            latent_cos, latent_sin = cos[: latents.shape[1] * ratio : ratio], sin[: latents.shape[1] * ratio : ratio]
            state.ratio = ratio
            state.index_keys = self.indexer.keys(latents, latent_cos, latent_sin, fake_quant)
            rotated = apply_rope(latents, latent_cos, latent_sin)  # latent j sits at position j * ratio
            state.kv = fake_quant_fp4(rotated, 16, True, "the compressed K/V") if fake_quant else rotated
        if state.kv is None or state.kv.shape[1] == 0:
            return None
        if self.is_index_source:
            scores = self.indexer(x, q_residual, state.index_keys, cos[:seq_len], sin[:seq_len], fake_quant)
            visible = (torch.arange(seq_len, device=x.device)[:, None] + 1) // ratio  # latent j < (t + 1) // r
            scores = scores.masked_fill(torch.arange(scores.shape[-1], device=x.device) >= visible, float("-inf"))
            if self.is_candidate_source:
                state.candidates = select_candidate_blocks(scores, visible, self.candidate_topk_blocks,
                                                           self.candidate_block_size)
            elif self.uses_candidates and state.candidates is not None:
                scores = scores.masked_fill(~state.candidates, float("-inf"))
            state.selected = top_k_mask(scores, self.index_topk)
        return state.kv


# ---------------------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------------------
class DeepseekV41Expert(nn.Module):
    """SwiGLU; with swiglu_limit > 0 the up branch is clamped on both sides and the gate branch from above."""

    def __init__(self, config: DeepseekV41TextConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.moe_intermediate_size, bias=False)
        self.w2 = nn.Linear(config.moe_intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.moe_intermediate_size, bias=False)
        self.swiglu_limit = config.swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.swiglu_limit > 0:
            up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
            gate = gate.clamp(max=self.swiglu_limit)
        hidden = F.silu(gate) * up
        if weights is not None:
            hidden = weights * hidden
        return self.w2(hidden.to(x.dtype))


class DeepseekV41Router(nn.Module):
    """The bias (bias_vl at image tokens) picks the experts but does not weight them."""

    def __init__(self, config: DeepseekV41TextConfig, num_experts: int, top_k: int):
        super().__init__()
        self.top_k, self.scoring_func, self.gate_temp = top_k, config.scoring_func, config.gate_temp
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None):
        logits = F.linear(x.float(), self.weight.float()) / self.gate_temp
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        bias = self.bias if image_mask is None else torch.where(image_mask[:, None], self.bias_vl, self.bias)
        experts = (scores + bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # 1e-20, not rms_norm_eps: as trained
        return weights * self.routed_scaling_factor, experts


class DeepseekV41MoE(nn.Module):
    def __init__(self, config: DeepseekV41TextConfig, num_experts: int, top_k: int):
        super().__init__()
        self.gate = DeepseekV41Router(config, num_experts, top_k)
        self.experts = nn.ModuleList(DeepseekV41Expert(config) for _ in range(num_experts))
        self.shared_experts = DeepseekV41Expert(config)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat, None if image_mask is None else image_mask.reshape(-1))
        routed = torch.zeros(flat.shape, dtype=torch.float32, device=x.device)
        for expert_id, expert in enumerate(self.experts):
            tokens, slot = torch.where(experts == expert_id)
            if len(tokens):
                routed = routed.index_add(0, tokens, expert(flat[tokens], weights[tokens, slot, None]).float())
        return (routed + self.shared_experts(flat).float()).to(x.dtype).view(x.shape)


# ---------------------------------------------------------------------------------------------------------------
# Engram
# ---------------------------------------------------------------------------------------------------------------
def build_engram_token_map(tokenizer_file: str | Path) -> tuple[list[int], int]:
    """The normalised vocabulary from a tokenizer.json (read with the `tokenizers` library, no remote code): each
    token id -> the id of its class, where tokens that read alike after NFKC, NFD, accent stripping, lowercasing
    and whitespace collapsing share a class (" The", "the", "THE"). Returns (map, number of classes)."""
    from tokenizers import Regex, Tokenizer, normalizers

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    one_space = "\ue000"  # a token that is exactly one space keeps it instead of being stripped to ""
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), one_space),
        normalizers.Strip(), normalizers.Replace(one_space, " "),
    ])
    classes: dict[str, int] = {}
    token_map = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        # a partial UTF-8 byte decodes to U+FFFD: it is keyed by its raw token instead
        key = tokenizer.id_to_token(token_id) if "\ufffd" in text else (normalizer.normalize_str(text) or text)
        token_map.append(classes.setdefault(key, len(classes)))
    return token_map, len(classes)


class DeepseekV41NgramHasher(nn.Module):
    """Hash ids [B, S, engram layers, (max_ngram - 1) * heads] of the 2..N-grams ending at each position, over the
    normalised vocabulary. Token ids are mapped to their class, multiplied by a per-(layer, look-back) odd
    multiplier and XOR-ed one look-back at a time; each n-gram size is taken modulo its heads' primes and shifted
    to the head's row range. Slots before the row start or at and beyond a dead token read the pad token's class."""

    DEAD = -1

    def __init__(self, config: DeepseekV41TextConfig):
        super().__init__()
        # plain lists, made into tensors on the input's device: transformers builds models on the meta device
        self.primes = engram_bucket_primes(config)  # [layer][n-gram size - 2][head]
        self.offsets = [np.cumsum([0, *[p for heads in layer for p in heads][:-1]]).tolist() for layer in self.primes]
        self.multipliers = self.hash_multipliers(config)
        self.max_ngram = config.engram_max_ngram_size
        self.pad_id, self.compressed_vocab_size = config.engram_pad_id, config.engram_compressed_vocab_size
        # set from the checkpoint's tokenizer (`set_token_map`); a forward without it is refused
        self.register_buffer("token_map", torch.empty(0, dtype=torch.long), persistent=False)

    @staticmethod
    def hash_multipliers(config: DeepseekV41TextConfig) -> list[list[int]]:
        """Odd multipliers from numpy's PCG64 seeded with 10007 * layer id (the release's), bounded so that
        class id * multiplier fits in int64."""
        bound = max(1, (np.iinfo(np.int64).max // config.engram_compressed_vocab_size) // 2)
        return [(np.random.default_rng(10007 * layer).integers(0, bound, size=(config.engram_max_ngram_size,),
                                                                dtype=np.int64) * 2 + 1).tolist()
                for layer in config.engram_layer_ids]

    def set_token_map(self, token_map) -> None:
        token_map = torch.as_tensor(token_map, dtype=torch.long)
        if token_map.dim() != 1 or len(token_map) == 0:
            raise ValueError("the Engram token map must be one class id per token id.")
        classes = int(token_map.max()) + 1
        if int(token_map.min()) < 0 or classes != self.compressed_vocab_size or len(
                torch.unique(token_map)) != classes:
            raise ValueError(f"the Engram token map has {len(torch.unique(token_map))} classes numbered "
                             f"{int(token_map.min())}..{classes - 1}, but engram_compressed_vocab_size is "
                             f"{self.compressed_vocab_size}: every hash multiplier depends on it.")
        if self.pad_id >= len(token_map):
            raise ValueError(f"the Engram token map covers {len(token_map)} token ids, not engram_pad_id "
                             f"({self.pad_id}).")
        self.token_map = token_map

    def forward(self, input_ids: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
        if len(self.token_map) == 0:
            raise ValueError("the Engram layers need the normalised vocabulary of the checkpoint's tokenizer: load "
                             "the model from a folder with tokenizer.json, or call model.set_engram_token_map(map) "
                             "with build_engram_token_map(tokenizer_file)[0].")
        if int(input_ids.max()) >= len(self.token_map):
            raise ValueError(f"token id {int(input_ids.max())} is beyond the tokenizer's {len(self.token_map)} "
                             "tokens, so it has no Engram class.")
        classes = self.token_map.to(input_ids.device)[input_ids]
        if dead is not None:
            classes = classes.masked_fill(dead, self.DEAD)
        pad = int(self.token_map[self.pad_id])
        blocked = torch.zeros_like(classes, dtype=torch.bool)
        looked_back = []
        for shift in range(self.max_ngram):
            source = F.pad(classes, (shift, 0), value=self.DEAD)[:, : classes.shape[1]]
            blocked = blocked | (source == self.DEAD)
            looked_back.append(source.masked_fill(blocked, pad))
        device = input_ids.device
        multipliers = torch.tensor(self.multipliers, device=device)  # [layers, N]
        primes = torch.tensor(self.primes, device=device)  # [layers, N - 1, heads]
        products = torch.stack(looked_back, dim=-1)[:, :, None, :] * multipliers  # [B, S, layers, N]
        rolling, hashes = products[..., 0], []
        for n in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., n])  # now the hash of the (n + 1)-gram
            hashes.append(rolling[..., None] % primes[:, n - 1])
        return torch.cat(hashes, dim=-1) + torch.tensor(self.offsets, device=device)


class DeepseekV41EngramEmbedding(nn.Module):
    """A hash table; in the release FP8 rows with one E8M0 scale per 32 channels, dequantised on lookup. A table
    in a float dtype is used as it is (FP8 values are exact in bf16 and fp32)."""

    def __init__(self, num_embeddings: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_embeddings, head_dim))
        self.scale = nn.Parameter(torch.ones(num_embeddings, head_dim // ENGRAM_SCALE_BLOCK))

    def forward(self, hash_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(hash_ids, self.weight)
        if self.weight.dtype == torch.float8_e4m3fn:
            scales = F.embedding(hash_ids, self.scale).float()
            rows = (rows.float().unflatten(-1, (-1, ENGRAM_SCALE_BLOCK)) * scales[..., None]).flatten(-2)
        return rows


class DeepseekV41Engram(nn.Module):
    """h_n += sigmoid(signed_sqrt(<h_n, q_n k_n key_n> / (rms(h_n) rms(key_n) sqrt(D)))) * value, with one key per
    stream and one shared value from wkv(the looked-up rows); dead tokens keep their streams."""

    def __init__(self, config: DeepseekV41TextConfig, num_embeddings: int):
        super().__init__()
        self.hidden_size, self.hc_mult, self.eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        hash_columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.embed = DeepseekV41EngramEmbedding(num_embeddings, config.engram_head_dim)
        self.wkv = nn.Linear(hash_columns * config.engram_head_dim, config.hidden_size * (config.hc_mult + 1),
                             bias=False)
        self.q_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size))

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
        rows = self.embed(hash_ids).flatten(-2).to(self.wkv.weight.dtype)
        key, value = self.wkv(rows).split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.hidden_size))
        h = streams.float()
        # normalised per (token, stream) over D, not jointly over the streams
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.hidden_size**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if dead is not None:
            gate = gate.masked_fill(dead[..., None], 0.0)
        return (h + gate[..., None] * value.float()[..., None, :]).to(streams.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Blocks with single-pass manifold hyper-connections
# ---------------------------------------------------------------------------------------------------------------
class DeepseekV41DecoderLayer(nn.Module):
    """Each site (attention, FFN) makes (pre, post, comb) from one projection of its input streams; its input is
    collapsed with the *previous* site's pre, and its own pre goes to the next site."""

    def __init__(self, config: DeepseekV41TextConfig, layer_idx: int, num_experts: int, top_k: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps = config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.attn = DeepseekV41Attention(config, layer_idx)
        self.ffn = DeepseekV41MoE(config, num_experts, top_k)
        self.attn_norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps)
        mixes, width = (2 + config.hc_mult) * config.hc_mult, config.hc_mult * config.hidden_size
        self.hc_attn_fn = nn.Parameter(torch.zeros(mixes, width, dtype=torch.float32))
        self.hc_attn_base = nn.Parameter(torch.zeros(mixes, dtype=torch.float32))
        self.hc_attn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mixes, width, dtype=torch.float32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mixes, dtype=torch.float32))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def hc_mixes(self, streams, fn, scale, base):
        """(pre [.., N], post [.., N], comb [.., N, N]) from one projection of the RMS-normalised flat streams."""
        n = self.hc_mult
        flat = streams.flatten(-2).float()
        mixes = F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(mixes[..., n: 2 * n] * scale[1] + base[n: 2 * n])
        comb = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n)).softmax(dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    @staticmethod
    def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return (pre[..., None] * streams.float()).sum(dim=-2).to(streams.dtype)

    @staticmethod
    def hc_expand(output, residual, post, comb) -> torch.Tensor:
        """stream k = post_k * output + sum_j comb[j, k] * residual_j"""
        mixed = torch.einsum("...jk,...jd->...kd", comb, residual.float())
        return (post[..., None] * output.float()[..., None, :] + mixed).to(residual.dtype)

    def forward(self, streams, previous_pre, *, attention, ffn_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """`attention(x)` runs this layer's attention on the collapsed, normalised input (the backbone and the
        DSpark layers feed it different keys); returns the new streams and the FFN site's pre."""
        attn_pre, attn_post, attn_comb = self.hc_mixes(streams, self.hc_attn_fn, self.hc_attn_scale,
                                                       self.hc_attn_base)
        output = attention(self.attn_norm(self.hc_collapse(streams, previous_pre)))
        streams = self.hc_expand(output, streams, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.hc_mixes(streams, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        output = self.ffn(self.ffn_norm(self.hc_collapse(streams, attn_pre)), **ffn_kwargs)
        return self.hc_expand(output, streams, ffn_post, ffn_comb), ffn_pre


class DeepseekV41BackboneLayer(DeepseekV41DecoderLayer):
    """A backbone layer: optionally an Engram lookup (run by the model before the block), then the block."""

    def __init__(self, config: DeepseekV41TextConfig, layer_idx: int):
        super().__init__(config, layer_idx, config.n_routed_experts, config.num_experts_per_tok)
        engram_ids = config.engram_layer_ids
        self.engram = (DeepseekV41Engram(config, config.engram_num_embeddings[engram_ids.index(layer_idx)])
                       if layer_idx in engram_ids else None)


# ---------------------------------------------------------------------------------------------------------------
# DSpark draft layers
# ---------------------------------------------------------------------------------------------------------------
class DeepseekV41MarkovHead(nn.Module):
    def __init__(self, config: DeepseekV41TextConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.dspark_markov_rank)
        self.head = nn.Linear(config.dspark_markov_rank, config.vocab_size, bias=False)

    def forward(self, previous_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logit bias from the previous draft token, its embedding)"""
        embedding = self.embed(previous_ids)
        return F.linear(embedding.float(), self.head.weight.float()), embedding


class DeepseekV41ConfidenceHead(nn.Module):
    def __init__(self, config: DeepseekV41TextConfig):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size + config.dspark_markov_rank, 1, bias=False)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        joined = torch.cat((hidden, markov_embedding.to(hidden.dtype)), dim=-1)
        return F.linear(joined.float(), self.proj.weight.float()).squeeze(-1)


class DeepseekV41DSparkLayer(DeepseekV41DecoderLayer):
    """`mtp.{stage}`: a sliding-window block with its own MoE. Stage 0 also owns main_proj / main_norm, the last
    stage the final norm and the Markov and confidence heads."""

    def __init__(self, config: DeepseekV41TextConfig, stage: int):
        super().__init__(config, config.num_hidden_layers + stage, config.dspark_n_routed_experts,
                         config.dspark_num_experts_per_tok)
        if stage == 0:
            self.main_proj = nn.Linear(config.hidden_size * len(config.dspark_target_layer_ids), config.hidden_size,
                                       bias=False)
            self.main_norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps)
        if stage == config.num_nextn_predict_layers - 1:
            self.norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.markov_head = DeepseekV41MarkovHead(config)
            self.confidence_head = DeepseekV41ConfidenceHead(config)

    def draft_attention(self, x, main_x, ropes, fake_quant: bool) -> torch.Tensor:
        """x: [B, S, K, D] the block of each anchor t (positions t+1..t+K); main_x: [B, S, D]. Each block query
        attends the main K/V of positions t-W+1..t and every K/V of its own block."""
        attn = self.attn
        seq_len, block = x.shape[1], x.shape[2]
        cos, sin = ropes["main"]
        main_kv = attn.project_kv(main_x, cos[:seq_len], sin[:seq_len], fake_quant)  # [B, S, D]
        block_positions = torch.arange(seq_len, device=x.device)[:, None] + 1 + torch.arange(block, device=x.device)
        block_cos, block_sin = cos[block_positions], sin[block_positions]  # [S, K, R/2]
        flat_cos, flat_sin = block_cos.flatten(0, 1), block_sin.flatten(0, 1)
        queries, _ = attn.project_q(x.flatten(1, 2), flat_cos, flat_sin)
        block_kv = attn.project_kv(x.flatten(1, 2), flat_cos, flat_sin, fake_quant)
        queries = queries.unflatten(1, (seq_len, block))  # [B, S, K, H, D]
        block_kv = block_kv.unflatten(1, (seq_len, block))  # [B, S, K, D]
        anchors = torch.arange(seq_len, device=x.device)
        offset = anchors[:, None] - anchors[None, :]
        window = (offset >= 0) & (offset < attn.sliding_window)  # [S anchors, S main positions]
        keys = torch.cat((main_kv[:, None].expand(-1, seq_len, -1, -1), block_kv), dim=2)  # [B, S, S + K, D]
        allowed = torch.cat((window[:, None, :].expand(-1, block, -1),
                             window.new_ones(seq_len, block, block)), dim=-1)  # [S, K, S + K]
        attended = attn.attend(queries, keys, allowed)  # [B, S, K, H, D]
        return attn.output(attended.flatten(1, 2), flat_cos, flat_sin).unflatten(1, (seq_len, block))


@dataclasses.dataclass
class DeepseekV41CausalLMOutput(ModelOutput):
    """logits [B, S, V]; with `draft_anchor_ids`, the DSpark block of each position t (the tokens after the anchor
    at t+1): draft_logits [B, S, K, V], draft_confidence [B, S, K] and the draft token ids [B, S, K] whose Markov
    biases were used (slot i's bias comes from the token before it: the anchor, then draft_ids[..., :i])."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    draft_logits: torch.Tensor | None = None
    draft_confidence: torch.Tensor | None = None
    draft_ids: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------
class DeepseekV41PreTrainedModel(PreTrainedModel):
    config_class = DeepseekV41TextConfig
    base_model_prefix = "model"
    _no_split_modules = ["DeepseekV41BackboneLayer", "DeepseekV41DSparkLayer"]
    # the vision tower, the aligner and the image delimiters are not part of the text model
    _keys_to_ignore_on_load_unexpected = [r"^vision\..*", r"^aligner\..*", r"^image_(start|end|newline)$"]
    # the tensors the release stores in fp32
    _keep_in_fp32_modules_strict = ["hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
                                    "hc_ffn_scale", "attn_sink", "bias", "bias_vl"]

    @torch.no_grad()
    def _init_weights(self, module):
        # transformers' init functions skip tensors a checkpoint has already filled
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DeepseekV41RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DeepseekV41Router):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias)
            init.zeros_(module.bias_vl)
        elif isinstance(module, DeepseekV41Attention):
            init.zeros_(module.attn_sink)
        elif isinstance(module, DeepseekV41EngramEmbedding):
            init.normal_(module.weight, mean=0.0, std=std)
            init.ones_(module.scale)
        elif isinstance(module, DeepseekV41Engram):
            init.ones_(module.q_weight)
            init.ones_(module.k_weight)
        if isinstance(module, DeepseekV41DecoderLayer):
            for site in ("attn", "ffn"):
                init.normal_(getattr(module, f"hc_{site}_fn"), mean=0.0, std=std)
                init.zeros_(getattr(module, f"hc_{site}_base"))
                init.ones_(getattr(module, f"hc_{site}_scale"))


class DeepseekV41TextModel(DeepseekV41PreTrainedModel):
    def __init__(self, config: DeepseekV41TextConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV41BackboneLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.engram_hasher = DeepseekV41NgramHasher(config) if config.engram_layer_ids else None
        self.post_init()

    def rope_tables(self, length: int, device) -> dict:
        """cos/sin [length, qk_rope_head_dim / 2] of both RoPEs (computed per forward: a model built on the meta
        device by transformers' loading would never fill buffers made in __init__)."""
        positions = torch.arange(length, device=device)
        return {kind: rope_table(rope_inverse_frequencies(self.config, kind), positions)
                for kind in ("main", "compress")}

    def forward(self, input_ids, dead=None, image_mask=None, fake_quant=False, rope_length=None):
        """Returns the final hidden states [B, S, D] and the stream means of the DSpark target layers' inputs
        [B, S, len(targets) * D] (None without draft layers)."""
        config = self.config
        batch, seq_len = input_ids.shape
        ropes = self.rope_tables(rope_length or seq_len, input_ids.device)
        streams = self.embed(input_ids)[:, :, None, :].expand(-1, -1, config.hc_mult, -1)
        pre = torch.zeros(batch, seq_len, config.hc_mult, device=input_ids.device)
        pre[..., 0] = 1.0  # the first site reads stream 0
        hash_ids = self.engram_hasher(input_ids, dead) if self.engram_hasher is not None else None
        state = CompressedState()
        targets = []
        for layer in self.layers:
            if layer.engram is not None:
                engram_index = config.engram_layer_ids.index(layer.layer_idx)
                streams = layer.engram(streams, hash_ids[:, :, engram_index], dead)
            if layer.layer_idx in config.dspark_target_layer_ids:
                targets.append(streams.mean(dim=2))  # the attention input of the layer, not its output
            streams, pre = layer(
                streams, pre,
                attention=lambda x, attn=layer.attn: attn(x, ropes, state, fake_quant),
                ffn_kwargs={"image_mask": image_mask})
        hidden = self.norm(DeepseekV41DecoderLayer.hc_collapse(streams, pre))
        return hidden, (torch.cat(targets, dim=-1) if targets and config.num_nextn_predict_layers else None)


class DeepseekV41ForCausalLM(DeepseekV41PreTrainedModel):
    """The text model, its head and the DSpark draft layers (`mtp.*`). Frozen by default (requires_grad False):
    the DSpark layers (trained after pre-training with the backbone frozen), the Engram tables (trainable on
    request), the router biases (they steer selection and get no gradient) and the indexers (their scores only
    feed a top-k, which passes no gradient)."""

    config_class = DeepseekV41Config

    def __init__(self, config: DeepseekV41Config | DeepseekV41TextConfig):
        super().__init__(config.get_text_config())
        text = self.config
        self.model = DeepseekV41TextModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.mtp = nn.ModuleList(DeepseekV41DSparkLayer(text, stage) for stage in range(text.num_nextn_predict_layers))
        self.post_init()
        self.freeze_defaults()

    def freeze_defaults(self) -> None:
        for name, parameter in self.named_parameters():
            frozen = (name.startswith("mtp.") or ".engram.embed." in name or name.endswith((".gate.bias", ".bias_vl"))
                      or ".indexer." in name)
            parameter.requires_grad_(not frozen)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' loading, then the frozen defaults and, for Engram, the normalised vocabulary of the
        folder's tokenizer.json (read as data, no remote code). With `output_loading_info=True`, (model, info).
        A release checkpoint (native names, FP8 / FP4 weights: release.py) is read as transformers main reads it,
        renamed and dequantised (`_from_release`)."""
        loaded = cls._from_release(pretrained_model_name_or_path, kwargs.get("dtype"),
                                   kwargs.get("output_loading_info", False))
        if loaded is None:
            loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if kwargs.get("output_loading_info") else loaded
        model.freeze_defaults()
        tokenizer_file = Path(pretrained_model_name_or_path) / "tokenizer.json"
        if model.model.engram_hasher is not None and tokenizer_file.is_file():
            model.set_engram_token_map(build_engram_token_map(tokenizer_file)[0])
        return loaded

    @classmethod
    def _from_release(cls, folder, dtype: torch.dtype | None, output_loading_info: bool):
        """The model of a release checkpoint folder (native names or quantised weights), its tensors read through
        release.py's view (renamed to this model's names, dequantised exactly); None for any other checkpoint.
        Every tensor is accounted for as transformers would: missing, unexpected and mis-shaped ones are reported
        in the loading info (the vision tower, aligner and image delimiters are ignored, as on the HF path)."""
        import json

        from modelzoo.conversion.safetensors_io import INDEX_FILE, SINGLE_FILE
        from modelzoo.deepseek_v4.release.checkpoint import checkpoint_view
        from modelzoo.deepseek_v41.release import DEEPSEEK_V41

        folder = Path(folder)
        if not ((folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()):
            return None
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        view = checkpoint_view(folder, dtype, release=DEEPSEEK_V41)
        try:
            if not (view.quantized or DEEPSEEK_V41.is_native(view.reader.names())):
                return None
            config = json.loads((folder / "config.json").read_text())
            config.pop("quantization_config", None)
            model = cls(cls.config_class.from_dict(config)).to(dtype)
            expected = model.state_dict()
            ignored = [re.compile(pattern) for pattern in cls._keys_to_ignore_on_load_unexpected]
            names = [name for name in view.names() if not any(pattern.match(name) for pattern in ignored)]
            unexpected = sorted(set(names) - set(expected))
            mismatched = sorted(name for name in names if name in expected
                                and tuple(view.shape(name)) != tuple(expected[name].shape))
            state = {name: view.get(name) for name in names if name in expected and name not in mismatched}
            missing = sorted(set(expected) - set(state) - set(mismatched))
            model.load_state_dict(state, strict=False)
        finally:
            view.close()
        model.eval()
        info = {"missing_keys": missing, "unexpected_keys": unexpected, "mismatched_keys": mismatched,
                "error_msgs": []}
        return (model, info) if output_loading_info else model

    def set_engram_token_map(self, token_map) -> None:
        """The normalised vocabulary (one class id per token id) the Engram hashes run over."""
        self.model.engram_hasher.set_token_map(token_map)

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, image_mask: torch.Tensor | None = None,
                fake_quant: bool = False, draft_anchor_ids: torch.LongTensor | None = None,
                draft_ids: torch.LongTensor | None = None, use_cache: bool | None = None,
                **kwargs) -> DeepseekV41CausalLMOutput:
        """input_ids [B, S]. attention_mask [B, S]: 1 for tokens, 0 for padding after them (right padding only:
        latents pool fixed positions from the row start). image_mask [B, S] bool: image tokens (routing bias
        bias_vl, dead for Engram). fake_quant: the release's FP8 / FP4 storage of K/V and indexer q, k.
        draft_anchor_ids [B, S]: the token at position t+1 for each t, to run the DSpark layers; draft_ids
        [B, S, K-1]: the draft tokens whose Markov biases to use (default: the greedy choice of each slot).
        use_cache: accepted for transformers' callers; the forward is always the full sequence, without a cache."""
        if kwargs:
            raise TypeError(f"DeepseekV41ForCausalLM.forward does not take {sorted(kwargs)}.")
        dead = self._dead_tokens(input_ids, attention_mask, image_mask)
        block = self.config.dspark_block_size if draft_anchor_ids is not None else 0
        hidden, targets = self.model(input_ids, dead, image_mask, fake_quant,
                                     rope_length=input_ids.shape[1] + block)
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        output = DeepseekV41CausalLMOutput(loss=loss, logits=logits)
        if draft_anchor_ids is not None:
            if targets is None:
                raise ValueError("draft_anchor_ids needs DSpark layers (num_nextn_predict_layers > 0).")
            output.draft_logits, output.draft_confidence, output.draft_ids = self.draft(
                targets, draft_anchor_ids, draft_ids, input_ids.shape[1] + block, fake_quant)
        return output

    @staticmethod
    def _dead_tokens(input_ids, attention_mask, image_mask) -> torch.Tensor | None:
        dead = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask must be [batch, seq] = {list(input_ids.shape)}, got "
                                 f"{list(attention_mask.shape)}.")
            tokens = attention_mask.bool()
            if (tokens[:, 1:] & ~tokens[:, :-1]).any():
                raise ValueError("attention_mask must be right-padded (ones, then zeros, in every row): latents "
                                 "pool fixed positions from the row start, so left padding would shift every group.")
            dead = ~tokens
        if image_mask is not None:
            if image_mask.shape != input_ids.shape or image_mask.dtype != torch.bool:
                raise ValueError(f"image_mask must be a bool [batch, seq] = {list(input_ids.shape)} tensor.")
            dead = image_mask if dead is None else dead | image_mask
        return dead

    def draft(self, targets, anchor_ids, draft_ids, rope_length: int, fake_quant: bool):
        """The DSpark forward for every anchor position: (logits [B, S, K, V], confidence [B, S, K], ids)."""
        config, first, last = self.config, self.mtp[0], self.mtp[-1]
        batch, seq_len = anchor_ids.shape
        block = config.dspark_block_size
        ropes = self.model.rope_tables(rope_length, anchor_ids.device)
        main_x = first.main_norm(first.main_proj(targets))
        block_ids = torch.full((batch, seq_len, block), config.dspark_noise_token_id, device=anchor_ids.device)
        block_ids[..., 0] = anchor_ids
        streams = self.model.embed(block_ids)[..., None, :].expand(-1, -1, -1, config.hc_mult, -1)
        pre = torch.zeros(*streams.shape[:-1], device=streams.device)
        pre[..., 0] = 1.0
        for layer in self.mtp:
            streams, pre = layer(
                streams, pre,
                attention=lambda x, layer=layer: layer.draft_attention(x, main_x, ropes, fake_quant),
                ffn_kwargs={"image_mask": None})  # drafts are text
        hidden = DeepseekV41DecoderLayer.hc_collapse(streams, pre)
        logits = self.lm_head(last.norm(hidden)).float()
        previous = anchor_ids
        chosen, embeddings = [], []
        for slot in range(block):
            bias, embedding = last.markov_head(previous)
            logits[:, :, slot] += bias
            embeddings.append(embedding)
            previous = logits[:, :, slot].argmax(-1) if draft_ids is None or slot == block - 1 else draft_ids[..., slot]
            chosen.append(previous)
        confidence = last.confidence_head(hidden, torch.stack(embeddings, dim=2))
        return logits, confidence, torch.stack(chosen, dim=-1)


if not TRANSFORMERS_HAS_DEEPSEEK_V41:
    AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)

__all__ = ["DeepseekV41ForCausalLM", "DeepseekV41TextModel", "DeepseekV41PreTrainedModel",
           "DeepseekV41CausalLMOutput", "build_engram_token_map", "fake_quant_fp4", "fake_quant_fp8"]
