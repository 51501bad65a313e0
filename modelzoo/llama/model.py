"""Llama as a Megatron-Core GPTModel: the local layer spec with modelzoo's core attention.

`LlamaGPTModel` is GPTModel with its own `forward`, composed of GPTModel's public pieces (embedding, rotary
table, decoder, output layer), so that the batch forms trainers send (packed THD rows, padding masks, left
padding with position ids) reach the attention as one `TokenLayout` and RoPE follows each token's position;
GPTModel's own forward takes RoPE positions from the row index and leaves masks and packing to Transformer Engine.
"""

from __future__ import annotations

import copy

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from modelzoo.layers import gpt_call, sequence_parallel
from modelzoo.layers.attention import CoreAttention
from modelzoo.layers.replicated_kv import QKVParallelLinear


def llama_layer_spec(attention: str, num_kv_heads: int) -> ModuleSpec:
    """Megatron's local spec (column/row-parallel linears, torch RMSNorm) with our attention kernel, a
    linear_qkv that holds copies of the KV heads when they are fewer than the TP ranks, and norms marked for
    sequence parallelism (modelzoo.layers.sequence_parallel)."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = sequence_parallel.rms_norm
    attention_modules = spec.submodules.self_attention.submodules
    attention_modules.core_attention = ModuleSpec(module=CoreAttention, params={"impl": attention})
    attention_modules.linear_qkv = ModuleSpec(module=QKVParallelLinear, params={"num_kv_heads": num_kv_heads})
    return spec


def llama_block_spec(config, attention: str, num_kv_heads: int) -> TransformerBlockSubmodules:
    """This pipeline stage's layers and the final norm (the sequence-parallel-aware one, not Megatron's default)."""
    layer = llama_layer_spec(attention, num_kv_heads)
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=sequence_parallel.rms_norm)


class LlamaGPTModel(gpt_call.GPTModelSurface, GPTModel):
    """GPTModel whose forward reads the batch as modelzoo's models do (see modelzoo.layers.gpt_call)."""

    vocab_size: int  # the real vocabulary (the output layer's rows past it are padding)

    def forward(self, input_ids, position_ids=None, attention_mask=None, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None, runtime_gather_output=None,
                *, inference_params=None, loss_mask=None, padding_mask=None, output_processor=None,
                output_processor_context=None, mtp_kwargs=None):
        gpt_call.refuse_unsupported("Llama", inference_context, inference_params, extra_block_kwargs, output_processor)
        gpt_call.refuse_mtp_training("Llama", mtp_kwargs)
        if decoder_input is None and not self.pre_process:
            decoder_input = self.decoder.input_tensor  # a later pipeline stage: the previous stage's output
        layout = gpt_call.input_layout("Llama", input_ids, decoder_input, position_ids, attention_mask,
                                       packed_seq_params, self.max_sequence_length, self.config)
        if decoder_input is None:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=None)            # [s, b, hidden]
        rotary = gpt_call.rotary_per_token(self.rotary_pos_emb, layout)
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=rotary,
                              packed_seq_params=layout)
        if not self.post_process:
            return hidden
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)
        return gpt_call.language_model_output(logits.transpose(0, 1), labels, self.vocab_size, runtime_gather_output)


def build_gpt_model(config, attention: str, padded_vocab_size: int, max_sequence_length: int,
                    rope_theta: float, tie_word_embeddings: bool, num_kv_heads: int, vocab_size: int,
                    pre_process: bool = True, post_process: bool = True) -> LlamaGPTModel:
    """One pipeline stage of the model (all of it at one stage): its decoder layers are the stage's share, numbered
    in the model by Megatron's layer offset; `pre_process` / `post_process`: it embeds / holds the head."""
    model = LlamaGPTModel(
        config=config,
        transformer_layer_spec=llama_block_spec(config, attention, num_kv_heads),
        vocab_size=padded_vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        rotary_base=rope_theta,
        share_embeddings_and_output_weights=tie_word_embeddings,
        parallel_output=True,
        pre_process=pre_process,
        post_process=post_process,
    )
    model.vocab_size = vocab_size
    return model
