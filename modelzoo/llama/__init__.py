"""Llama (HF `LlamaForCausalLM`): the dense baseline that proves the machinery."""
