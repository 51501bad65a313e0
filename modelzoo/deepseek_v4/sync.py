"""DeepSeek-V4: the tensors SGLang fuses on load, so a weight sync sends each pair in one call.

SGLang fuses the attention's wq_a + wkv into `wqkv_a` and the compressor's wkv + wgate into `wkv_gate`
(also in the indexer's compressor). Sliding layers have no compressor and HCA layers no indexer: a group
none of whose members a layer has is inactive there, while a pair with one half missing stops the sync.
The MTP blocks (`mtp.K`, release names in both namings) are sliding layers today; their compressor pairs
are declared for a model whose MTP block compresses.

Namings. `hf`: the names `DeepseekV4Provider.export_hf_weights` yields, i.e. transformers' save_pretrained
names (release leaves under `model.`), unchanged. `native`: the release checkpoint's names, as SGLang and
vLLM load V4; `native.hf_to_native` (the release-checkpoint table) maps the exported names to them (checked against transformers'
conversion_mapping "deepseek_v4" in tests/deepseek_v4/test_deepseek_v4_sync.py).
"""

from modelzoo.conversion.sync import Naming, UpdateGroup
from modelzoo.deepseek_v4.release.checkpoint import hf_to_native


def _update_groups(layer: str, prefix: str = "") -> tuple[UpdateGroup, ...]:
    """The pairs of one block whose tensors are named `<layer>.attn.*`."""
    return (
        UpdateGroup(f"{prefix}wqkv_a", (f"{layer}.attn.wq_a.weight", f"{layer}.attn.wkv.weight")),
        UpdateGroup(f"{prefix}wkv_gate", (f"{layer}.attn.compressor.wkv.weight",
                                          f"{layer}.attn.compressor.wgate.weight")),
        UpdateGroup(f"{prefix}indexer.wkv_gate", (f"{layer}.attn.indexer.compressor.wkv.weight",
                                                  f"{layer}.attn.indexer.compressor.wgate.weight")),
    )


MTP_GROUPS = _update_groups("mtp.*", prefix="mtp.")
HF_GROUPS = _update_groups("model.layers.*") + MTP_GROUPS     # exported (save_pretrained) names
NATIVE_GROUPS = _update_groups("layers.*") + MTP_GROUPS       # release names

NAMINGS = {"hf": Naming(HF_GROUPS), "native": Naming(NATIVE_GROUPS, rename=hf_to_native)}
