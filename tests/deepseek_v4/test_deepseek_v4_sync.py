"""Weight sync of DeepSeek-V4 (tiny checkpoint: a sliding, a CSA, an HCA, a CSA layer and a sliding MTP block).

The stand-in engine is tests/test_weight_sync.py's FusingEngine with V4's fusions written as SGLang declares them
(wq_a + wkv -> wqkv_a; compressor wkv + wgate -> wkv_gate, also the indexer's), independently of
`modelzoo/deepseek_v4/sync.py`: it fails on a pair split across two `load_weights` calls.

Tolerances: none. Weights are moved, never recomputed (merged mode: the merge is recomputed from the same fp32
tensors by the same code), so what the engine reassembles must equal the export bit for bit (`torch.equal`,
same dtype).
"""

import re
from pathlib import Path

import pytest
import torch
from dsv4_helpers import provider_for
from test_weight_sync import FusingEngine, chunk_size_cases, group_sizes, unequal_tensors

from modelzoo.conversion.sync import GroupIndex, UpdateGroupError
from modelzoo import lora, runtime
from modelzoo.deepseek_v4.release.checkpoint import hf_to_native as to_native
from modelzoo.deepseek_v4.sync import NAMINGS
from modelzoo.sync import WeightSync, engine_naming

TINY = Path(__file__).resolve().parents[2] / "tiny_checkpoints" / "deepseek-v4-tiny"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "weight_sync.md"
V4_ENGINE_FUSIONS = {  # the same leaves under the exported and the release names
    ".attn.wq_a.weight": ".attn.wqkv_a.weight",
    ".attn.wkv.weight": ".attn.wqkv_a.weight",
    ".compressor.wkv.weight": ".compressor.wkv_gate.weight",
    ".compressor.wgate.weight": ".compressor.wkv_gate.weight",
}
NAMING_IDS = ("hf", "native")
# the tiny MTP block is a sliding layer (deepseek_v4/config.py: MTP_LAYER_TYPE): its compressor pairs cannot occur
INACTIVE_IN_TINY = {"mtp.wkv_gate", "mtp.indexer.wkv_gate"}
RANDOM_SIZES = 3


def rename(naming: str):
    return NAMINGS[naming].rename or (lambda name: name)


def sync_into_engine(model, provider, chunk_bytes: int, naming: str, lora_mode: str = "none"):
    engine, sizes = FusingEngine(V4_ENGINE_FUSIONS), []
    for chunk in WeightSync(provider, chunk_bytes, naming=naming, lora=lora_mode).chunks(model):
        engine.receive(chunk)
        sizes.append(chunk.nbytes)
        del chunk
    return engine, sizes


def _sync_cases(model, provider, reference_hf: dict, lora_mode: str) -> dict:
    results = {}
    for naming in NAMING_IDS:
        reference = {rename(naming)(name): tensor for name, tensor in reference_hf.items()}
        index = GroupIndex(engine_naming(provider, naming).groups)
        matched = {found[0].fused for name in reference if (found := index.find(name))}
        cases = chunk_size_cases(reference, RANDOM_SIZES, V4_ENGINE_FUSIONS)
        for case, chunk_bytes in cases.items():
            engine, sizes = sync_into_engine(model, provider, chunk_bytes, naming, lora_mode)
            fused = FusingEngine(V4_ENGINE_FUSIONS).fused_name
            results[naming, case] = dict(
                unequal=unequal_tensors(engine.weights, reference),
                oversized=engine.oversized_chunks_that_are_not_one_unit(sizes, chunk_bytes),
                chunks=len(engine.chunks),
                mixed=[names for names in engine.chunks if len({fused(name) for name in names}) != 1])
        results[naming, "matched-groups"] = matched
        results[naming, "pairs"] = len(group_sizes(reference, V4_ENGINE_FUSIONS))
    return results


