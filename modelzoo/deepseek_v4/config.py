"""DeepSeek-V4: the Hugging Face `DeepseekV4Config` -> what the Megatron modules need.

`DeepseekV4Args` is a flat, frozen description of the architecture read once from the HF config
(transformers' own `DeepseekV4Config` class is the schema). `transformer_config_fields` gives the
Megatron `TransformerConfig` fields the parallel layers read (sizes, init, parallel flags).
The RoPE tables (plain for sliding layers, YaRN for compressed layers) are computed here, with the
formulas of transformers' `modeling_rope_utils` for the two rope types V4 uses.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from transformers import DeepseekV4Config

from modelzoo.conversion.validation import Bounds
from modelzoo.provider import SWIGLU_RMSNORM_FIELDS

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"
# the MTP block is a sliding-window layer with a learned (non-hash) router: the release's MTP tensors have no
# compressor/indexer and a gate bias; transformers' schema does not describe it
MTP_LAYER_TYPE, MTP_MLP_TYPE = SLIDING, MOE
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
ROPE_TYPES = ("default", "yarn")

# the ranges of the fields the generic config checks do not bound (conversion/validation.py)
CONFIG_BOUNDS = {
    "sliding_window": Bounds(1, why="the keys each query sees in the sliding window, its own included"),
    "compress_rates.*": Bounds(1, integer=True, why="the positions each compressed entry pools"),
    "partial_rotary_factor": Bounds(0, 1, above_low=True, why="the fraction of head_dim that RoPE rotates"),
    "hc_sinkhorn_iters": Bounds(1, 1000, why="Sinkhorn iterations of every hyper-connection in every forward; "
                                           "the release runs 20"),
    **{name: Bounds(1, why="a size of the model") for name in (
        "hc_mult", "o_groups", "o_lora_rank", "q_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
        "n_routed_experts", "num_experts_per_tok")},
    "routed_scaling_factor": Bounds(0, above_low=True, why="it scales the routed experts' output"),
    "swiglu_limit": Bounds(0, above_low=True, why="the routed experts clamp their pre-activations to it"),
}
# count -> fields whose product each unit of it holds weights of at least (ModelProvider.weights_per_unit)
WEIGHTS_PER_UNIT = {
    "num_hidden_layers": ("hidden_size",), "num_nextn_predict_layers": ("hidden_size",),
    "n_routed_experts": ("hidden_size", "moe_intermediate_size"), "hc_mult": ("hidden_size",),
    "q_lora_rank": ("hidden_size",), "o_lora_rank": ("o_groups",), "index_n_heads": ("index_head_dim",),
}


@dataclasses.dataclass(frozen=True)
class DeepseekV4Args:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    mlp_layer_types: tuple[str, ...]
    rms_norm_eps: float
    rope_parameters: dict           # {"main": {...}, "compress": {...}} as the HF config holds them
    num_mtp_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False  # the output layer (main and MTP) is the embedding matrix

    @classmethod
    def from_hf(cls, hf: DeepseekV4Config) -> DeepseekV4Args:
        return cls(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads, head_dim=hf.head_dim,
            rope_dim=int(hf.head_dim * hf.partial_rotary_factor), q_lora_rank=hf.q_lora_rank,
            o_groups=hf.o_groups, o_lora_rank=hf.o_lora_rank, sliding_window=hf.sliding_window,
            layer_types=tuple(hf.layer_types), compress_rates=dict(hf.compress_rates),
            index_n_heads=hf.index_n_heads, index_head_dim=hf.index_head_dim, index_topk=hf.index_topk,
            hc_mult=hf.hc_mult, hc_sinkhorn_iters=hf.hc_sinkhorn_iters, hc_eps=hf.hc_eps,
            num_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
            moe_intermediate_size=hf.moe_intermediate_size, scoring_func=hf.scoring_func,
            routed_scaling_factor=hf.routed_scaling_factor, swiglu_limit=hf.swiglu_limit,
            mlp_layer_types=tuple(hf.mlp_layer_types), rms_norm_eps=hf.rms_norm_eps,
            rope_parameters={k: dict(v) for k, v in hf.rope_parameters.items() if isinstance(v, dict)},
            num_mtp_layers=hf.num_nextn_predict_layers or 0, max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=hf.tie_word_embeddings,
        )

    def compress_rate(self, layer_type: str) -> int:
        return 0 if layer_type == SLIDING else self.compress_rates[layer_type]

    @staticmethod
    def rope_kind(layer_type: str) -> str:
        """Sliding layers use the "main" RoPE; CSA/HCA layers (and their compressors) the "compress" one."""
        return "main" if layer_type == SLIDING else "compress"

    def rope_table(self, kind: str) -> tuple[torch.Tensor, float]:
        """(inv_freq [rope_dim / 2] fp32, cos/sin scaling) of RoPE kind "main" or "compress"."""
        return rope_inv_freq(self.rope_parameters[kind], self.head_dim)


def rope_inv_freq(params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """transformers' default / YaRN inverse frequencies for one V4 rope kind (fp32, CPU)."""
    base = params["rope_theta"]
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope_type != "yarn":
        raise ValueError(f"DeepSeek-V4 rope_type {rope_type!r} is not supported (only {ROPE_TYPES})")
    factor = params["factor"]
    original_max = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:  # the V4 config sets 1.0; this is YaRN's default otherwise
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale, m=1):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    # transformers reads `truncate` from the top level of the nested V4 rope dict, so it is always True
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def check_supported(hf: DeepseekV4Config, where: str = "deepseek_v4 config") -> None:
    """One ValueError naming every config value this implementation does not support."""
    problems = []
    if hf.scoring_func not in SCORING_FUNCS:
        problems.append(f"scoring_func {hf.scoring_func!r} (supported: {SCORING_FUNCS})")
    if hf.n_shared_experts != 1:
        problems.append(f"n_shared_experts={hf.n_shared_experts} (transformers builds exactly one shared expert)")
    if hf.num_key_value_heads != 1:
        problems.append(f"num_key_value_heads={hf.num_key_value_heads} (V4 attention is single-KV-head MQA)")
    if hf.hidden_act != "silu":
        problems.append(f"hidden_act {hf.hidden_act!r} (only silu)")
    if hf.attention_bias or hf.mlp_bias:
        problems.append("attention_bias / mlp_bias")
    if hf.num_attention_heads % hf.o_groups:
        problems.append(f"num_attention_heads={hf.num_attention_heads} not divisible by o_groups={hf.o_groups}")
    rotary = int(hf.head_dim * hf.partial_rotary_factor)
    if rotary % 2 or rotary > hf.head_dim:
        problems.append(f"rotary dim {rotary} (head_dim * partial_rotary_factor) must be even and <= head_dim")
    if hf.num_experts_per_tok > hf.n_routed_experts:
        problems.append(f"num_experts_per_tok={hf.num_experts_per_tok} (more than the {hf.n_routed_experts} "
                        f"routed experts)")
    missing = sorted({kind for kind in hf.layer_types or () if kind != SLIDING} - set(hf.compress_rates or {}))
    if missing:
        problems.append(f"compress_rates without a rate for {missing} (layer types of layer_types)")
    # positions a query sees or that an entry pools: no more than there are (index_topk may exceed the entries: the
    # indexer keeps min(index_topk, entries), so a larger one keeps them all)
    lengths = {"sliding_window": hf.sliding_window,
               **{f"compress_rates[{kind!r}]": rate for kind, rate in (hf.compress_rates or {}).items()}}
    for name, length in lengths.items():
        if isinstance(length, int) and length > hf.max_position_embeddings:
            problems.append(f"{name}={length} (more than the {hf.max_position_embeddings} positions, "
                            f"max_position_embeddings)")
    for kind, params in (hf.rope_parameters or {}).items():
        if isinstance(params, dict) and params.get("rope_type", "default") not in ROPE_TYPES:
            problems.append(f"rope_parameters[{kind!r}].rope_type {params.get('rope_type')!r} (only {ROPE_TYPES})")
    if problems:
        raise ValueError(f"{where}: unsupported {'; '.join(problems)}")


def check_parallel(hf: DeepseekV4Config, tp: int, ep: int) -> None:
    """The DeepSeek-V4-specific divisibility rules of a parallel layout (heads, output groups, experts)."""
    problems = []
    if hf.o_groups % tp:
        problems.append(f"tensor parallel size {tp} must divide o_groups ({hf.o_groups}): wo_a is sharded by group")
    if hf.n_routed_experts % ep:
        problems.append(f"expert parallel size {ep} must divide n_routed_experts ({hf.n_routed_experts})")
    if problems:
        raise ValueError("deepseek_v4: " + "; ".join(problems))


def transformer_config_fields(hf: DeepseekV4Config) -> dict:
    """Megatron TransformerConfig fields (sizes and flags the parallel layers read)."""
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.moe_intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        kv_channels=hf.head_dim,
        num_moe_experts=hf.n_routed_experts,
        moe_router_topk=hf.num_experts_per_tok,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        layernorm_epsilon=hf.rms_norm_eps,
        **SWIGLU_RMSNORM_FIELDS,
        gradient_accumulation_fusion=False,
        init_method_std=hf.initializer_range,
        attention_dropout=hf.attention_dropout,
        moe_token_dispatcher_type="alltoall",
    )
