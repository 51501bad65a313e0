"""LoRA targets of Llama (Megatron GPTModel). Accepted names come from the weight mapping (mapping.py):
`q_proj` .. `down_proj` on the HF side, `linear_qkv` .. `linear_fc2` on the Megatron side, and `all-linear`.
The fused layers are adapted as a whole (one A, B split per projection on export); `packed_as` is vLLM's name."""

from modelzoo.lora.targets import Target, TargetTable

LORA_TARGETS = TargetTable(targets=(
    Target("decoder.layers.*.self_attention.linear_qkv", packed_as="qkv_proj"),  # q_proj, k_proj, v_proj
    Target("decoder.layers.*.self_attention.linear_proj"),                       # o_proj
    Target("decoder.layers.*.mlp.linear_fc1", packed_as="gate_up_proj"),         # gate_proj, up_proj
    Target("decoder.layers.*.mlp.linear_fc2"),                                   # down_proj
))
