"""DeepSeek-V4 on Megatron-Core: one file per block (attention, compressor, indexer, hyper-connections, MoE, MTP)."""
