"""DeepSeek-V4.1: the tensors vLLM and SGLang fuse on load, so a weight sync sends each group in one call.

vLLM's and SGLang's V4.1 loaders fuse the attention's wq_a + wkv (`fused_wqa_wkv`), a pooling KV source's compressor
wkv + wgate (`fused_wkv_wgate`; a ratio-1 source has no wgate) and each expert's w1 + w3 (`gate_up_proj`, routed and
shared). A group with one member missing stops the sync, so the compressor pairs are declared for the layers that
pool, read from the config (`NAMINGS(text_config)`, which the provider's `sync_namings()` returns). The DSpark
layers (`mtp.K`) are sliding-window layers with the attention and expert pairs.

Namings. `hf`: the names `export_hf_weights` yields (transformers main's: release leaves under `model.`,
`lm_head`). `native`: the release checkpoint's names, as vLLM and SGLang load V4.1 (`layers.N.*`, `embed`,
`head`, `norm`, `mtp.K.*`, `vision.*`): the exported name without `model.`, `lm_head` as `head` (release.py). For a text model
the engines drop `mtp.*`, `vision.*`, `aligner.*` and `image_*` on load; they are sent all the same (an engine that
serves DSpark or images reads them).
"""

from modelzoo.conversion.sync import Naming, UpdateGroup
from modelzoo.deepseek_v41.release import hf_to_native


def _update_groups(layer: str, prefix: str = "") -> tuple[UpdateGroup, ...]:
    """The groups every block whose tensors are named `<layer>.*` has."""
    return (
        UpdateGroup(f"{prefix}fused_wqa_wkv", (f"{layer}.attn.wq_a.weight", f"{layer}.attn.wkv.weight")),
        UpdateGroup(f"{prefix}experts.gate_up_proj", (f"{layer}.ffn.experts.*.w1.weight",
                                                      f"{layer}.ffn.experts.*.w3.weight")),
        UpdateGroup(f"{prefix}shared_experts.gate_up_proj", (f"{layer}.ffn.shared_experts.w1.weight",
                                                             f"{layer}.ffn.shared_experts.w3.weight")),
    )


def _compressor_groups(layers: str, pooling_sources: list[int]) -> tuple[UpdateGroup, ...]:
    """wkv + wgate of each KV source that pools (ratio > 1); a ratio-1 source's compressor has no wgate, so its wkv
    travels alone. `layers`: the layers' prefix ("model.layers", "layers")."""
    return tuple(UpdateGroup("fused_wkv_wgate", (f"{layers}.{i}.attn.compressor.wkv.weight",
                                                 f"{layers}.{i}.attn.compressor.wgate.weight"))
                 for i in pooling_sources)


MTP_GROUPS = _update_groups("mtp.*", prefix="mtp.")


def NAMINGS(text_config=None) -> dict[str, Naming]:  # noqa: N802 - the provider's sync_namings() returns it
    """The namings of a model of `text_config` (its DeepseekV41TextConfig): the compressor pairs sit at its pooling
    KV sources. Without a config (the provider class, not a provider): the groups every V4.1 model has."""
    pooling = [] if text_config is None else [i for i in text_config.kv_source_layer_ids
                                              if text_config.compress_ratios[i] > 1]
    return {"hf": Naming(_update_groups("model.layers.*") + _compressor_groups("model.layers", pooling) + MTP_GROUPS),
            "native": Naming(_update_groups("layers.*") + _compressor_groups("layers", pooling) + MTP_GROUPS,
                             rename=hf_to_native)}
