"""LoRA targets of DeepSeek-V4 (data). Module paths as in `mapping.py`.

Adapted by default (`all-linear`): the attention's wq_a, wq_b, wkv, wo_b and the shared expert's w1, w3, w2,
of the decoder layers (the MTP blocks are not adapted). Accepted names: the mapping's HF (release) leaves
(`wq_a`, `attn.wq_b`, `shared_experts.w1`, ...), the Megatron module names (`linear_q_down_proj`, ...) and, as
aliases, transformers' names (`q_a_proj`, `q_b_proj`, `kv_proj`, `o_b_proj`, `gate_proj`, `up_proj`, `down_proj`).
wq_a and wkv are replicated linears: their adapters are replicated too. `transformers=`: the module of
transformers' DeepseekV4ForCausalLM that holds the weight the checkpoint names with the release leaf (the
default PEFT adapter names; `naming="release"` keeps the checkpoint's).

Bare names that the attention shares with the indexer or the compressor (`wq_b`, `wkv`, `linear_q_up_proj`,
`linear_kv`, `q_b_proj`, `kv_proj`), or the shared expert with the routed experts (`w1`, `w3`, `w2`), mean the
attention's / the shared expert's; the others are refused by their qualified names (`indexer.wq_b`,
`compressor.wkv`, `experts.w1`).
"""

from modelzoo.lora.targets import Refusal, Target, TargetTable

A, L = "decoder.layers.*.self_attention", "decoder.layers.*"
SHARED = f"{L}.mlp.shared_experts"

HF_ATTN, HF_SHARED = "model.layers.*.self_attn", "model.layers.*.mlp.shared_experts"  # transformers' modules

LORA_TARGETS = TargetTable(
    targets=(
        Target(f"{A}.linear_q_down_proj", aliases=("q_a_proj", "self_attn.q_a_proj"),                  # wq_a
               transformers=f"{HF_ATTN}.q_a_proj"),
        Target(f"{A}.linear_q_up_proj", aliases=("wq_b", "linear_q_up_proj", "q_b_proj", "self_attn.q_b_proj"),
               transformers=f"{HF_ATTN}.q_b_proj"),
        Target(f"{A}.linear_kv", aliases=("wkv", "linear_kv", "kv_proj", "self_attn.kv_proj"),         # replicated
               transformers=f"{HF_ATTN}.kv_proj"),
        Target(f"{A}.linear_proj", aliases=("o_b_proj", "self_attn.o_b_proj"),                         # wo_b
               transformers=f"{HF_ATTN}.o_b_proj"),
        Target(f"{SHARED}.linear_fc1_gate", aliases=("w1", "gate_proj", "shared_experts.gate_proj"),
               transformers=f"{HF_SHARED}.gate_proj"),
        Target(f"{SHARED}.linear_fc1_up", aliases=("w3", "up_proj", "shared_experts.up_proj"),
               transformers=f"{HF_SHARED}.up_proj"),
        Target(f"{SHARED}.linear_fc2", aliases=("w2", "down_proj", "shared_experts.down_proj"),
               transformers=f"{HF_SHARED}.down_proj"),
    ),
    refusals=(
        Refusal(f"{A}.linear_o_down_proj", "wo_a is a grouped (block-diagonal) projection: a plain adapter B A on "
                "it adds cross-group terms the model cannot express", aliases=("o_a_proj",)),
        Refusal(f"{A}.compressor.indexer", "the indexer (its wq_b, weights_proj and compressor) picks the compressed "
                "entries and is not trained by LoRA",
                aliases=("indexer.q_b_proj", "compressor.indexer.q_b_proj", "scorer.weights_proj")),
        Refusal(f"{A}.compressor.linear_kv", "the compressor's weights (wkv, wgate) are not LoRA targets",
                aliases=("compressor", "compressor.wkv", "compressor.kv_proj")),
        Refusal(f"{A}.compressor.linear_gate", "the compressor's weights (wkv, wgate) are not LoRA targets",
                aliases=("compressor.wgate", "compressor.gate_proj")),
        Refusal(f"{L}.mlp.experts", "routed experts stay frozen (only the shared expert is adapted)",
                aliases=("gate_up_proj", "experts.gate_up_proj", "experts.down_proj")),
        Refusal(f"{L}.mlp.router", "the router stays frozen", aliases=("e_score_correction_bias",)),
        Refusal(f"{L}.attn_hc", "hyper-connection parameters (fn, base, scale) are not linears"),
        Refusal(f"{L}.ffn_hc", "hyper-connection parameters (fn, base, scale) are not linears"),
        Refusal("decoder.hc_head", "hyper-connection parameters (fn, base, scale) are not linears"),
    ),
)
