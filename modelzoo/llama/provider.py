"""`build_provider` entry for Llama (`model_type` "llama")."""

from __future__ import annotations

from transformers import LlamaConfig

from modelzoo.llama.config import check_llama_supported, llama_transformer_fields
from modelzoo.llama.mapping import llama_mapping
from modelzoo.provider import ModelProvider
from modelzoo.registry import register


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

    @classmethod
    def lora_targets(cls):
        from modelzoo.llama.lora import LORA_TARGETS  # imports modelzoo.lora (Megatron-Core): not for reading a config

        return LORA_TARGETS

    @classmethod
    def sync_namings(cls):
        from modelzoo.llama.sync import NAMINGS

        return NAMINGS

    def mapping(self):
        hf = self.hf_config
        return llama_mapping(hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
