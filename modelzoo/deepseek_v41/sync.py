"""DeepSeek-V4.1: the tensors vLLM and SGLang fuse on load, so a weight sync sends each group in one call.

vLLM's and SGLang's V4.1 loaders fuse the attention's wq_a + wkv (`fused_wqa_wkv`), a KV source's compressor
wkv + wgate (`fused_wkv_wgate`; ratio-1 sources have no wgate: the group is inactive there) and each expert's
w1 + w3 (`gate_up_proj`, routed and shared). A group none of whose members a layer has is inactive there; a group
with one member missing stops the sync. The DSpark layers (`mtp.K`) are sliding-window layers with the same pairs.

Namings. `hf`: the names `export_hf_weights` yields (transformers main's: release leaves under `model.`,
`lm_head`). `native`: the release checkpoint's names, as vLLM and SGLang load V4.1 (`layers.N.*`, `embed`,
`head`, `norm`, `mtp.K.*`, `vision.*`): the exported name without `model.`, `lm_head` as `head`. For a text model
the engines drop `mtp.*`, `vision.*`, `aligner.*` and `image_*` on load; they are sent all the same (an engine that
serves DSpark or images reads them).
"""

from conversion.sync import Naming, UpdateGroup


def _update_groups(layer: str, prefix: str = "") -> tuple[UpdateGroup, ...]:
    """The groups of one block whose tensors are named `<layer>.*`."""
    return (
        UpdateGroup(f"{prefix}fused_wqa_wkv", (f"{layer}.attn.wq_a.weight", f"{layer}.attn.wkv.weight")),
        UpdateGroup(f"{prefix}fused_wkv_wgate", (f"{layer}.attn.compressor.wkv.weight",
                                                 f"{layer}.attn.compressor.wgate.weight")),
        UpdateGroup(f"{prefix}experts.gate_up_proj", (f"{layer}.ffn.experts.*.w1.weight",
                                                      f"{layer}.ffn.experts.*.w3.weight")),
        UpdateGroup(f"{prefix}shared_experts.gate_up_proj", (f"{layer}.ffn.shared_experts.w1.weight",
                                                             f"{layer}.ffn.shared_experts.w3.weight")),
    )


def hf_to_native(name: str) -> str:
    """An exported (transformers main) name -> the release's."""
    return "head.weight" if name == "lm_head.weight" else name.removeprefix("model.")


MTP_GROUPS = _update_groups("mtp.*", prefix="mtp.")
HF_GROUPS = _update_groups("model.layers.*") + MTP_GROUPS
NATIVE_GROUPS = _update_groups("layers.*") + MTP_GROUPS

NAMINGS = {"hf": Naming(HF_GROUPS), "native": Naming(NATIVE_GROUPS, rename=hf_to_native)}
