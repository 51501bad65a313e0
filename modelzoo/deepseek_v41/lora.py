"""LoRA targets of DeepSeek-V4.1 (data). Module paths as in `mapping.py`.

Adapted by default (`all-linear`): the attention's wq_a, wq_b, wkv, wo_b and the shared expert's w1, w3, w2, of the
backbone layers (the DSpark draft layers are not adapted). Accepted names: the release leaves (`wq_a`, `attn.wq_b`,
`shared_experts.w1`, ...), the Megatron module names (`linear_q_down_proj`, ...) and, as aliases, transformers'
DeepSeek names (`q_a_proj`, `q_b_proj`, `kv_proj`, `o_b_proj`, `gate_proj`, `up_proj`, `down_proj`). wq_a and wkv
are replicated linears: their adapters are replicated too. Our reference (hf_model.py) keeps the checkpoint's module
names, so a PEFT adapter names the modules as the checkpoint names the weights.

Bare names that the attention shares with the indexer, the compressor or the Engram (`wq_b`, `wkv`) or the shared
expert with the routed experts (`w1`, `w3`, `w2`) mean the attention's / the shared expert's; the others are
refused by their qualified names (`indexer.wq_b`, `compressor.wkv`, `engram.wkv`, `experts.w1`).
"""

from modelzoo.lora.targets import Refusal, Target, TargetTable

A, L = "decoder.layers.*.self_attention", "decoder.layers.*"
SHARED = f"{L}.mlp.shared_experts"
HC = "hyper-connection parameters (fn, base, scale) are not linears"

LORA_TARGETS = TargetTable(
    targets=(
        Target(f"{A}.linear_q_down_proj", aliases=("q_a_proj", "self_attn.q_a_proj")),                       # wq_a
        Target(f"{A}.linear_q_up_proj", aliases=("wq_b", "linear_q_up_proj", "q_b_proj", "self_attn.q_b_proj")),
        Target(f"{A}.linear_kv", aliases=("wkv", "linear_kv", "kv_proj", "self_attn.kv_proj")),             # replicated
        Target(f"{A}.linear_proj", aliases=("o_b_proj", "self_attn.o_b_proj")),                              # wo_b
        Target(f"{SHARED}.linear_fc1_gate", aliases=("w1", "gate_proj", "shared_experts.gate_proj")),
        Target(f"{SHARED}.linear_fc1_up", aliases=("w3", "up_proj", "shared_experts.up_proj")),
        Target(f"{SHARED}.linear_fc2", aliases=("w2", "down_proj", "shared_experts.down_proj")),
    ),
    refusals=(
        Refusal(f"{A}.linear_o_down_proj", "wo_a is a grouped (block-diagonal) projection: a plain adapter B A on "
                "it adds cross-group terms the model cannot express", aliases=("o_a_proj",)),
        Refusal(f"{A}.indexer", "the indexer (its wq_b, weights_proj, wk) picks the compressed latents through a "
                "top-k, which passes no gradient: it is not trained by LoRA", aliases=("indexer.q_b_proj",)),
        Refusal(f"{A}.compressor", "the compressor's weights (wkv, wgate) are not LoRA targets: every later layer "
                "of its ratio reads the latents it publishes", aliases=("compressor.kv_proj", "compressor.gate_proj")),
        Refusal(f"{L}.mlp.experts", "routed experts stay frozen (only the shared expert is adapted)",
                aliases=("gate_up_proj", "experts.gate_up_proj", "experts.down_proj")),
        Refusal(f"{L}.mlp.router", "the router stays frozen", aliases=("e_score_correction_bias",)),
        Refusal(f"{L}.engram", "the Engram (its hash tables, wkv and gate weights) is not adapted: its tables are "
                "embeddings, frozen by default"),
        Refusal("mtp.layers.*.heads", "the DSpark draft layers and their Markov and confidence heads are not "
                "adapted (they are trained after pre-training, with the backbone frozen)",
                aliases=("markov_head", "confidence_head")),
        Refusal("mtp.layers.*.main_proj", "the DSpark draft layers are not adapted", aliases=("dspark",)),
        Refusal(f"{L}.attn_hc", HC),
        Refusal(f"{L}.ffn_hc", HC),
    ),
)
