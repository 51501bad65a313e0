"""Weight sync of DeepSeek-V4.1 (deepseek-v41-tiny at TP 2): every chunk stream reaches a stand-in engine that fuses
as vLLM's and SGLang's V4.1 loaders do (wq_a + wkv, the compressor's wkv + wgate, each expert's w1 + w3), written
here independently of `modelzoo/deepseek_v41/sync.py`: it fails on a group split across two `load_weights` calls.

Tolerances: none. Weights are moved, never recomputed (merged mode: the merge is recomputed from the same fp32
tensors by the same code), so what the engine reassembles must equal the export bit for bit.
"""

import pytest
import torch
from dsv41_helpers import V41_TINY
from test_weight_sync import FusingEngine, chunk_size_cases, group_sizes, unequal_tensors

from modelzoo.conversion.sync import GroupIndex
from modelzoo import build_provider, lora, runtime
from modelzoo.sync import WeightSync, engine_naming

def _pooling_layers() -> list[int]:
    """The layers whose compressor has a wgate, read from the checkpoint's names."""
    from safetensors import safe_open

    with safe_open(V41_TINY / "model.safetensors", "pt") as tensors:
        return sorted(int(name.split(".")[2]) for name in tensors.keys() if name.endswith(".compressor.wgate.weight"))


V41_ENGINE_FUSIONS = {  # the same leaves under the exported and the release names
    ".attn.wq_a.weight": ".attn.fused_wqa_wkv.weight",
    ".attn.wkv.weight": ".attn.fused_wqa_wkv.weight",
    **{f"layers.{layer}.attn.compressor.{leaf}.weight": f"layers.{layer}.attn.compressor.fused_wkv_wgate.weight"
       for layer in _pooling_layers() for leaf in ("wkv", "wgate")},  # a ratio-1 compressor's wkv loads alone
    ".ffn.experts.*.w1.weight": ".ffn.experts.*.gate_up_proj.weight",
    ".ffn.experts.*.w3.weight": ".ffn.experts.*.gate_up_proj.weight",
    ".shared_experts.w1.weight": ".shared_experts.gate_up_proj.weight",
    ".shared_experts.w3.weight": ".shared_experts.gate_up_proj.weight",
}
RANDOM_SIZES = 2


def _sync_cases(model, provider, export: dict, lora_mode: str) -> dict:
    results = {}
    for naming in ("hf", "native"):
        rename = provider.sync_namings()[naming].rename or (lambda name: name)
        reference = {rename(name): tensor for name, tensor in export.items()}
        index = GroupIndex(engine_naming(provider, naming).groups)
        results[naming, "matched-groups"] = {found[0].fused for name in reference if (found := index.find(name))}
        for case, chunk_bytes in chunk_size_cases(reference, RANDOM_SIZES, V41_ENGINE_FUSIONS).items():
            engine, sizes = FusingEngine(V41_ENGINE_FUSIONS), []
            for chunk in WeightSync(provider, chunk_bytes, naming=naming, lora=lora_mode).chunks(model):
                engine.receive(chunk)
                sizes.append(chunk.nbytes)
            results[naming, case] = (unequal_tensors(engine.weights, reference),
                                     engine.oversized_chunks_that_are_not_one_unit(sizes, chunk_bytes))
        results[naming, "groups"] = len(group_sizes(reference, V41_ENGINE_FUSIONS))
        results[naming, "names"] = sorted(reference)
        results[naming, "declared"] = {group.fused for group in provider.sync_namings()[naming].groups}
    return results


def _scenario(rank: int) -> dict:
    with runtime.parallel(tp=2):
        provider = build_provider(V41_TINY)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        results = {"none": _sync_cases(model, provider, dict(provider.export_hf_weights(model)), "none")}
        lora.apply_lora(model, provider, lora.LoRAConfig(targets=("all-linear",), rank=4, alpha=8.0))
        with torch.no_grad():
            for _, layer in lora.lora_layers(model):
                layer.lora.B.fill_(0.01)
        results["merged"] = _sync_cases(model, provider, dict(lora.export_merged_hf_weights(model, provider)),
                                        "merged")
        return results


@pytest.fixture(scope="module")
def synced():
    return runtime.run(_scenario, 2)


@pytest.mark.parametrize("mode", ["none", "merged"])
@pytest.mark.parametrize("naming", ["hf", "native"])
def test_engine_loads_every_chunk_stream_and_gets_the_export_bit_exactly(synced, mode, naming):
    assert all(rank[mode] == synced[0][mode] for rank in synced)  # every rank gets the same chunks
    results = synced[0][mode]
    cases = {case for name, case in results if name == naming} - {"matched-groups", "groups", "names", "declared"}
    assert cases == {"below-smallest-group", "equal-to-a-group", "above-the-model", "random-0", "random-1"}
    for case in cases:
        assert results[naming, case] == ([], []), case
    # every declared group occurs in the tiny model (the DSpark layers have the pairs too)
    assert results[naming, "matched-groups"] == results[naming, "declared"]


def test_only_the_pooling_sources_compressors_are_paired():
    provider = build_provider(V41_TINY)
    pairs = [group.members for group in provider.sync_namings()["hf"].groups if group.fused == "fused_wkv_wgate"]
    assert [int(wkv.split(".")[2]) for wkv, _ in pairs] == [2, 4]  # layer 6 (ratio 1) has no wgate


def test_native_names_are_the_release_names(synced):
    names = synced[0]["none"]["native", "names"]
    assert "head.weight" in names and "embed.weight" in names and "norm.weight" in names
    assert "layers.2.attn.compressor.wgate.weight" in names and "mtp.2.markov_head.embed.weight" in names
    assert "image_start" in names and not any(name.startswith("model.") or name == "lm_head.weight" for name in names)
