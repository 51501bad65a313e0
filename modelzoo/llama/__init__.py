"""Llama (HF `LlamaForCausalLM`): the dense baseline that proves the machinery."""

from __future__ import annotations

from transformers import LlamaConfig

from modelzoo.llama.bridge import llama_mapping
from modelzoo.provider import SWIGLU_RMSNORM_FIELDS, ModelProvider
from modelzoo.registry import register


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


@register
class LlamaProvider(ModelProvider):
    name = "llama"
    hf_model_types = ("llama",)
    hf_architectures = ("LlamaForCausalLM",)
    copies_kv_heads = True
    supports_context_parallel = True

    @classmethod
    def hf_config_class(cls):
        return LlamaConfig

    def hf_model_class(self):
        from transformers import LlamaForCausalLM  # transformers' modeling code: for the parity oracle only

        return LlamaForCausalLM

    def check_supported(self) -> None:
        check_llama_supported(self.hf_config, self.config_source)

    def transformer_config_fields(self) -> dict:
        return llama_transformer_fields(self.hf_config)

    def build_model(self, config):
        from modelzoo.llama.model import build_gpt_model  # Megatron-Core: not needed to read or check a config

        hf = self.hf_config
        return build_gpt_model(config, self.attention, self.padded_vocab_size(), hf.max_position_embeddings,
                               hf.rope_parameters["rope_theta"], hf.tie_word_embeddings, hf.num_key_value_heads,
                               hf.vocab_size, **self.pipeline_stage())

    def mapping(self):
        hf = self.hf_config
        return llama_mapping(hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