def _scenario(rank: int, tp: int) -> dict:
    with runtime.parallel(tp=tp):
        provider = provider_for(TINY)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        export = dict(provider.export_hf_weights(model))
        results = {"none": _sync_cases(model, provider, export, "none")}

        lora.apply_lora(model, provider, lora.LoRAConfig(targets=("all-linear",), rank=4, alpha=8.0))
        generator = torch.Generator().manual_seed(0)  # the same draw on every rank, at the full shape
        with torch.no_grad():
            for name, layer in lora.lora_layers(model):
                B = layer.lora.B
                tp_split = getattr(B, "tensor_model_parallel", False)
                full = torch.randn(B.shape[0] * (tp if tp_split else 1), B.shape[1], generator=generator) * 0.05
                B.copy_(full.chunk(tp, dim=0)[parallel_rank()] if tp_split else full)
        merged = dict(lora.export_merged_hf_weights(model, provider))
        results["merged"] = _sync_cases(model, provider, merged, "merged")
        results["changed-by-merge"] = sorted(name for name in merged if not torch.equal(merged[name], export[name]))
        results["adapter-chunks"] = [[name for name, _ in chunk.tensors]
                                     for chunk in WeightSync(provider, 1, lora="adapter").chunks(model)]
        results["release-adapter"] = [name for name, _ in lora.adapter_hf_weights(model, provider, naming="release")]
        return results


def parallel_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def synced(request):
    """Every rank's results; one run per TP size."""
    return runtime.run(_scenario, request.param, request.param)


@pytest.mark.parametrize("mode", ["none", "merged"])
def test_engine_loads_every_chunk_stream_and_gets_the_export_bit_exactly(synced, mode):
    assert all(rank[mode] == synced[0][mode] for rank in synced)  # every rank gets the same chunks
    results = synced[0][mode]
    for naming in NAMING_IDS:
        cases = {case for name, case in results if name == naming} - {"matched-groups", "pairs"}
        assert cases == {"below-smallest-group", "equal-to-a-group", "above-the-model",
                         *(f"random-{n}" for n in range(RANDOM_SIZES))}
        for case in cases:
            result = results[naming, case]
            assert result["unequal"] == [] and result["oversized"] == [], (naming, case)
        assert results[naming, "above-the-model"]["chunks"] == 1
        # below the smallest pair every chunk is one pair or one lone tensor
        assert results[naming, "below-smallest-group"]["mixed"] == []
        # layers 0-3 and the MTP block have wqkv_a; layers 1-3 the compressor pair; layers 1 and 3 the indexer's
        assert results[naming, "pairs"] == 5 + 3 + 2


def test_every_declared_group_that_can_occur_matches(synced):
    for naming in NAMING_IDS:
        declared = {group.fused for group in NAMINGS[naming].groups}
        assert synced[0]["none"][naming, "matched-groups"] == declared - INACTIVE_IN_TINY, naming
    assert engine_naming(provider_for(TINY), "hf") == NAMINGS["hf"]


def test_merged_mode_sends_the_merged_weights(synced):
    changed = synced[0]["changed-by-merge"]
    leaves = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "ffn.shared_experts.w1", "ffn.shared_experts.w3",
              "ffn.shared_experts.w2")
    assert changed == sorted(f"model.layers.{n}.{leaf}.weight" for n in range(4) for leaf in leaves)


def test_adapter_tensors_of_a_pair_travel_together(synced):
    chunks = synced[0]["adapter-chunks"]
    prefix = "base_model.model.model.layers"
    for n in range(4):
        pair = [f"{prefix}.{n}.attn.{leaf}.lora_{half}.weight" for leaf in ("wq_a", "wkv") for half in "AB"]
        assert pair in chunks, n
    assert sum(map(len, chunks)) == 4 * 7 * 2
    # the engine's modules: the adapter save_adapter(naming="release") writes, not transformers' module names
    assert sorted(name for chunk in chunks for name in chunk) == sorted(synced[0]["release-adapter"])


# --- names and group edge cases (TP 1, no process group) ----------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    with runtime.parallel(tp=1):
        provider = provider_for(TINY)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
    return provider, model, dict(provider.export_hf_weights(model))


@pytest.mark.parametrize("naming", NAMING_IDS)
@pytest.mark.parametrize("dropped", ["layers.1.attn.compressor.wgate.weight", "layers.3.attn.indexer.compressor.wkv.weight",
                                     "layers.2.attn.wq_a.weight", "mtp.0.attn.wkv.weight"])
