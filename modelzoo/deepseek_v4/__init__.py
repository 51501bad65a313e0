"""DeepSeek-V4 (HF `DeepseekV4ForCausalLM`): hybrid sliding / compressed / sparse attention, mHC, hash + routed MoE, MTP.

    config.py   HF config -> DeepseekV4Args + TransformerConfig fields
    model/      attention, compressor, indexer, hyper_connection, moe, mtp, model
    mapping.py   the HF <-> Megatron name table
    tiny.py     the deterministic tiny checkpoint
"""
