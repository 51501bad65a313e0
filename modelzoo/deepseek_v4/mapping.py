"""DeepSeek-V4 <-> Megatron: every tensor name, both ways.

HF names are what transformers' `save_pretrained` writes for DeepseekV4ForCausalLM (5.x): it keeps
the `model.` prefix but reverts most leaves to the release's native names (`attn.wq_a`,
`ffn.experts.E.w1`, `hc_attn_fn`, ...), keeps `model.embed_tokens` / `model.norm` /
`model.hc_head.hc_*` and writes `head.weight`. MTP tensors, which transformers does not build, use
the release's native names (`mtp.K.*`, with `attn.kv_norm` and `hc_head_*`).
"""

from modelzoo.conversion.mapping import Indices, MappingTable, Rule
from modelzoo.conversion.transforms import PadVocab, Stack


def _layer_rules(mg: str, hf: str, num_experts: int, kv_norm: str) -> list[Rule]:
    attn, comp, idx = f"{mg}.self_attention", f"{mg}.self_attention.compressor", f"{mg}.self_attention.compressor.indexer"
    experts = [Rule(f"{mg}.mlp.experts.weight{n}", tuple(f"{hf}.ffn.experts.{e}.w{n}.weight" for e in range(num_experts)),
                    Stack()) for n in (1, 3, 2)]
    return [
        *(Rule(f"{mg}.{m}_hc.{p}", f"{hf}.hc_{m}_{p}") for m in ("attn", "ffn") for p in ("fn", "base", "scale")),
        Rule(f"{mg}.input_layernorm.weight", f"{hf}.attn_norm.weight"),
        Rule(f"{mg}.pre_mlp_layernorm.weight", f"{hf}.ffn_norm.weight"),
        Rule(f"{attn}.linear_q_down_proj.weight", f"{hf}.attn.wq_a.weight"),
        Rule(f"{attn}.q_layernorm.weight", f"{hf}.attn.q_norm.weight"),
        Rule(f"{attn}.linear_q_up_proj.weight", f"{hf}.attn.wq_b.weight"),
        Rule(f"{attn}.linear_kv.weight", f"{hf}.attn.wkv.weight"),
        Rule(f"{attn}.kv_layernorm.weight", f"{hf}.attn.{kv_norm}.weight"),
        Rule(f"{attn}.linear_o_down_proj.weight", f"{hf}.attn.wo_a.weight"),
        Rule(f"{attn}.linear_proj.weight", f"{hf}.attn.wo_b.weight"),
        Rule(f"{attn}.sinks", f"{hf}.attn.attn_sink"),
        Rule(f"{comp}.linear_kv.weight", f"{hf}.attn.compressor.wkv.weight"),
        Rule(f"{comp}.linear_gate.weight", f"{hf}.attn.compressor.wgate.weight"),
        Rule(f"{comp}.position_bias", f"{hf}.attn.compressor.ape"),
        Rule(f"{comp}.kv_norm.weight", f"{hf}.attn.compressor.norm.weight"),
        Rule(f"{idx}.linear_kv.weight", f"{hf}.attn.indexer.compressor.wkv.weight"),
        Rule(f"{idx}.linear_gate.weight", f"{hf}.attn.indexer.compressor.wgate.weight"),
        Rule(f"{idx}.position_bias", f"{hf}.attn.indexer.compressor.ape"),
        Rule(f"{idx}.kv_norm.weight", f"{hf}.attn.indexer.compressor.norm.weight"),
        Rule(f"{idx}.linear_q_up_proj.weight", f"{hf}.attn.indexer.wq_b.weight"),
        Rule(f"{idx}.linear_weights.weight", f"{hf}.attn.indexer.weights_proj.weight"),
        Rule(f"{mg}.mlp.router.weight", f"{hf}.ffn.gate.weight"),
        Rule(f"{mg}.mlp.router.expert_bias", f"{hf}.ffn.gate.bias"),
        Rule(f"{mg}.mlp.router.tid2eid", f"{hf}.ffn.gate.tid2eid", values=Indices(num_experts, "routed experts")),
        *experts,
        Rule(f"{mg}.mlp.shared_experts.linear_fc1_gate.weight", f"{hf}.ffn.shared_experts.w1.weight"),
        Rule(f"{mg}.mlp.shared_experts.linear_fc1_up.weight", f"{hf}.ffn.shared_experts.w3.weight"),
        Rule(f"{mg}.mlp.shared_experts.linear_fc2.weight", f"{hf}.ffn.shared_experts.w2.weight"),
    ]


def deepseek_v4_mapping(vocab_size: int, num_experts: int) -> MappingTable:
    return MappingTable([
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", PadVocab(vocab_size)),
        *_layer_rules("decoder.layers.*", "model.layers.*", num_experts, kv_norm="norm"),
        *(Rule(f"decoder.hc_head.{p}", f"model.hc_head.hc_{p}") for p in ("fn", "base", "scale")),
        Rule("decoder.final_layernorm.weight", "model.norm.weight"),
        Rule("output_layer.weight", "head.weight", PadVocab(vocab_size)),
        # multi-token prediction (release names; transformers skips `mtp.*` on load)
        *(Rule(f"mtp.layers.*.{n}.weight", f"mtp.*.{n}.weight") for n in ("enorm", "hnorm", "e_proj", "h_proj")),
        *_layer_rules("mtp.layers.*.block", "mtp.*", num_experts, kv_norm="kv_norm"),
        *(Rule(f"mtp.layers.*.hc_head.{p}", f"mtp.*.hc_head_{p}") for p in ("fn", "base", "scale")),
        Rule("mtp.layers.*.final_layernorm.weight", "mtp.*.norm.weight"),
    ])
