"""Llama: the tensors vLLM and SGLang fuse on load, so a weight sync sends each set in one call.

Names are the HF names of `mapping.py`; Llama has no naming of its own besides them.
"""

from modelzoo.conversion.sync import Naming, UpdateGroup

ATTENTION_QKV = UpdateGroup("qkv_proj", ("model.layers.*.self_attn.q_proj.weight",
                                         "model.layers.*.self_attn.k_proj.weight",
                                         "model.layers.*.self_attn.v_proj.weight"))
MLP_GATE_UP = UpdateGroup("gate_up_proj", ("model.layers.*.mlp.gate_proj.weight",
                                           "model.layers.*.mlp.up_proj.weight"))

NAMINGS = {"hf": Naming(groups=(ATTENTION_QKV, MLP_GATE_UP))}
