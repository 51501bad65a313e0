"""Weight sync to inference engines: chunks never split a fused set, reassemble bit-exactly, count versions.

The stand-in engine fuses a parameter only when all its shards arrive in one `load_weights` call and
fails otherwise (SGLang would corrupt the layer). Its list of fused parameters is its own, written as
vLLM / SGLang declare them, not derived from our `UpdateGroup` tables: a wrong table fails here.

Tolerances: none. Weights are moved, never recomputed, so reassembled tensors must be bit-identical
(`torch.equal`, same dtype), and the memory bound is checked to the byte (MEMORY_SLACK_BYTES).
"""

import re
import weakref
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from conftest import TINY
from hypothesis import given, settings
from hypothesis import strategies as st

from modelzoo.conversion.sync import (GroupIndex, UpdateGroup, UpdateGroupError, adapter_groups, nbytes,
                             pack_chunks, peft_target_filter)
from modelzoo import build_provider, runtime
from modelzoo.provider import ModelProvider
from modelzoo.llama.provider import LlamaProvider
from modelzoo.llama.sync import NAMINGS as LLAMA_NAMINGS
from modelzoo.sync import WeightSync, engine_naming, iter_weight_chunks

ARCHITECTURES = ("llama-tiny", "loopcoder-tiny")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "weight_sync.md"
MEMORY_SLACK_BYTES = 0

# shard name suffix -> fused parameter suffix, as the engines' stacked_params_mapping declare them; `*` is a layer index
LLAMA_ENGINE_FUSIONS = {
    ".self_attn.q_proj.weight": ".self_attn.qkv_proj.weight",
    ".self_attn.k_proj.weight": ".self_attn.qkv_proj.weight",
    ".self_attn.v_proj.weight": ".self_attn.qkv_proj.weight",
    ".mlp.gate_proj.weight": ".mlp.gate_up_proj.weight",
    ".mlp.up_proj.weight": ".mlp.gate_up_proj.weight",
}
# vLLM loads a loop gate's weight and bias into one layer, and its in-place reload rebuilds that layer from one call
LOOPCODER_ENGINE_FUSIONS = {
    **LLAMA_ENGINE_FUSIONS,
    ".gate_projections.*.weight": ".gate_projections.*.gate_proj",
    ".gate_projections.*.bias": ".gate_projections.*.gate_proj",
}
ENGINE_FUSIONS = {"llama-tiny": LLAMA_ENGINE_FUSIONS, "loopcoder-tiny": LOOPCODER_ENGINE_FUSIONS}
# vLLM packs the LoRA of a fused module as it packs its weight; here A and B of the whole set in one call
LLAMA_ENGINE_LORA_FUSIONS = {
    shard.replace(".weight", f".lora_{half}.weight"): fused.replace(".weight", ".lora")
    for shard, fused in LLAMA_ENGINE_FUSIONS.items() for half in "AB"
}
DEEPSEEK_V4_NATIVE_ENGINE_FUSIONS = {  # SGLang: wq_a + wkv -> wqkv_a; compressor wkv + wgate -> wkv_gate
    ".attn.wq_a.weight": ".attn.wqkv_a.weight",
    ".attn.wkv.weight": ".attn.wqkv_a.weight",
    ".compressor.wkv.weight": ".compressor.wkv_gate.weight",
    ".compressor.wgate.weight": ".compressor.wkv_gate.weight",
}


class SplitFusionError(AssertionError):
    """The engine got part of a fused parameter's shards in one call."""


