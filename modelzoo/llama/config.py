"""Llama's HF config (transformers' `LlamaConfig`) and its translation to Megatron's TransformerConfig fields."""

from __future__ import annotations

from transformers import LlamaConfig

from modelzoo.provider import SWIGLU_RMSNORM_FIELDS


def llama_transformer_fields(hf: LlamaConfig) -> dict:
    """TransformerConfig fields of a Llama-style decoder (shared by architectures built on it)."""
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=hf.head_dim,
        layernorm_epsilon=hf.rms_norm_eps,
        **SWIGLU_RMSNORM_FIELDS,
        attention_dropout=getattr(hf, "attention_dropout", 0.0),
    )


def check_llama_supported(hf: LlamaConfig, where: str) -> None:
    rope_type = (hf.rope_parameters or {}).get("rope_type", "default")
    problems = []
    if rope_type != "default":
        problems.append(f"rope_type {rope_type!r} (only 'default' RoPE is implemented)")
    if hf.attention_bias or hf.mlp_bias:
        problems.append("attention_bias / mlp_bias")
    if hf.hidden_act != "silu":
        problems.append(f"hidden_act {hf.hidden_act!r} (only silu)")
    if problems:
        raise ValueError(f"{where}: unsupported {', '.join(problems)}")
