"""Model layers every architecture shares: attention, the batch layout (sequences), context and sequence
parallelism, fused kernels, activation recompute, CUDA graphs, replicated KV heads, GPTModel's call."""
