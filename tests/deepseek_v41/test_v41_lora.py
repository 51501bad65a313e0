"""LoRA on DeepSeek-V4.1 (deepseek-v41-tiny, fp32, CPU): the target table, adapters at TP 1 and 2, the merged export,
the PEFT adapter on our reference, resume.

Tolerances:
- zero-initialised adapters vs the base model: bit-identical logits (`torch.equal`): B = 0 adds exact zeros.
- merged model vs adapter model: MERGE_TOLERANCE = 1e-5 on fp32 logits (|logits| ~ 1): W + sBA and W x + sB(Ax) round
  differently, and ten layers of mHC, Sinkhorn and top-k routing carry that rounding to the logits. A wrong merge
  moves them by the adapters' effect, which must exceed MIN_ADAPTER_EFFECT, so the test cannot pass vacuously.
- PEFT on our reference vs our adapted model: PEFT_TOLERANCE = 1e-5 on log-probs (the base models agree to ~5e-6).
- resume: bit-exact (values are only saved and read back).
"""

import zlib

import pytest
import torch
import torch.distributed as dist
from dsv41_helpers import V41_TINY, load_tiny, next_token_logprobs, random_rows

from modelzoo import build_provider, lora, runtime
from modelzoo.lora.layers import COLUMN, REPLICATED, ROW

