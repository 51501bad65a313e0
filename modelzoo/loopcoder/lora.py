"""LoRA targets of LoopCoder: Llama's, with the loop gates refused (also by vLLM's name for them)."""

from modelzoo.llama.lora import LORA_TARGETS as LLAMA_TARGETS
from modelzoo.lora.targets import Refusal, TargetTable

LORA_TARGETS = TargetTable(
    targets=LLAMA_TARGETS.targets,
    refusals=(
        Refusal("decoder.layers.*.self_attention.loop_gate",
                "the loop gates (model.gate_projections, Megatron loop_gate) are frozen and never LoRA targets: "
                "each is a per-head [heads, head_dim] vector, not a linear, and vLLM adapts no gate",
                aliases=("gate_projections.gate_proj",)),
    ),
)
