"""Target names: HF, Megatron and all-linear agree; refusals, unknown names, aliases and ambiguity (no model run)."""

import pytest
from lora_helpers import CHECKPOINTS

from modelzoo.conversion.mapping import MappingTable, Rule
from modelzoo.conversion.transforms import Stack
from modelzoo import build_provider, runtime
from modelzoo.lora import LoRAConfig, Refusal, Target, TargetTable, apply_lora, lora_layers, resolve_targets
from modelzoo.lora.targets import resolve

EVERY_LLAMA_PROJECTION = {
    "decoder.layers.*.self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "decoder.layers.*.self_attention.linear_proj": ("o_proj",),
    "decoder.layers.*.mlp.linear_fc1": ("gate_proj", "up_proj"),
    "decoder.layers.*.mlp.linear_fc2": ("down_proj",),
}


@pytest.mark.parametrize("arch", CHECKPOINTS)
@pytest.mark.parametrize("names", [
    ["all-linear"],
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
    ["qkv_proj", "self_attn.o_proj", "gate_up_proj", "mlp.linear_fc2"],
], ids=["all-linear", "hf", "megatron", "vllm-and-qualified"])
def test_hf_megatron_and_all_linear_names_select_the_same_projections(arch, names):
    assert resolve_targets(build_provider(CHECKPOINTS[arch]), names) == EVERY_LLAMA_PROJECTION


def test_a_subset_of_a_fused_layer_selects_those_projections():
    selection = resolve_targets(build_provider(CHECKPOINTS["loopcoder"]), ["q_proj", "v_proj", "gate_proj"])
    assert selection == {"decoder.layers.*.self_attention.linear_qkv": ("q_proj", "v_proj"),
                         "decoder.layers.*.mlp.linear_fc1": ("gate_proj",)}


@pytest.mark.parametrize("name", ["gate_projections", "loop_gate", "self_attention.loop_gate",
                                  "model.gate_projections", "gate_projections.gate_proj"])
def test_loopcoder_gate_is_refused(name):
    with pytest.raises(ValueError, match=f"LoRA target '{name}' is refused for loopcoder: the loop gates .* frozen"):
        resolve_targets(build_provider(CHECKPOINTS["loopcoder"]), ["q_proj", name])


def test_a_refused_target_leaves_the_model_untouched():
    with runtime.parallel(tp=1):
        provider = build_provider(CHECKPOINTS["loopcoder"])
        model = provider.provide()
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        with pytest.raises(ValueError, match="refused"):
            apply_lora(model, provider, LoRAConfig(targets=("q_proj", "gate_projections")))
        assert not list(lora_layers(model))
        assert trainable == {name for name, param in model.named_parameters() if param.requires_grad}


@pytest.mark.parametrize("arch", CHECKPOINTS)
@pytest.mark.parametrize("name", ["lm_head", "embed_tokens", "model.layers.0.self_attn.q_proj", "qproj"])
def test_unknown_name_lists_the_valid_ones(arch, name):
    valid = ("all-linear, down_proj, gate_proj, gate_up_proj, k_proj, linear_fc1, linear_fc2, linear_proj, "
             "linear_qkv, o_proj, q_proj, qkv_proj, up_proj, v_proj")
    with pytest.raises(ValueError) as error:
        resolve_targets(build_provider(CHECKPOINTS[arch]), [name])
    assert f"unknown LoRA target '{name}' for {arch}; valid names: {valid} " in str(error.value)


