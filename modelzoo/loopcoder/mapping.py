"""LoopCoder <-> Megatron: the Llama table plus each layer's loop gate (at model level on the HF side)."""

from modelzoo.conversion.mapping import MappingTable, Rule
from modelzoo.llama.mapping import llama_mapping


def loopcoder_mapping(vocab_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> MappingTable:
    llama = llama_mapping(vocab_size, num_heads, num_kv_heads, head_dim)
    return MappingTable([
        *llama.rules,
        Rule("decoder.layers.*.self_attention.loop_gate.weight", "model.gate_projections.*.weight"),
        Rule("decoder.layers.*.self_attention.loop_gate.bias", "model.gate_projections.*.bias"),
    ])