class FusingEngine:
    """Receives chunks as an engine's `load_weights` would; keeps a copy of every tensor it loads."""

    def __init__(self, fusions: dict[str, str]):
        self.fusions = fusions
        self.shards_per_fused = Counter(fusions.values())
        self.weights: dict[str, torch.Tensor] = {}
        self.chunks: list[list[str]] = []      # names of each chunk of the current sync
        self.completed_versions: list[int] = []
        self.version = None
        self.peft_config = None

    def fusion(self, name: str) -> tuple[str, int] | None:
        """The fused parameter `name` is a shard of, and its number of shards."""
        for shard_suffix, fused_suffix in self.fusions.items():
            if match := re.search(re.escape(shard_suffix).replace(r"\*", r"(\d+)") + "$", name):
                fused = fused_suffix.replace("*", match.group(1)) if match.groups() else fused_suffix
                return name[:match.start()] + fused, self.shards_per_fused[fused_suffix]
        return None

    def fused_name(self, name: str) -> str | None:
        fusion = self.fusion(name)
        return fusion and fusion[0]

    def load_weights(self, tensors) -> None:
        shards, needed = defaultdict(list), {}
        for name, tensor in tensors:
            assert name not in self.weights, f"{name} loaded twice in one sync"
            self.weights[name] = tensor.clone()
            if (fusion := self.fusion(name)) is not None:
                shards[fusion[0]].append(name)
                needed[fusion[0]] = fusion[1]
        for fused, names in shards.items():
            if len(names) != needed[fused]:
                raise SplitFusionError(f"{fused}: {len(names)} of its {needed[fused]} shards in one call ({names})")

    def receive(self, chunk) -> None:
        if chunk.index == 0:
            self.weights, self.chunks, self.version = {}, [], chunk.version
        assert (chunk.version, chunk.index) == (self.version, len(self.chunks)), "chunk out of sequence"
        self.load_weights(chunk.tensors)
        self.chunks.append([name for name, _ in chunk.tensors])
        self.peft_config = chunk.peft_config
        if chunk.is_last:
            self.completed_versions.append(chunk.version)

    def oversized_chunks_that_are_not_one_unit(self, sizes: list[int], chunk_bytes: int) -> list[list[str]]:
        """A chunk may exceed chunk_bytes only as one lone tensor or one fused set."""
        return [names for names, size in zip(self.chunks, sizes) if size > chunk_bytes and len(names) > 1
                and len({self.fused_name(name) for name in names} - {None}) != 1]


def sync_into_engine(model, provider, chunk_bytes: int, lora: str = "none",
                     fusions: dict[str, str] = LLAMA_ENGINE_FUSIONS) -> tuple[FusingEngine, list[int]]:
    engine, sizes = FusingEngine(fusions), []
    for chunk in iter_weight_chunks(model, provider, chunk_bytes, lora=lora):
        engine.receive(chunk)
        sizes.append(chunk.nbytes)
    return engine, sizes