MERGE_TOLERANCE = 1e-5
MIN_ADAPTER_EFFECT = 1e-3
PEFT_TOLERANCE = 1e-5
CONFIG = lora.LoRAConfig(targets=("all-linear",), rank=4, alpha=8.0)
LAYERS = 10  # the backbone; the DSpark layers are not adapted
A, S = "self_attention", "mlp.shared_experts"
ADAPTED = {  # module -> (how TP splits it, checkpoint leaf under model.layers.N)
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
        split = getattr(B, "tensor_model_parallel", False)
        full = torch.randn(B.shape[0] * (tp if split else 1), B.shape[1],
                           generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
        with torch.no_grad():
            B.copy_((full.chunk(tp, dim=B.partition_dim)[rank] if split else full) * std)


def _scenario(rank: int, tp: int, workdir: str) -> dict:
    from pathlib import Path

    from safetensors.torch import save_file

    workdir = Path(workdir)
    with runtime.parallel(tp=tp):
        provider = build_provider(V41_TINY)
        ids = random_rows(2, 32)
        base = provider.provide()
        provider.load_hf_weights(base, progress=False)
        base_logits = provider.gathered_logits(base, ids)
        base_export = dict(provider.export_hf_weights(base))

        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        adapted = lora.apply_lora(model, provider, CONFIG)
        layouts = {name: (layer.lora.kind, tuple(layer.lora.A.shape), tuple(layer.lora.B.shape),
                          tuple(layer.weight.shape)) for name, layer in lora.lora_layers(model)}
        trainable = sorted(name for name, param in model.named_parameters() if param.requires_grad)
        zero_logits = provider.gathered_logits(model, ids)
        set_nonzero_B(model)
        adapter_logits = provider.gathered_logits(model, ids)
        with torch.no_grad():
            adapter_logprobs = provider.token_logprobs(model, ids)
        checkpoint = workdir / f"checkpoint-tp{tp}"
        lora.save_training_checkpoint(model, provider, checkpoint, step=7)
        lora.save_adapter(model, provider, workdir / f"adapter-tp{tp}")

        resumed = provider.provide()
        provider.load_hf_weights(resumed, progress=False)
        lora.apply_lora(resumed, provider, CONFIG)
        step = lora.resume_training(resumed, checkpoint)
        resumed_equal = all(torch.equal(mine.lora.A, theirs.lora.A) and torch.equal(mine.lora.B, theirs.lora.B)
                            for (_, mine), (_, theirs) in zip(lora.lora_layers(model), lora.lora_layers(resumed)))
        resumed_logits = provider.gathered_logits(resumed, ids)

        merged = dict(lora.export_merged_hf_weights(model, provider))
        folder = workdir / f"merged-tp{tp}"
        if dist.get_rank() == 0:
            folder.mkdir()
            save_file({name: t.contiguous() for name, t in merged.items()}, str(folder / "model.safetensors"))
            for file in ("config.json", "tokenizer.json"):
                (folder / file).write_bytes((V41_TINY / file).read_bytes())
        dist.barrier()
        merged_model = provider.provide()
        provider.load_hf_weights(merged_model, folder, progress=False)
        merged_logits = provider.gathered_logits(merged_model, ids)
        return dict(
            adapted=adapted, layouts=layouts, trainable=trainable, base_logits=base_logits, zero_logits=zero_logits,
            adapter_logits=adapter_logits, merged_logits=merged_logits, adapter_logprobs=adapter_logprobs, ids=ids,
            resumed_equal=resumed_equal, resumed_step=step, resumed_logits=resumed_logits,
            adapter=str(workdir / f"adapter-tp{tp}"), export_names=(list(base_export), list(merged)),
            changed=sorted(name for name in merged if not torch.equal(merged[name], base_export[name])),
            dtypes_kept=all(merged[name].dtype == base_export[name].dtype for name in merged))


@pytest.fixture(scope="module")
def run_at(tmp_path_factory):
    results: dict[int, dict] = {}

    def at(tp: int) -> dict:
        if tp not in results:
            results[tp] = runtime.run(_scenario, tp, tp, str(tmp_path_factory.mktemp("v41-lora")))[0]
        return results[tp]
    return at


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def scenario(request, run_at):
    return request.param, run_at(request.param)


def test_all_linear_adapts_the_seven_projections_of_the_backbone_and_only_adapters_train(scenario):
    tp, result = scenario
    assert sorted(result["adapted"]) == sorted(f"decoder.layers.{n}.{m}" for n in range(LAYERS) for m in ADAPTED)
    for name, (kind, a_shape, b_shape, weight_shape) in result["layouts"].items():
        assert kind == ADAPTED[name.split(".", 3)[3]][0], name
        full_out = weight_shape[0] * (tp if kind == COLUMN else 1)
        full_in = weight_shape[1] * (tp if kind == ROW else 1)
        assert a_shape == (CONFIG.rank, full_in // tp if kind == ROW else full_in), name
        assert b_shape == (full_out // tp if kind == COLUMN else full_out, CONFIG.rank), name
    assert result["trainable"] and all(".lora." in name for name in result["trainable"])


def test_zero_initialised_adapters_leave_every_logit_bit_identical(scenario):
    assert torch.equal(scenario[1]["zero_logits"], scenario[1]["base_logits"])


def test_merged_forward_matches_the_adapter_forward(scenario):
    _, result = scenario
    assert (result["adapter_logits"] - result["base_logits"]).abs().max().item() > MIN_ADAPTER_EFFECT
    assert (result["merged_logits"] - result["adapter_logits"]).abs().max().item() <= MERGE_TOLERANCE


def test_merged_export_changes_exactly_the_adapted_tensors(scenario):
    _, result = scenario
    base_names, merged_names = result["export_names"]
    assert merged_names == base_names
    assert result["changed"] == ADAPTED_HF
    assert result["dtypes_kept"]


def test_resume_restores_the_adapters_bit_exactly(scenario):
    _, result = scenario
    assert result["resumed_step"] == 7 and result["resumed_equal"]
    assert torch.equal(result["resumed_logits"], result["adapter_logits"])


@pytest.mark.parametrize("tp", [1, 2])
def test_peft_adapter_on_our_reference_gives_our_logprobs(run_at, tp):
    """PEFT injects the adapter file's LoRA layers into our reference (by its config's target_modules) and loads its
    tensors (our reference is not a generation model, which PeftModel's causal-LM wrapper needs)."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    result = run_at(tp)
    base = load_tiny()
    with torch.no_grad():
        base_logprobs = next_token_logprobs(base(result["ids"]).logits, result["ids"])
    stored = load_file(f"{result['adapter']}/adapter_model.safetensors")
    model = inject_adapter_in_model(LoraConfig.from_pretrained(result["adapter"]), base)
    loaded = set_peft_model_state_dict(model, {name.removeprefix("base_model.model."): tensor
                                               for name, tensor in stored.items()})
    assert not loaded.unexpected_keys
    injected = {name.replace(".default", "") for name in model.state_dict() if ".lora_" in name}
    assert injected == {name.removeprefix("base_model.model.") for name in stored}
    with torch.no_grad():
        peft_logprobs = next_token_logprobs(model.eval()(result["ids"]).logits, result["ids"])
    assert (peft_logprobs - base_logprobs).abs().max().item() > MIN_ADAPTER_EFFECT
    assert (peft_logprobs - result["adapter_logprobs"]).abs().max().item() <= PEFT_TOLERANCE


# --- names: no model run -------------------------------------------------------------------------------------------

SEVEN = {f"decoder.layers.*.{module}": (leaf.rsplit(".", 1)[-1],) for module, (_, leaf) in ADAPTED.items()}


@pytest.fixture(scope="module")
def provider():
    return build_provider(V41_TINY)


@pytest.mark.parametrize("names", [
    ["all-linear"],
    ["wq_a", "wq_b", "wkv", "wo_b", "w1", "w3", "w2"],
    ["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj"],
    ["linear_q_down_proj", "linear_q_up_proj", "linear_kv", "linear_proj", "linear_fc1_gate", "linear_fc1_up",
     "linear_fc2"],
    ["attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "shared_experts.w1", "ffn.shared_experts.w3",
     "shared_experts.down_proj"],
], ids=["all-linear", "release", "transformers", "megatron", "qualified"])
def test_release_transformers_and_megatron_names_select_the_same_seven(provider, names):
    assert lora.resolve_targets(provider, names) == SEVEN


@pytest.mark.parametrize("name, reason", [
    ("wo_a", "wo_a is a grouped .*cross-group terms"),
    ("o_a_proj", "cross-group terms"),
    ("experts.w1", "routed experts stay frozen"),
    ("ffn.experts.w2", "routed experts stay frozen"),
    ("router", "the router stays frozen"),
    ("ffn.gate", "the router stays frozen"),
    ("compressor", "compressor's weights"),
    ("compressor.wkv", "compressor's weights \\(wkv, wgate\\) are not LoRA targets"),
    ("attn.compressor.wgate", "compressor's weights"),
    ("indexer", "the indexer .* not trained by LoRA"),
    ("indexer.wq_b", "the indexer .* not trained by LoRA"),
    ("indexer.wk", "the indexer .* not trained by LoRA"),
    ("engram", "the Engram .* is not adapted"),
    ("engram.wkv", "the Engram .* is not adapted"),
    ("q_weight", "the Engram .* is not adapted"),
    ("markov_head", "DSpark .* not adapted"),
    ("confidence_head.proj", "DSpark .* not adapted"),
    ("main_proj", "DSpark .* not adapted"),
    ("hc_attn_fn", "hyper-connection"),
])
def test_refused_targets_say_why(provider, name, reason):
    with pytest.raises(ValueError, match=f"LoRA target '{name}' is refused for deepseek_v41: .*{reason}"):
        lora.resolve_targets(provider, ["wq_a", name])


def test_cli_export_adapter_writes_the_adapter_the_api_saves(scenario, tmp_path):
    """`modelzoo export-adapter` of the LoRA training checkpoint gives the PEFT adapter `lora.save_adapter` wrote
    from the live model: the same tensors bit for bit, the same adapter config."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from modelzoo.conversion.cli import main

    tp, result = scenario
    saved = Path(result["adapter"])
    assert main(["export-adapter", str(saved.parent / f"checkpoint-tp{tp}"), str(tmp_path / "adapter"),
                 "--tp", str(tp)]) == 0
    ours, theirs = load_file(tmp_path / "adapter" / "adapter_model.safetensors"), \
        load_file(saved / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[name], theirs[name]) for name in theirs)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((saved / "adapter_config.json").read_text())
