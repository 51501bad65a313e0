"""Llama as a Megatron-Core GPTModel: the local layer spec with modelzoo's core attention."""

from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from modelzoo.attention import CoreAttention
from modelzoo.replicated_kv import QKVParallelLinear


def llama_layer_spec(attention: str, num_kv_heads: int) -> ModuleSpec:
    """Megatron's local spec (column/row-parallel linears, torch RMSNorm) with our attention kernel, and a
    linear_qkv that holds copies of the KV heads when they are fewer than the TP ranks."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    attention_modules = spec.submodules.self_attention.submodules
    attention_modules.core_attention = ModuleSpec(module=CoreAttention, params={"impl": attention})
    attention_modules.linear_qkv = ModuleSpec(module=QKVParallelLinear, params={"num_kv_heads": num_kv_heads})
    return spec


def build_gpt_model(config, attention: str, padded_vocab_size: int, max_sequence_length: int,
                    rope_theta: float, tie_word_embeddings: bool, num_kv_heads: int) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=llama_layer_spec(attention, num_kv_heads),
        vocab_size=padded_vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        rotary_base=rope_theta,
        share_embeddings_and_output_weights=tie_word_embeddings,
        parallel_output=True,
    )


def gpt_forward(model: GPTModel, input_ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return model(input_ids, positions, attention_mask=None)