def unequal_tensors(received: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[str]:
    assert received.keys() == reference.keys()
    return [name for name, tensor in reference.items()
            if received[name].dtype != tensor.dtype or not torch.equal(received[name], tensor)]


def group_sizes(reference: dict[str, torch.Tensor], fusions: dict[str, str] = LLAMA_ENGINE_FUSIONS) -> list[int]:
    engine = FusingEngine(fusions)
    by_fused = defaultdict(list)
    for name, tensor in reference.items():
        if (fused := engine.fused_name(name)) is not None:
            by_fused[fused].append((name, tensor))
    return [nbytes(tensors) for tensors in by_fused.values()]


def chunk_size_cases(reference: dict[str, torch.Tensor], random_count: int = 0,
                     fusions: dict[str, str] = LLAMA_ENGINE_FUSIONS) -> dict[str, int]:
    total, groups = nbytes(list(reference.items())), group_sizes(reference, fusions)
    cases = {"below-smallest-group": min(groups) - 1, "equal-to-a-group": groups[0], "above-the-model": total + 1}
    generator = torch.Generator().manual_seed(0)  # the same sizes on every rank
    for n in range(random_count):
        cases[f"random-{n}"] = int(torch.randint(1, total + 1, (), generator=generator))
    return cases


def build(path: Path):
    provider = build_provider(path)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    return provider, model


LORA_API = ("apply_lora", "LoRAConfig", "adapter_parameters", "export_merged_hf_weights", "adapter_hf_weights",
            "peft_config")


def missing_lora_functions() -> list[str]:
    try:
        import modelzoo.lora as lora
    except ModuleNotFoundError:
        return list(LORA_API)
    return [name for name in LORA_API if not hasattr(lora, name)]


NO_LORA = f"modelzoo.lora lacks {missing_lora_functions()}"


def _sync_full_weights(random_count: int) -> dict:
    results = {}
    for architecture in ARCHITECTURES:
        provider, model = build(TINY / architecture)
        reference = dict(provider.export_hf_weights(model))
        fusions = ENGINE_FUSIONS[architecture]
        for case, chunk_bytes in chunk_size_cases(reference, random_count, fusions).items():
            engine, sizes = sync_into_engine(model, provider, chunk_bytes, fusions=fusions)
            results[architecture, case] = dict(
                chunks=engine.chunks, unequal=unequal_tensors(engine.weights, reference),
                oversized=engine.oversized_chunks_that_are_not_one_unit(sizes, chunk_bytes))
    return results


def _sync_lora_modes(random_count: int) -> dict:
    from modelzoo import lora

    provider, model = build(TINY / "llama-tiny")
    base = dict(provider.export_hf_weights(model))
    lora.apply_lora(model, provider, lora.LoRAConfig(targets=("all-linear",), rank=4, alpha=8.0))
    with pytest.raises(ValueError, match="has LoRA adapters"):
        next(iter_weight_chunks(model, provider, 1 << 20))
    # B starts at zero: the merged weights are the base weights, bit for bit
    engine, _ = sync_into_engine(model, provider, min(group_sizes(base)) - 1, lora="merged")
    results = {"zero-B-unequal-to-base": unequal_tensors(engine.weights, base), "modes": {}}
    generator = torch.Generator().manual_seed(0)  # the same draw on every rank
    with torch.no_grad():
        for name, param in lora.adapter_parameters(model).items():
            if name.endswith(".B"):
                param.copy_(torch.randn(param.shape, generator=generator))
    merged = dict(lora.export_merged_hf_weights(model, provider))
    results["changed-by-merge"] = sorted(name for name in merged if not torch.equal(merged[name], base[name]))
    adapters, config = dict(lora.adapter_hf_weights(model, provider)), lora.peft_config(model, provider)
    for mode, reference, fusions in (("merged", merged, LLAMA_ENGINE_FUSIONS),
                                     ("adapter", adapters, LLAMA_ENGINE_LORA_FUSIONS)):
        for case, chunk_bytes in chunk_size_cases(reference, random_count, fusions).items():
            engine, sizes = sync_into_engine(model, provider, chunk_bytes, lora=mode, fusions=fusions)
            results["modes"][mode, case] = dict(
                unequal=unequal_tensors(engine.weights, reference),
                oversized=engine.oversized_chunks_that_are_not_one_unit(sizes, chunk_bytes),
                peft_config_sent=engine.peft_config == (config if mode == "adapter" else None))
    return results


def _sync_every_mode(rank, tp):
    random_count = 3 if tp > 1 else 0  # at TP 1 hypothesis draws the random sizes
    with runtime.parallel(tp=tp):
        return {"none": _sync_full_weights(random_count),
                "lora": None if missing_lora_functions() else _sync_lora_modes(random_count)}


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def synced_at_tp(request):
    """Each rank's results of syncing llama-tiny and loopcoder-tiny in every mode; one run per TP size."""
    return runtime.run(_sync_every_mode, request.param, request.param)


def test_engine_loads_every_chunk_stream_and_gets_the_export_bit_exactly(synced_at_tp):
    per_rank = [results["none"] for results in synced_at_tp]
    for results in per_rank:
        for (architecture, case), result in results.items():
            assert result["unequal"] == [], f"{architecture}, {case}"
            assert result["oversized"] == [], f"{architecture}, {case}"
        assert {case for _, case in results} >= {"below-smallest-group", "equal-to-a-group", "above-the-model"}
    # every rank receives the same chunks (the gathers are collective)
    assert all(results == per_rank[0] for results in per_rank)
    results = per_rank[0]
    for architecture in ARCHITECTURES:
        fused_name = FusingEngine(ENGINE_FUSIONS[architecture]).fused_name
        assert len(results[architecture, "above-the-model"]["chunks"]) == 1
        # below the smallest group a fused set shares its chunk with nothing else
        for names in results[architecture, "below-smallest-group"]["chunks"]:
            assert len({fused_name(name) for name in names}) == 1, names


@pytest.mark.skipif(bool(missing_lora_functions()), reason=NO_LORA)
def test_merged_and_adapter_modes_reassemble_the_lora_exports_bit_exactly(synced_at_tp):
    for results in (results["lora"] for results in synced_at_tp):
        assert results["zero-B-unequal-to-base"] == []
        changed = results["changed-by-merge"]
        assert len(changed) == 7 * 2, changed  # q, k, v, o, gate, up, down of both layers
        assert {mode for mode, _ in results["modes"]} == {"merged", "adapter"}
        for key, result in results["modes"].items():
            assert result == dict(unequal=[], oversized=[], peft_config_sent=True), key


@pytest.fixture(scope="module")
def tiny_models():
    with runtime.parallel(tp=1):
        built = {architecture: build(TINY / architecture) for architecture in ARCHITECTURES}
    # at TP 1 export needs no process group: the models are used after the parallel state is gone
    return {architecture: (provider, model, dict(provider.export_hf_weights(model)))
            for architecture, (provider, model) in built.items()}


@settings(max_examples=30, deadline=None)
@given(architecture=st.sampled_from(ARCHITECTURES), fraction=st.floats(0.0, 1.5))
def test_engine_loads_a_stream_of_random_chunk_size(tiny_models, architecture, fraction):
    provider, model, reference = tiny_models[architecture]
    chunk_bytes = max(1, int(fraction * nbytes(list(reference.items()))))
    engine, sizes = sync_into_engine(model, provider, chunk_bytes, fusions=ENGINE_FUSIONS[architecture])
    assert unequal_tensors(engine.weights, reference) == []
    assert engine.oversized_chunks_that_are_not_one_unit(sizes, chunk_bytes) == []


def test_engine_fails_on_a_chunker_without_groups(tiny_models):
    # the control: the same packer with no groups declared splits q | k and the engine notices
    provider, model, reference = tiny_models["llama-tiny"]
    chunk_bytes = min(group_sizes(reference)) - 1
    engine = FusingEngine(LLAMA_ENGINE_FUSIONS)
    with pytest.raises(SplitFusionError, match="shards in one call"):
        for chunk, _ in pack_chunks(provider.export_hf_weights(model), GroupIndex(()), chunk_bytes):
            engine.load_weights(chunk)


def test_versions_count_completed_syncs_and_the_order_is_deterministic(tiny_models):
    provider, model, _ = tiny_models["loopcoder-tiny"]
    sync, engine = WeightSync(provider, chunk_bytes=30_000), FusingEngine(LOOPCODER_ENGINE_FUSIONS)
    layouts = []
    for _ in range(3):
        for chunk in sync.chunks(model):
            engine.receive(chunk)
        layouts.append(engine.chunks)
    assert engine.completed_versions == [1, 2, 3]
    assert layouts[0] == layouts[1] == layouts[2]
    # an abandoned sync is not counted, even one whose last chunk was handed out: its retry carries the same version
    for chunk in sync.chunks(model):
        if chunk.is_last:
            break  # as if the engine failed to load it
    assert (chunk.version, sync.version) == (4, 3)
    assert next(sync.chunks(model)).version == 4


def many_small_layers(make_tiny):
    provider = build_provider({**make_tiny.LLAMA_TINY, "num_hidden_layers": 16, "hidden_size": 32,
                               "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "vocab_size": 128})
    with runtime.parallel(tp=1):
        return provider, provider.provide()


class LiveTensorMeter:
    """Bytes of exported tensors still referenced anywhere (weakrefs hold no reference), and the peak."""

    def __init__(self):
        self.watched: list[tuple[weakref.ref, int]] = []
        self.peak = 0

    def live_bytes(self) -> int:
        return sum(size for ref, size in self.watched if ref() is not None)

    def record(self) -> None:
        self.peak = max(self.peak, self.live_bytes())

    def watch(self, tensors):
        for name, tensor in tensors:
            self.watched.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
            self.record()  # what the chunker holds while it asks for more, this tensor included
            yield name, tensor


def buffer_everything(tensors, index, chunk_bytes):
    """The control: a chunker that reads the whole export before packing."""
    yield from pack_chunks(list(tensors), index, chunk_bytes)


@pytest.mark.parametrize("packer", [pack_chunks, buffer_everything], ids=["ours", "control-buffers-everything"])
@pytest.mark.parametrize("chunk_multiple", [0, 1, 3], ids=["1-byte", "largest-unit", "3x-largest-unit"])
def test_resident_chunk_tensors_stay_within_one_chunk_plus_one_group(monkeypatch, make_tiny, packer, chunk_multiple):
    provider, model = many_small_layers(make_tiny)
    reference = list(provider.export_hf_weights(model))
    index = GroupIndex(engine_naming(provider, "hf").groups)
    largest_unit = max(nbytes(unit) for unit, _ in pack_chunks(reference, index, 1))
    del reference
    chunk_bytes = max(1, chunk_multiple * largest_unit)
    meter = LiveTensorMeter()
    export = provider.export_hf_weights
    monkeypatch.setattr(provider, "export_hf_weights", lambda model: meter.watch(export(model)))
    monkeypatch.setattr("modelzoo.sync.pack_chunks", packer)
    engine = FusingEngine(LLAMA_ENGINE_FUSIONS)
    for chunk in iter_weight_chunks(model, provider, chunk_bytes):
        meter.record()  # the chunk the engine holds plus what the generator holds between yields
        engine.receive(chunk)
        del chunk       # a consumer that keeps its last chunk while asking for the next holds two
    bound = max(chunk_bytes, largest_unit) + largest_unit + MEMORY_SLACK_BYTES
    assert len(engine.weights) == len(meter.watched) > 16 * 7
    if packer is pack_chunks:
        assert meter.peak <= bound
    else:
        assert meter.peak > bound


def stream(names, size=4):
    return [(name, torch.zeros(size)) for name in names]


def llama_layer_names(layer: int, skip: str = "") -> list[str]:
    names = [f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in "qkvo"]
    names += [f"model.layers.{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return [name for name in names if not skip or skip not in name]


def test_a_missing_member_is_named():
    index = GroupIndex(LLAMA_NAMINGS["hf"].groups)
    names = llama_layer_names(0) + llama_layer_names(1, skip="v_proj")
    with pytest.raises(UpdateGroupError, match=r"qkv_proj .*incomplete: missing model\.layers\.1\.self_attn\.v_proj"):
        list(pack_chunks(stream(names), index, 1 << 20))


def test_a_tensor_belongs_to_at_most_one_group():
    qkv, gate_up = LLAMA_NAMINGS["hf"].groups
    with pytest.raises(UpdateGroupError, match="member of both"):
        GroupIndex((qkv, UpdateGroup("qk", qkv.members[:2])))
    # different patterns, one name: only the stream can tell
    overlapping = UpdateGroup("q_o_of_layer_0", ("model.layers.0.self_attn.q_proj.weight",
                                                 "model.layers.0.self_attn.o_proj.weight"))
    with pytest.raises(UpdateGroupError, match="belongs to 2 update groups"):
        list(pack_chunks(stream(llama_layer_names(0)), GroupIndex((qkv, overlapping)), 1 << 20))
    with pytest.raises(UpdateGroupError, match="appears twice"):
        list(pack_chunks(stream(llama_layer_names(0) * 2), GroupIndex((qkv, gate_up)), 1 << 20))


def test_native_naming_is_refused_where_there_is_none_and_every_architecture_must_declare_groups(tiny_models):
    for architecture in ARCHITECTURES:
        provider = tiny_models[architecture][0]
        with pytest.raises(ValueError, match=f"{provider.name} has no 'native' naming"):
            WeightSync(provider, 1 << 20, naming="native")

    class UndeclaredProvider(LlamaProvider):  # declares no update groups: ModelProvider's sync_namings
        name = "undeclared"
        sync_namings = classmethod(ModelProvider.sync_namings.__func__)

    with pytest.raises(ValueError, match="undeclared: no update groups declared"):
        WeightSync(UndeclaredProvider(tiny_models["llama-tiny"][0].hf_config), 1 << 20)
    with pytest.raises(ValueError, match="lora='fused' is not one of"):
        WeightSync(tiny_models["llama-tiny"][0], 1 << 20, lora="fused")


def test_adapter_tensors_travel_with_their_group_and_follow_pefts_target_rule():
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = {"target_modules": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]}
    targeted = peft_target_filter(config)
    modules = [name.removesuffix(".weight") for n in range(2) for name in llama_layer_names(n)]
    for targets in (config["target_modules"], ["model.layers.1.self_attn.q_proj", "o_proj"], r".*\.(q|v)_proj"):
        ours = [m for m in modules if peft_target_filter({"target_modules": targets})(f"base_model.model.{m}.lora_A.weight")]
        peft = [m for m in modules if check_target_module_exists(LoraConfig(target_modules=targets), m)]
        assert ours == peft, targets
    # PEFT resolves all-linear against the model; every member of an update group is a linear layer
    assert all(peft_target_filter({"target_modules": "all-linear"})(f"base_model.model.{m}.lora_B.weight") for m in modules)
    adapters = [f"base_model.model.{m}.lora_{half}.weight" for m in modules for half in "AB"
                if targeted(f"base_model.model.{m}.lora_A.weight")]
    index = GroupIndex(adapter_groups(LLAMA_NAMINGS["hf"].groups), expects=targeted)
    chunks = [[name for name, _ in chunk] for chunk, _ in pack_chunks(stream(adapters), index, 1)]
    assert ["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight",
            "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight",
            "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] in chunks
    assert sum(map(len, chunks)) == len(adapters)
    untargeted = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    with pytest.raises(UpdateGroupError, match=f"{re.escape(untargeted)} of update group qkv_proj is not expected"):
        list(pack_chunks(stream([untargeted]), index, 1))


def documented_deepseek_v4_table() -> dict:
    """Run the DeepSeek-V4 example of docs/weight_sync.md: it must be valid plain data for the machinery."""
    block = re.search(r"```python\n(# modelzoo/deepseek_v4/sync\.py.*?)```", DOCS.read_text(), re.S)
    assert block, f"{DOCS}: the DeepSeek-V4 example block is missing"
    namespace = {}
    exec(block.group(1), namespace)  # noqa: S102 - our own documentation
    return namespace


def deepseek_v4_exported_names() -> list[str]:
    """Names as the bridge exports them (save_pretrained's) for a sliding, a CSA (compressor + indexer) and an
    HCA (compressor only) layer and one MTP block, in the mapping's rule order."""
    def block(prefix, compressor, indexer):
        names = [f"{prefix}.attn.{leaf}" for leaf in ("wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight",
                                                      "wo_a.weight", "wo_b.weight", "attn_sink")]
        if compressor:
            names += [f"{prefix}.attn.compressor.{leaf}" for leaf in ("wkv.weight", "wgate.weight", "ape", "norm.weight")]
        if indexer:
            names += [f"{prefix}.attn.indexer.compressor.{leaf}" for leaf in ("wkv.weight", "wgate.weight", "ape")]
            names += [f"{prefix}.attn.indexer.wq_b.weight"]
        return names + [f"{prefix}.ffn.shared_experts.w{n}.weight" for n in (1, 3, 2)]

    return ["model.embed_tokens.weight", *block("model.layers.0", False, False), *block("model.layers.1", True, True),
            *block("model.layers.2", True, False), "model.hc_head.hc_fn", "model.norm.weight", "head.weight",
            *block("mtp.0", True, True)]


def test_the_documented_deepseek_v4_table_is_plain_data_the_machinery_accepts():
    namespace = documented_deepseek_v4_table()
    native = namespace["NAMINGS"]["native"]
    names = [native.rename(name) for name in deepseek_v4_exported_names()]
    assert names[:2] == ["embed.weight", "layers.0.attn.wq_a.weight"] and "hc_head_fn" in names
    index = GroupIndex(native.groups)
    assert {index.find(name)[0] for name in names if index.find(name)} == set(native.groups)  # every group matched
    engine = FusingEngine(DEEPSEEK_V4_NATIVE_ENGINE_FUSIONS)
    for chunk, _ in pack_chunks(stream(names), index, 1):
        engine.load_weights(chunk)
    assert len(engine.weights) == len(names)
    hf = namespace["NAMINGS"]["hf"]
    exported_names = [f"model.layers.1.attn.{leaf}.weight" for leaf in (  # the mapping's (save_pretrained) names
        "wq_a", "wq_b", "wkv", "compressor.wkv", "compressor.wgate",
        "indexer.compressor.wkv", "indexer.compressor.wgate", "indexer.wq_b")]
    units = [[name for name, _ in chunk] for chunk, _ in pack_chunks(stream(exported_names), GroupIndex(hf.groups), 1)]
    assert [len(unit) for unit in units] == [1, 2, 2, 2, 1]


@pytest.mark.skipif(bool(missing_lora_functions()), reason=NO_LORA)
def test_adapters_of_some_projections_travel_with_their_group():
    from modelzoo import lora

    with runtime.parallel(tp=1):
        provider, model = build(TINY / "llama-tiny")
        lora.apply_lora(model, provider, lora.LoRAConfig(targets=("q_proj", "v_proj", "gate_proj"), rank=4))
        chunks = [[name.removeprefix("base_model.model.model.layers.") for name, _ in chunk.tensors]
                  for chunk in iter_weight_chunks(model, provider, 1, lora="adapter")]
    assert chunks == [[f"{layer}.{module}.lora_{half}.weight" for module in modules for half in "AB"]
                      for layer in range(2)
                      for modules in (("self_attn.q_proj", "self_attn.v_proj"), ("mlp.gate_proj",))]
