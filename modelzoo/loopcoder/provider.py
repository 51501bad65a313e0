"""`build_provider` entry for IQuest LoopCoder (`model_type` "iquestloopcoder")."""

from __future__ import annotations

from modelzoo.llama.config import check_llama_supported, llama_transformer_fields
from modelzoo.loopcoder.mapping import loopcoder_mapping
from modelzoo.loopcoder.config import PIPELINE_REFUSAL, IQuestLoopCoderConfig
from modelzoo.provider import ModelProvider
from modelzoo.registry import register


@register
class LoopCoderProvider(ModelProvider):
    """Overrides beyond the generic ones: `train_gate=True` makes the loop gates trainable (frozen by default)."""

    name = "loopcoder"
    hf_model_types = ("iquestloopcoder",)
    hf_architectures = ("IQuestLoopCoderForCausalLM",)
    copies_kv_heads = True
    supports_context_parallel = True

    def __init__(self, hf_config, hf_dir=None, train_gate: bool = False, **overrides):
        self.train_gate = train_gate
        super().__init__(hf_config, hf_dir, **overrides)

    @classmethod
    def hf_config_class(cls):
        return IQuestLoopCoderConfig

    def hf_model_class(self):
        from modelzoo.loopcoder.hf_model import IQuestLoopCoderForCausalLM

        return IQuestLoopCoderForCausalLM

    def check_supported(self) -> None:
        check_llama_supported(self.hf_config, self.config_source)
        overrides = self.config_overrides
        if overrides.get("pipeline_model_parallel_size", 1) > 1:
            raise ValueError(PIPELINE_REFUSAL.format(pp=overrides["pipeline_model_parallel_size"]))

    def check_parallel_layout(self, tp: int, ep: int = 1, cp: int = 1, pp: int = 1) -> None:
        if pp > 1:
            raise ValueError(PIPELINE_REFUSAL.format(pp=pp))
        super().check_parallel_layout(tp, ep, cp, pp)

    def transformer_config_fields(self) -> dict:
        return llama_transformer_fields(self.hf_config)

    def build_model(self, config):
        from modelzoo.loopcoder.model import LoopCoderModel

        hf = self.hf_config
        return LoopCoderModel(config, hf.vocab_size, self.padded_vocab_size(), hf.max_position_embeddings,
                              hf.rope_parameters["rope_theta"], hf.loop_num, hf.loop_window_size,
                              hf.num_key_value_heads, attention_impl=self.attention, train_gate=self.train_gate,
                              tie_word_embeddings=hf.tie_word_embeddings)

    @classmethod
    def lora_targets(cls):
        from modelzoo.loopcoder.lora import LORA_TARGETS  # imports modelzoo.lora (Megatron-Core): not for reading a config

        return LORA_TARGETS

    @classmethod
    def sync_namings(cls):
        from modelzoo.loopcoder.sync import NAMINGS

        return NAMINGS

    def mapping(self):
        hf = self.hf_config
        return loopcoder_mapping(hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)

