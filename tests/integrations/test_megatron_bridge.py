"""Megatron-Bridge's AutoBridge on modelzoo's LoopCoder, DeepSeek-V4 and V4.1: the same model, logprobs and weights.

The model AutoBridge builds (Megatron-Bridge's provider contract: to_megatron_provider, finalize,
provide_distributed_model, weights loaded by its pre-wrap hook) must give bit-identical log-probabilities to
the one `build_provider` builds, at TP=1 and TP=2 (two gloo processes), and AutoBridge.export_hf_weights must
give back the HF checkpoint bit for bit. Nothing is compared with a tolerance: both paths run the same fp32
math on the same weights, so any difference is a wrong config field or weight.

Runs in .venv-megatron-bridge (made by .ci/setup_megatron_bridge); skipped where megatron.bridge is not installed.
"""

import importlib.util
import logging

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron.bridge is not installed (bash .ci/setup_megatron_bridge)", allow_module_level=True)

import torch
from conftest import TINY
from safetensors.torch import load_file
from transformers import Qwen3Config

from modelzoo import build_provider, lora, runtime
from modelzoo.integrations import megatron_bridge  # registers our bridges
from modelzoo.sync import WeightSync

# after modelzoo.integrations.megatron_bridge, which lets megatron.bridge import under transformers 5.24
from megatron.bridge import AutoBridge
from megatron.bridge.models.conversion.model_bridge import get_model_bridge
from megatron.bridge.models.deepseek.deepseek_v4_bridge import DeepSeekV4Bridge
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM
from megatron.bridge.models.qwen.qwen3_bridge import Qwen3Bridge
from megatron.core.utils import unwrap_model

pytestmark = pytest.mark.megatron_bridge

CHECKPOINTS = {"loopcoder": TINY / "loopcoder-tiny", "deepseek_v4": TINY / "deepseek-v4-tiny",
               "deepseek_v41": TINY / "deepseek-v41-tiny"}
OUR_BRIDGES = {"loopcoder": "LoopCoderBridge", "deepseek_v4": "DeepseekV4Bridge", "deepseek_v41": "DeepseekV41Bridge"}


def tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


def checkpoint_tensors(folder):
    return {name: tensor for path in sorted(folder.glob("*.safetensors")) for name, tensor in load_file(path).items()}


def autobridge_model(checkpoint, tp: int = 1):
    """What a trainer does with Megatron-Bridge; on the CPU the parallel state comes from modelzoo.runtime."""
    bridge = AutoBridge.from_hf_pretrained(checkpoint)
    provider = bridge.to_megatron_provider()
    provider.tensor_model_parallel_size = tp
    provider.finalize()
    [model] = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    return bridge, provider, model


def _both_paths(rank: int, tp: int):
    results = {}
    for architecture, checkpoint in CHECKPOINTS.items():
        with runtime.parallel(tp=tp):
            provider = build_provider(checkpoint)
            ids = tokens(provider.vocab_size)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            ours = provider.token_logprobs(model, ids)

            bridge, bridge_provider, bridge_model = autobridge_model(checkpoint, tp)
            through_bridge = bridge_provider.modelzoo_provider.token_logprobs(bridge_model, ids)
            exported = dict(bridge.export_hf_weights([bridge_model], cpu=True))
        results[architecture] = dict(bridge=type(bridge._model_bridge).__name__, ours=ours,
                                     through_bridge=through_bridge, exported=exported)
    return results


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ranks(request):
    tp = request.param
    return runtime.run(_both_paths, tp, tp)


@pytest.mark.parametrize("architecture", CHECKPOINTS)
def test_autobridge_finds_our_bridge(ranks, architecture):
    for rank in ranks:
        assert rank[architecture]["bridge"] == OUR_BRIDGES[architecture]


@pytest.mark.parametrize("architecture", CHECKPOINTS)
def test_autobridge_model_gives_bit_identical_logprobs(ranks, architecture):
    for rank in ranks:
        ours, through_bridge = rank[architecture]["ours"], rank[architecture]["through_bridge"]
        assert ours.shape == (2, 39)
        assert torch.equal(through_bridge, ours), (through_bridge - ours).abs().max()


@pytest.mark.parametrize("architecture", CHECKPOINTS)
def test_autobridge_export_reproduces_the_checkpoint(ranks, architecture):
    expected = checkpoint_tensors(CHECKPOINTS[architecture])
    for rank in ranks:  # every rank gets full tensors
        exported = rank[architecture]["exported"]
        assert exported.keys() == expected.keys()
        for name, tensor in expected.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_megatron_bridges_own_bridges_still_resolve():
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         architectures=["Qwen3ForCausalLM"])
    bridge = AutoBridge.from_hf_config(config)
    provider = bridge.to_megatron_provider(load_weights=False)
    assert type(bridge._model_bridge) is Qwen3Bridge
    assert type(provider) is GPTModelProvider
    assert (provider.num_layers, provider.hidden_size, provider.qk_layernorm) == (2, 64, True)