def test_a_missing_half_stops_the_sync_before_its_last_chunk(monkeypatch, tiny, naming, dropped):
    provider, model, _ = tiny
    exported = "model." + dropped if dropped.startswith("layers.") else dropped
    export = provider.export_hf_weights
    monkeypatch.setattr(provider, "export_hf_weights",
                        lambda model: ((name, t) for name, t in export(model) if name != exported))
    received = []
    with pytest.raises(UpdateGroupError, match=f"incomplete: missing {re.escape(rename(naming)(exported))}"):
        for chunk in WeightSync(provider, 1 << 20, naming=naming).chunks(model):
            received.append(chunk.is_last)
    assert True not in received


def test_layers_without_a_compressor_or_an_indexer_sync_without_error(tiny):
    provider, model, reference = tiny
    # the pairs that do not apply: layer 0 (sliding) and the MTP block have no compressor, layer 2 (HCA) no indexer
    assert not [name for name in reference if re.match(r"(model\.layers\.0|mtp\.0)\.attn\.(compressor|indexer)", name)]
    assert not [name for name in reference if name.startswith("model.layers.2.attn.indexer")]
    for naming in NAMING_IDS:
        engine, _ = sync_into_engine(model, provider, 1, naming)
        assert unequal_tensors(engine.weights, {rename(naming)(n): t for n, t in reference.items()}) == []


def test_hf_naming_is_the_exported_names_and_native_the_release_names(tiny):
    provider, model, reference = tiny
    hf_names = [name for chunk in WeightSync(provider, 1 << 30, naming="hf").chunks(model) for name, _ in chunk.tensors]
    assert sorted(hf_names) == sorted(reference)
    native = [to_native(name) for name in reference]
    # engines load V4 by its release names: the default
    default = [name for chunk in WeightSync(provider, 1 << 30).chunks(model) for name, _ in chunk.tensors]
    assert sorted(default) == sorted(native)
    assert len(set(native)) == len(native)
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
            "layers.0.attn.kv_norm.weight", "layers.1.attn.compressor.norm.weight"} <= set(native)
    assert not [name for name in native if name.startswith("model.")]
    # release leaves: a main sliding layer's attention is named like the MTP block's (which the bridge writes
    # under the release names)
    leaves = {prefix: {name.removeprefix(prefix) for name in native if name.startswith(prefix + "attn.")}
              for prefix in ("layers.0.", "mtp.0.")}
    assert leaves["layers.0."] == leaves["mtp.0."] and "attn.kv_norm.weight" in leaves["mtp.0."]


def test_native_names_load_into_transformers_as_the_exported_ones_do(tiny):
    """transformers' conversion_mapping "deepseek_v4" (the authority on renames) takes a release name and our
    exported name of each tensor to the same transformers parameter."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    provider, _, reference = tiny
    with torch.device("meta"):
        hf = DeepseekV4ForCausalLM(provider.hf_config)
    conversions = get_model_conversion_mapping(hf)
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    params = hf.state_dict()

    def loaded_as(name: str) -> str:
        renamed = rename_source_key(name, renamings, converters, hf.base_model_prefix, params)[0]
        # transformers keeps a key that already names a parameter (its `.norm.` -> `.kv_norm.` rename would
        # otherwise catch `model.norm.weight`)
        return renamed if renamed in params else name

    main = [name for name in reference if not name.startswith("mtp.")]  # transformers builds no MTP
    assert [name for name in main if loaded_as(name) not in params] == []
    assert [name for name in main if loaded_as(to_native(name)) != loaded_as(name)] == []
    assert all(to_native(name) == name for name in reference if name.startswith("mtp."))


def test_the_documented_table_is_the_shipped_one(tiny):
    block = re.search(r"```python\n(# modelzoo/deepseek_v4/sync\.py.*?)```", DOCS.read_text(), re.S)
    assert block, f"{DOCS}: the DeepSeek-V4 block is missing"
    namespace = {}
    exec(block.group(1), namespace)  # noqa: S102 - our own documentation
    documented = namespace["NAMINGS"]
    assert documented.keys() == NAMINGS.keys()
    for naming in NAMINGS:
        assert documented[naming].groups == NAMINGS[naming].groups, naming
    names = list(tiny[2])
    assert [documented["native"].rename(name) for name in names] == [to_native(name) for name in names]
    assert documented["hf"].rename is None
