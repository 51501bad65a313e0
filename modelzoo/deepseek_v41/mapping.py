"""DeepSeek-V4.1 <-> Megatron: every tensor name, both ways (HF naming: transformers main's `model.` + release leaves).

    Megatron (left)                                        checkpoint (right)
    embedding.word_embeddings.weight                       model.embed.weight              (vocabulary padded)
    decoder.layers.N.*                                     model.layers.N.*                (per-layer table below)
    decoder.final_layernorm.weight / output_layer.weight   model.norm.weight / lm_head.weight
    mtp.layers.K.*                                         mtp.K.*                         (DSpark; same per-layer table)
    carried.<name with . as __>                            vision.*, aligner.*, image_* (kept, not used)

Per layer (`attn.*` only where the layer has it: the compressor at KV sources, `wgate` at ratio > 1, the indexer at
index sources, `wk` / `k_norm` at KV sources; `engram.*` at Engram layers):
"""

from modelzoo.conversion.mapping import MappingTable, Rule
from modelzoo.conversion.transforms import PadVocab, Stack

# the vision tower, its aligner and the image delimiters: the text model does not read them, the export writes them back
CARRIED_PREFIXES = ("vision.", "aligner.", "image_")


def carried_name(name: str) -> str:
    """The buffer of the Megatron model's `carried` module that holds checkpoint tensor `name`."""
    return name.replace(".", "__")


def _layer_rules(mg: str, hf: str, num_experts: int) -> list[Rule]:
    attn, comp, idx = f"{mg}.self_attention", f"{mg}.self_attention.compressor", f"{mg}.self_attention.indexer"
    return [
        *(Rule(f"{mg}.{m}_hc.{p}", f"{hf}.hc_{m}_{p}") for m in ("attn", "ffn") for p in ("fn", "base", "scale")),
        Rule(f"{mg}.input_layernorm.weight", f"{hf}.attn_norm.weight"),
        Rule(f"{mg}.pre_mlp_layernorm.weight", f"{hf}.ffn_norm.weight"),
        Rule(f"{attn}.linear_q_down_proj.weight", f"{hf}.attn.wq_a.weight"),
        Rule(f"{attn}.q_layernorm.weight", f"{hf}.attn.q_norm.weight"),
        Rule(f"{attn}.linear_q_up_proj.weight", f"{hf}.attn.wq_b.weight"),
        Rule(f"{attn}.linear_kv.weight", f"{hf}.attn.wkv.weight"),
        Rule(f"{attn}.kv_layernorm.weight", f"{hf}.attn.kv_norm.weight"),
        Rule(f"{attn}.linear_o_down_proj.weight", f"{hf}.attn.wo_a.weight"),
        Rule(f"{attn}.linear_proj.weight", f"{hf}.attn.wo_b.weight"),
        Rule(f"{attn}.sinks", f"{hf}.attn.attn_sink"),
        Rule(f"{comp}.linear_kv.weight", f"{hf}.attn.compressor.wkv.weight"),
        Rule(f"{comp}.linear_gate.weight", f"{hf}.attn.compressor.wgate.weight"),
        Rule(f"{comp}.kv_norm.weight", f"{hf}.attn.compressor.norm.weight"),
        Rule(f"{idx}.linear_q_up_proj.weight", f"{hf}.attn.indexer.wq_b.weight"),
        Rule(f"{idx}.linear_weights.weight", f"{hf}.attn.indexer.weights_proj.weight"),
        Rule(f"{idx}.linear_k.weight", f"{hf}.attn.indexer.wk.weight"),
        Rule(f"{idx}.k_layernorm.weight", f"{hf}.attn.indexer.k_norm.weight"),
        Rule(f"{mg}.mlp.router.weight", f"{hf}.ffn.gate.weight"),
        Rule(f"{mg}.mlp.router.expert_bias", f"{hf}.ffn.gate.bias"),
        Rule(f"{mg}.mlp.router.expert_bias_vl", f"{hf}.ffn.gate.bias_vl"),
        *(Rule(f"{mg}.mlp.experts.weight{n}", tuple(f"{hf}.ffn.experts.{e}.w{n}.weight" for e in range(num_experts)),
               Stack()) for n in (1, 3, 2)),
        Rule(f"{mg}.mlp.shared_experts.linear_fc1_gate.weight", f"{hf}.ffn.shared_experts.w1.weight"),
        Rule(f"{mg}.mlp.shared_experts.linear_fc1_up.weight", f"{hf}.ffn.shared_experts.w3.weight"),
        Rule(f"{mg}.mlp.shared_experts.linear_fc2.weight", f"{hf}.ffn.shared_experts.w2.weight"),
        Rule(f"{mg}.engram.linear_kv.weight", f"{hf}.engram.wkv.weight"),
        Rule(f"{mg}.engram.q_weight", f"{hf}.engram.q_weight"),
        Rule(f"{mg}.engram.k_weight", f"{hf}.engram.k_weight"),
    ]


def _engram_tables(layer_ids: list[int], num_embeddings: list[int]) -> list[Rule]:
    """Each table by its own layer id: its rows are padded to a multiple of the TP size, which differs per table."""
    return [Rule(f"decoder.layers.{layer}.engram.{mg}", f"model.layers.{layer}.engram.embed.{hf}", PadVocab(rows))
            for layer, rows in zip(layer_ids, num_embeddings) for mg, hf in (("table.weight", "weight"),
                                                                             ("table_scale", "scale"))]


def deepseek_v41_mapping(text_config, carried: dict) -> MappingTable:
    """`carried`: the checkpoint's tensors the text model carries (`DeepseekV41Provider.carried_tensors`)."""
    vocab = text_config.vocab_size
    return MappingTable([
        Rule("embedding.word_embeddings.weight", "model.embed.weight", PadVocab(vocab)),
        *_layer_rules("decoder.layers.*", "model.layers.*", text_config.n_routed_experts),
        *_engram_tables(text_config.engram_layer_ids, text_config.engram_num_embeddings),
        Rule("decoder.final_layernorm.weight", "model.norm.weight"),
        Rule("output_layer.weight", "lm_head.weight", PadVocab(vocab)),
        # DSpark draft layers
        *_layer_rules("mtp.layers.*", "mtp.*", text_config.dspark_n_routed_experts),
        Rule("mtp.layers.*.main_proj.weight", "mtp.*.main_proj.weight"),
        Rule("mtp.layers.*.main_norm.weight", "mtp.*.main_norm.weight"),
        Rule("mtp.layers.*.heads.final_layernorm.weight", "mtp.*.norm.weight"),
        Rule("mtp.layers.*.heads.markov_embed.weight", "mtp.*.markov_head.embed.weight"),
        Rule("mtp.layers.*.heads.markov_head.weight", "mtp.*.markov_head.head.weight"),
        Rule("mtp.layers.*.heads.confidence_head.weight", "mtp.*.confidence_head.proj.weight"),
        *(Rule(f"carried.{carried_name(name)}", name) for name in carried),
    ])