def test_ours_replaces_megatron_bridges_deepseek_v4_with_a_log_line(caplog):
    assert megatron_bridge.missing_deepseek_v4_core_fields() == list(megatron_bridge.DEEPSEEK_V4_CORE_FIELDS)
    with caplog.at_level(logging.WARNING, logger=megatron_bridge.__name__):
        assert megatron_bridge.register_deepseek_v4()
    assert ("Megatron-Bridge's DeepSeek-V4 bridge cannot run on megatron-core 0.19.2 (its TransformerConfig has no "
            "enable_hyper_connections, num_residual_streams, csa_compress_ratios, o_groups, moe_n_hash_layers): "
            "modelzoo's DeepSeek-V4 takes its place") in caplog.text


def test_megatron_bridges_own_deepseek_v4_cannot_build_on_this_megatron_core():
    with runtime.parallel():
        provider = DeepSeekV4Bridge().provider_bridge(PreTrainedCausalLM.from_pretrained(CHECKPOINTS["deepseek_v4"]))
        provider.finalize()  # the fields Megatron-Core lacks were set as plain attributes: nothing checks them
        with pytest.raises(ValueError, match="Invalid experimental attention variant: dsv4_hybrid"):
            provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)


def test_megatron_bridges_deepseek_v4_stays_where_megatron_core_has_its_modules(monkeypatch):
    monkeypatch.setattr(megatron_bridge, "missing_deepseek_v4_core_fields", lambda: [])
    registered = dict(get_model_bridge._exact_types)
    assert not megatron_bridge.register_deepseek_v4()
    assert get_model_bridge._exact_types == registered


def test_lora_adapters_merge_and_export_through_autobridge():
    checkpoint = CHECKPOINTS["loopcoder"]
    with runtime.parallel():
        bridge, provider, model = autobridge_model(checkpoint)
        adapted = lora.apply_lora(model, provider.modelzoo_provider, lora.LoRAConfig(targets=("all-linear",), rank=4))
        with torch.no_grad():  # B starts at zero: give the adapters something to merge
            for parameter in lora.adapter_parameters(model).values():
                parameter.normal_(generator=torch.Generator().manual_seed(1))
        merged = dict(bridge.export_hf_weights([model]))
        base = dict(bridge.export_hf_weights([model], merge_adapter_weights=False))
        adapters = dict(bridge.export_adapter_weights([model]))
        expected_merged = dict(lora.export_merged_hf_weights(model, provider.modelzoo_provider))
        expected_adapters = dict(lora.adapter_hf_weights(model, provider.modelzoo_provider))

    checkpoint_weights = checkpoint_tensors(checkpoint)
    assert adapted and base.keys() == merged.keys() == checkpoint_weights.keys()
    assert all(torch.equal(base[name], tensor) for name, tensor in checkpoint_weights.items())
    assert all(torch.equal(merged[name], tensor) for name, tensor in expected_merged.items())
    changed = {name for name in merged if not torch.equal(merged[name], checkpoint_weights[name])}
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert changed == {name for name in merged if name.split(".")[-2] in projections}
    assert adapters.keys() == expected_adapters.keys() and adapters
    assert all(torch.equal(adapters[name], tensor) for name, tensor in expected_adapters.items())


def test_weight_sync_of_an_autobridge_model_sends_the_checkpoint():
    checkpoint = CHECKPOINTS["deepseek_v4"]
    with runtime.parallel():
        bridge, provider, model = autobridge_model(checkpoint)
        sync = WeightSync(provider.modelzoo_provider, chunk_bytes=1 << 16, naming="hf")  # the checkpoint's names
        chunks = list(sync.chunks(unwrap_model(model)))
    sent = [item for chunk in chunks for item in chunk.tensors]
    expected = checkpoint_tensors(checkpoint)
    assert len(chunks) > 1 and chunks[-1].is_last and sync.version == 1
    assert sorted(name for name, _ in sent) == sorted(expected)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in sent)


def test_what_the_bridge_refuses_is_named():
    with runtime.parallel():
        bridge, provider, model = autobridge_model(CHECKPOINTS["loopcoder"])
        with pytest.raises(ValueError, match="allowed_mismatched_params is not supported"):
            bridge.load_hf_weights([model], allowed_mismatched_params=["decoder.*"])
        with pytest.raises(NotImplementedError, match="LoopCoderBridge moves weights with modelzoo's mapping table"):
            bridge.get_conversion_tasks([model])
        with pytest.raises(ValueError, match="build no Megatron-Bridge conversion tasks"):
            list(bridge.export_hf_weights([model], conversion_tasks=[]))
        with pytest.raises(ValueError, match="exclude_adapter_base_prefixes is not supported"):
            list(bridge.export_adapter_weights([model], exclude_adapter_base_prefixes=["decoder.layers.0"]))
        with pytest.raises(ValueError, match="modelzoo models have no virtual pipeline stages: expected one model "
                                             "chunk, got 2"):
            list(bridge.export_hf_weights([model, model]))
        provider.tensor_model_parallel_size = 2
        with pytest.raises(ValueError, match=r"tensor/expert/context/pipeline parallel sizes \(2, 1, 1, 1\) but "
                                             r"Megatron's parallel state has \(1, 1, 1, 1\): call "
                                             r"provider.initialize_model_parallel\(\)"):
            provider.provide()
