"""The DeepSeek-V4.1 text model on Megatron-Core parallel layers (attention, engram, moe, model)."""
