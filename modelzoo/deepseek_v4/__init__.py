"""DeepSeek-V4 (HF `DeepseekV4ForCausalLM`): hybrid sliding / compressed / sparse attention, mHC, hash + routed MoE, MTP.

    config.py    HF config -> DeepseekV4Args + TransformerConfig fields
    provider.py  the provider (`build_provider` entry; CLI options and the "native" format it adds)
    model/       attention, compressor, indexer, hyper_connection, moe, mtp, model
    mapping.py   the HF <-> Megatron name table
    lora.py      LoRA targets; sync.py: the update groups of a weight sync
    release/     the release checkpoint format: native names, FP8 / MXFP4 weights
"""