# A DeepSeek-V4-shaped mapping and table: the generic features V4 needs (aliases, refusals, ambiguity).
L, A = "decoder.layers.*", "decoder.layers.*.self_attention"
V4_LIKE_MAPPING = MappingTable([
    Rule(f"{A}.linear_q_down_proj.weight", "layers.*.attn.wq_a.weight"),
    Rule(f"{A}.linear_q_up_proj.weight", "layers.*.attn.wq_b.weight"),
    Rule(f"{A}.linear_kv.weight", "layers.*.attn.wkv.weight"),
    Rule(f"{A}.linear_o_down_proj.weight", "layers.*.attn.wo_a.weight"),
    Rule(f"{A}.linear_proj.weight", "layers.*.attn.wo_b.weight"),
    Rule(f"{A}.compressor.linear_kv.weight", "layers.*.attn.compressor.wkv.weight"),
    Rule(f"{A}.compressor.indexer.linear_kv.weight", "layers.*.attn.indexer.compressor.wkv.weight"),
    Rule(f"{A}.compressor.indexer.linear_q_up_proj.weight", "layers.*.attn.indexer.wq_b.weight"),
    Rule(f"{L}.mlp.shared_experts.linear_fc1_gate.weight", "layers.*.ffn.shared_experts.w1.weight"),
    Rule(f"{L}.mlp.experts.weight1", ("layers.*.ffn.experts.0.w1.weight", "layers.*.ffn.experts.1.w1.weight"), Stack()),
    Rule(f"{L}.mlp.router.weight", "layers.*.ffn.gate.weight"),
    Rule(f"{L}.attn_hc.fn", "layers.*.hc_attn_fn"),
])
V4_LIKE_TARGETS = (
    Target(f"{A}.linear_q_down_proj"),
    Target(f"{A}.linear_q_up_proj", aliases=("wq_b",)),
    Target(f"{A}.linear_kv", aliases=("wkv",)),
    Target(f"{A}.linear_proj"),
    Target(f"{L}.mlp.shared_experts.linear_fc1_gate", aliases=("w1",)),
)
V4_LIKE_REFUSALS = (
    Refusal(f"{A}.linear_o_down_proj", "wo_a: a plain adapter on the grouped projection adds cross-group terms"),
    Refusal(f"{A}.compressor.indexer", "the indexer is not trained by LoRA"),
    Refusal(f"{A}.compressor.linear_kv", "the compressor is not trained by LoRA", aliases=("compressor",)),
    Refusal(f"{L}.mlp.experts", "routed experts stay frozen"),
    Refusal(f"{L}.mlp.router", "the router stays frozen"),
    Refusal(f"{L}.attn_hc", "hyper-connection parameters are not linears"),
)


def v4_like(names, targets=V4_LIKE_TARGETS):
    return resolve(TargetTable(targets, V4_LIKE_REFUSALS), V4_LIKE_MAPPING, names, "v4-like")


@pytest.mark.parametrize("name, module", [
    ("wq_b", f"{A}.linear_q_up_proj"), ("attn.wq_b", f"{A}.linear_q_up_proj"),
    ("wkv", f"{A}.linear_kv"), ("w1", f"{L}.mlp.shared_experts.linear_fc1_gate"),
    ("wq_a", f"{A}.linear_q_down_proj"), ("linear_q_down_proj", f"{A}.linear_q_down_proj"),
])
def test_aliases_and_qualified_names_pick_one_target(name, module):
    assert v4_like([name]) == {module: (0,)}


@pytest.mark.parametrize("name, reason", [
    ("indexer.wq_b", "indexer is not trained"), ("attn.indexer.wq_b", "indexer is not trained"),
    ("compressor.wkv", "compressor is not trained"), ("compressor", "compressor is not trained"),
    ("indexer.compressor.wkv", "indexer is not trained"), ("wo_a", "cross-group terms"),
    ("experts.w1", "routed experts stay frozen"), ("router", "router stays frozen"), ("gate", "router stays frozen"),
    ("hc_attn_fn", "hyper-connection"),
])
def test_refusals_give_their_reason(name, reason):
    with pytest.raises(ValueError, match=f"LoRA target '{name}' is refused for v4-like: .*{reason}"):
        v4_like([name])


def test_a_name_of_a_target_and_a_refusal_without_an_alias_is_ambiguous():
    without_alias = tuple(Target(t.module) for t in V4_LIKE_TARGETS)
    with pytest.raises(ValueError, match=f"'wq_b' is ambiguous for v4-like: it names {A}.compressor.indexer, "
                                         f"{A}.linear_q_up_proj; qualify it"):
        v4_like(["wq_b"], without_alias)


def test_all_linear_is_every_target_and_no_refusal():
    assert v4_like(["all-linear"]) == {target.module: (0,) for target in V4_LIKE_TARGETS}


def test_a_table_giving_one_alias_to_two_entries_is_rejected():
    with pytest.raises(ValueError, match=r"aliases \['wkv'\] name more than one entry"):
        TargetTable((Target(f"{A}.linear_kv", aliases=("wkv",)),),
                    (Refusal(f"{A}.compressor.linear_kv", "no", aliases=("wkv",)),))
