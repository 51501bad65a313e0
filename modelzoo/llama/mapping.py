"""Llama <-> Megatron-Core GPTModel (local layer spec): every tensor name, both ways."""

from modelzoo.conversion.mapping import MappingTable, Rule
from modelzoo.conversion.transforms import FusedGateUp, FusedQKV, PadVocab


def llama_mapping(vocab_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> MappingTable:
    return MappingTable([
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", PadVocab(vocab_size)),
        Rule("decoder.layers.*.input_layernorm.weight", "model.layers.*.input_layernorm.weight"),
        Rule("decoder.layers.*.self_attention.linear_qkv.weight",
             ("model.layers.*.self_attn.q_proj.weight",
              "model.layers.*.self_attn.k_proj.weight",
              "model.layers.*.self_attn.v_proj.weight"),
             FusedQKV(num_heads, num_kv_heads, head_dim)),
        Rule("decoder.layers.*.self_attention.linear_proj.weight", "model.layers.*.self_attn.o_proj.weight"),
        Rule("decoder.layers.*.pre_mlp_layernorm.weight", "model.layers.*.post_attention_layernorm.weight"),
        Rule("decoder.layers.*.mlp.linear_fc1.weight",
             ("model.layers.*.mlp.gate_proj.weight", "model.layers.*.mlp.up_proj.weight"),
             FusedGateUp()),
        Rule("decoder.layers.*.mlp.linear_fc2.weight", "model.layers.*.mlp.down_proj.weight"),
        Rule("decoder.final_layernorm.weight", "model.norm.weight"),
        Rule("output_layer.weight", "lm_head.weight", PadVocab(vocab_size)),
    ])
