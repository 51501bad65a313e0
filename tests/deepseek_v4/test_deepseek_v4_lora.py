"""LoRA on DeepSeek-V4 (tiny checkpoint, fp32, CPU): the target table, adapters at TP 1 and 2, the merged export.

Tolerances:
- zero-initialised adapters vs the base model: bit-identical logits (`torch.equal`). B = 0 adds exact zeros;
  at TP 2 the row-parallel wo_b / w2 sum [W_i x_i, A_i x_i] in one all-reduce of two ranks, whose sum is
  the same in either order.
- merged model vs adapter model: MERGE_TOLERANCE = 1e-5 on fp32 logits (|logits| <= ~4). W + sBA and
  W x + sB(Ax) round differently, and the 4 layers (mHC, Sinkhorn, top-k routing) carry that rounding to
  the logits: measured 6.5e-6 at TP 1 and 7.8e-6 at TP 2, the size of the base model's own TP 1 vs TP 2
  gap (5.8e-6), so the margin is small but the runs are deterministic (seeded, CPU). A wrong merge (a missing
  or misplaced B A) moves logits by the adapters' effect, required to exceed MIN_ADAPTER_EFFECT (measured
  1.06), so the test cannot pass vacuously.
- TP 1 vs TP 2, base and adapted logits: TP_TOLERANCE = 1e-5; the split only changes summation order
  (measured 5.8e-6 base, 3.6e-6 adapted).
- merged export: exact. Tensors that are not adapted are the base export itself; the adapted ones change.
"""

import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dsv4_helpers import hf_token_logprobs, provider_for, random_tokens

from modelzoo import lora, runtime
from modelzoo.lora.layers import COLUMN, REPLICATED, ROW

TINY = Path(__file__).resolve().parents[2] / "tiny_checkpoints" / "deepseek-v4-tiny"
MERGE_TOLERANCE = 1e-5
MIN_ADAPTER_EFFECT = 1e-3
PEFT_TOLERANCE = 1e-5
TP_TOLERANCE = 1e-5
CONFIG = lora.LoRAConfig(targets=("all-linear",), rank=4, alpha=8.0)
LAYERS = 4  # deepseek-v4-tiny: sliding, CSA, HCA, CSA; the MTP block is not adapted
A, S = "self_attention", "mlp.shared_experts"
# module -> (how TP splits it, HF leaf under model.layers.N)
ADAPTED = {
    f"{A}.linear_q_down_proj": (REPLICATED, "attn.wq_a"),
    f"{A}.linear_q_up_proj": (COLUMN, "attn.wq_b"),
    f"{A}.linear_kv": (REPLICATED, "attn.wkv"),
    f"{A}.linear_proj": (ROW, "attn.wo_b"),
    f"{S}.linear_fc1_gate": (COLUMN, "ffn.shared_experts.w1"),
    f"{S}.linear_fc1_up": (COLUMN, "ffn.shared_experts.w3"),
    f"{S}.linear_fc2": (ROW, "ffn.shared_experts.w2"),
}
ADAPTED_HF = sorted(f"model.layers.{n}.{leaf}.weight" for n in range(LAYERS) for _, leaf in ADAPTED.values())


def set_nonzero_B(model, std: float = 0.01) -> None:
    """B drawn at its full shape from the module name, then this rank's shard: the same adapter at every TP."""
    from megatron.core import parallel_state

    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    for name, layer in lora.lora_layers(model):
        B = layer.lora.B
        full_out = B.shape[0] * (tp if getattr(B, "tensor_model_parallel", False) else 1)
        full = torch.randn(full_out, B.shape[1], generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
        if getattr(B, "tensor_model_parallel", False):
            full = full.chunk(tp, dim=B.partition_dim)[rank]
        with torch.no_grad():
            B.copy_(full * std)


def _scenario(rank: int, tp: int, workdir: str) -> dict:
    from safetensors.torch import save_file

    with runtime.parallel(tp=tp):
        provider = provider_for(TINY)
        ids = random_tokens(2, 32)
        base = provider.provide()
        provider.load_hf_weights(base, progress=False)
        base_logits = provider.gathered_logits(base, ids)
        base_export = dict(provider.export_hf_weights(base))

        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        adapted = lora.apply_lora(model, provider, CONFIG)
        layers = dict(lora.lora_layers(model))
        layouts = {name: (layer.lora.kind, tuple(layer.lora.A.shape), tuple(layer.lora.B.shape),
                          tuple(layer.weight.shape)) for name, layer in layers.items()}
        zero_logits = provider.gathered_logits(model, ids)
        set_nonzero_B(model)
        adapter_logits = provider.gathered_logits(model, ids)
        with torch.no_grad():
            adapter_logprobs = provider.token_logprobs(model, ids)
        lora.save_training_checkpoint(model, provider, Path(workdir) / f"checkpoint-tp{tp}")

        merged = dict(lora.export_merged_hf_weights(model, provider))
        folder = Path(workdir) / f"merged-tp{tp}"
        if dist.get_rank() == 0:
            folder.mkdir()
            save_file({name: t.contiguous() for name, t in merged.items()}, str(folder / "model.safetensors"))
            (folder / "config.json").write_bytes((TINY / "config.json").read_bytes())
        dist.barrier()
        merged_model = provider.provide()
        provider.load_hf_weights(merged_model, folder, progress=False)
        merged_logits = provider.gathered_logits(merged_model, ids)
        return dict(
            adapted=adapted, layouts=layouts, base_logits=base_logits, zero_logits=zero_logits,
            adapter_logits=adapter_logits, merged_logits=merged_logits, adapter_logprobs=adapter_logprobs,
            ids=ids, checkpoint=str(Path(workdir) / f"checkpoint-tp{tp}"),
            export_names=(list(base_export), list(merged)),
            changed=sorted(name for name in merged if not torch.equal(merged[name], base_export[name])),
            dtypes_kept=all(merged[name].dtype == base_export[name].dtype for name in merged))


@pytest.fixture(scope="module")
def run_at(tmp_path_factory):
    """Rank 0's results of the scenario at a TP size, run once per TP size for the whole module."""
    results: dict[int, dict] = {}

    def at(tp: int) -> dict:
        if tp not in results:
            results[tp] = runtime.run(_scenario, tp, tp, str(tmp_path_factory.mktemp("dsv4-lora")))[0]
        return results[tp]
    return at


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def scenario(request, run_at):
    return request.param, run_at(request.param)


def test_all_linear_adapts_the_seven_projections_and_keeps_wq_a_wkv_replicated(scenario):
    tp, result = scenario
    assert sorted(result["adapted"]) == sorted(f"decoder.layers.{n}.{m}" for n in range(LAYERS) for m in ADAPTED)
    for name, (kind, a_shape, b_shape, weight_shape) in result["layouts"].items():
        module = name.split(".", 3)[3]
        expected_kind = ADAPTED[module][0]
        assert kind == expected_kind, name
        rank = CONFIG.rank
        full_out = weight_shape[0] * (tp if kind == COLUMN else 1)
        full_in = weight_shape[1] * (tp if kind == ROW else 1)
        # replicated: full A and B on every rank; column: B split like W's rows; row: A split like W's columns
        assert a_shape == (rank, full_in // tp if kind == ROW else full_in), name
        assert b_shape == (full_out // tp if kind == COLUMN else full_out, rank), name


def test_zero_initialised_adapters_leave_every_logit_bit_identical(scenario):
    _, result = scenario
    assert torch.equal(result["zero_logits"], result["base_logits"])


def test_merged_forward_matches_the_adapter_forward(scenario):
    _, result = scenario
    effect = (result["adapter_logits"] - result["base_logits"]).abs().max().item()
    assert effect > MIN_ADAPTER_EFFECT, effect  # the adapters do change the model
    gap = (result["merged_logits"] - result["adapter_logits"]).abs().max().item()
    print(f"adapter effect {effect:.2e}, merged vs adapter {gap:.2e}")
    assert gap <= MERGE_TOLERANCE, gap


def test_merged_export_changes_exactly_the_adapted_tensors(scenario):
    _, result = scenario
    base_names, merged_names = result["export_names"]
    assert merged_names == base_names  # same tensors, same order as the base export
    assert result["changed"] == ADAPTED_HF
    assert result["dtypes_kept"]


def test_the_adapter_is_the_same_at_tp1_and_tp2(run_at):
    # A is drawn at its full shape and B set at its full shape: only the summation order differs across TP,
    # as for the base model (TP_TOLERANCE, the same bound as the merge's)
    tp1, tp2 = run_at(1), run_at(2)
    base_gap = (tp1["base_logits"] - tp2["base_logits"]).abs().max().item()
    adapter_gap = (tp1["adapter_logits"] - tp2["adapter_logits"]).abs().max().item()
    print(f"TP1 vs TP2 max |logit diff|: base {base_gap:.2e}, adapted {adapter_gap:.2e}")
    assert base_gap <= TP_TOLERANCE and adapter_gap <= TP_TOLERANCE, (base_gap, adapter_gap)


def test_exported_adapter_loads_with_peft_onto_transformers_model_and_gives_our_logprobs(run_at, tmp_path):
    # PEFT_TOLERANCE = 1e-5 on fp32 log-probabilities: the same math as ours in transformers' order (the base
    # models agree to ~1e-6); the adapter moves them by > MIN_ADAPTER_EFFECT, a missing or misnamed one by that much
    import warnings

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM

    from modelzoo.conversion.cli import main

    result = run_at(2)
    assert main(["export-adapter", result["checkpoint"], str(tmp_path / "adapter")]) == 0  # default: transformers
    base = DeepseekV4ForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    ids = result["ids"]
    with torch.no_grad():
        base_logprobs = hf_token_logprobs(base, ids)
        with warnings.catch_warnings():  # adapter_config.json's packed_modules_mapping is for vLLM; PEFT warns
            warnings.simplefilter("ignore")
            model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        peft_logprobs = hf_token_logprobs(model, ids)
    # peft adapted exactly the file's modules: every tensor found its place, and no module got an adapter of its own
    adapters = {name.replace(".default", "") for name in model.state_dict() if ".lora_" in name}
    assert adapters == set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert (peft_logprobs - base_logprobs).abs().max().item() > MIN_ADAPTER_EFFECT
    gap = (peft_logprobs - result["adapter_logprobs"]).abs().max().item()
    print(f"peft on transformers vs ours (TP 2) max |logprob diff| {gap:.2e}")
    assert gap <= PEFT_TOLERANCE


def test_release_naming_names_the_checkpoints_weights_and_the_default_transformers_modules(run_at, tmp_path):
    from safetensors.torch import load_file

    from modelzoo.conversion.cli import main

    def adapted_modules(*naming) -> list[str]:
        adapter = tmp_path / "-".join(("adapter", *naming))
        assert main(["export-adapter", run_at(1)["checkpoint"], str(adapter), *naming]) == 0
        return sorted({name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
                       for name in load_file(adapter / "adapter_model.safetensors")})

    assert [f"{module}.weight" for module in adapted_modules("--naming", "release")] == ADAPTED_HF
    transformers = {"attn.wq_a": "self_attn.q_a_proj", "attn.wq_b": "self_attn.q_b_proj", "attn.wkv": "self_attn.kv_proj",
                    "attn.wo_b": "self_attn.o_b_proj", "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
                    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
                    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj"}
    assert adapted_modules() == sorted(f"model.layers.{n}.{transformers[leaf]}"
                                       for n in range(LAYERS) for _, leaf in ADAPTED.values())


# --- names: no model run -------------------------------------------------------------------------------

SEVEN = {f"decoder.layers.*.{module}": (leaf.rsplit(".", 1)[-1],) for module, (_, leaf) in ADAPTED.items()}


@pytest.fixture(scope="module")
def provider():
    return provider_for(TINY)


@pytest.mark.parametrize("names", [
    ["all-linear"],
    ["wq_a", "wq_b", "wkv", "wo_b", "w1", "w3", "w2"],
    ["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj"],
    ["linear_q_down_proj", "linear_q_up_proj", "linear_kv", "linear_proj", "linear_fc1_gate", "linear_fc1_up",
     "linear_fc2"],
    ["attn.wq_a", "attn.wq_b", "self_attention.linear_kv", "self_attn.o_b_proj", "shared_experts.w1",
     "ffn.shared_experts.w3", "shared_experts.down_proj"],
], ids=["all-linear", "native", "transformers", "megatron", "qualified"])
def test_native_transformers_and_megatron_names_select_the_same_seven(provider, names):
    assert lora.resolve_targets(provider, names) == SEVEN


@pytest.mark.parametrize("name", ["wq_b", "attn.wq_b", "self_attn.q_b_proj", "linear_q_up_proj"])
def test_bare_and_qualified_wq_b_mean_the_attentions(provider, name):
    assert lora.resolve_targets(provider, [name]) == {f"decoder.layers.*.{A}.linear_q_up_proj": ("wq_b",)}


@pytest.mark.parametrize("name, reason", [
    ("wo_a", "wo_a is a grouped .*cross-group terms"),
    ("attn.wo_a", "cross-group terms"),
    ("o_a_proj", "cross-group terms"),
    ("experts.w1", "routed experts stay frozen"),
    ("ffn.experts.w2", "routed experts stay frozen"),
    ("experts.gate_up_proj", "routed experts stay frozen"),
    ("indexer.wq_b", "the indexer .* not trained by LoRA"),
    ("attn.indexer.wq_b", "the indexer .* not trained by LoRA"),
    ("indexer.q_b_proj", "the indexer .* not trained by LoRA"),
    ("router", "the router stays frozen"),
    ("ffn.gate", "the router stays frozen"),
    ("compressor", "compressor.s weights"),
    ("compressor.wkv", "compressor.s weights \\(wkv, wgate\\) are not LoRA targets$"),
    ("indexer.compressor.wkv", "the indexer .* not trained by LoRA$"),
    ("attn.compressor.wgate", "compressor's weights"),
    ("hc_attn_fn", "hyper-connection"),
    ("ffn_hc", "hyper-connection"),
    ("hc_head", "hyper-connection"),
])
def test_refused_targets_say_why(provider, name, reason):
    with pytest.raises(ValueError, match=f"LoRA target '{name}' is refused for deepseek_v4: .*{reason}"):
        lora.resolve_targets(provider, ["wq_a", name])


@pytest.mark.parametrize("name", ["wq", "lm_head", "model.layers.0.attn.wq_a", "e_proj"])
def test_an_unknown_name_lists_the_valid_ones(provider, name):
    with pytest.raises(ValueError) as error:
        lora.resolve_targets(provider, [name])
    message = str(error.value)
    assert message.startswith(f"unknown LoRA target '{name}' for deepseek_v4; valid names: all-linear, ")
    for valid in ("wq_a", "wq_b", "wkv", "wo_b", "w1", "w3", "w2", "q_a_proj", "linear_q_down_proj", "linear_fc2"):
        assert f" {valid}," in message or f" {valid} " in message, valid
    assert "wo_a" not in message and "indexer" not in message


def test_a_refused_target_leaves_the_model_untouched(provider):
    with runtime.parallel(tp=1):
        model = provider.provide()
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        with pytest.raises(ValueError, match="refused"):
            lora.apply_lora(model, provider, lora.LoRAConfig(targets=("wq_b", "indexer.wq_b")))
        assert not list(lora.lora_layers(model))
        assert trainable == {name for name, param in model.named_parameters() if param.requires_grad}


def test_the_documented_table_is_the_shipped_one():
    import re

    from modelzoo.deepseek_v4.lora import LORA_TARGETS

    docs = (Path(__file__).resolve().parents[2] / "docs" / "lora.md").read_text()
    block = re.search(r"```python\n(from modelzoo\.lora\.targets import .*?)```", docs, re.S)
    assert block, "docs/lora.md: the DeepSeek-V4 table is missing"
    namespace = {}
    exec(block.group(1), namespace)  # noqa: S102 - our own documentation
    assert namespace["LORA_TARGETS"] == LORA_TARGETS
