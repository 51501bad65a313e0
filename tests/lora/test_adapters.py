"""LoRA on the Megatron models: zero adapters, merge, PEFT parity (logprobs and gradients), collectives, export CLI.

Tolerances, fp32 on CPU:
- zero-initialised adapters: bit-identical logits (B = 0 adds exact zeros; the row-parallel all-reduce of two
  ranks sums the same two partials in either order).
- merged vs adapter forward: 1e-5 absolute on logits. W + s B A is rounded once where the adapter path adds
  s B (A x) after W x; the two orders differ by ~1e-6 here, a wrong merge (projection, layout, scale) by > 1e-2.
- PEFT on the HF oracle vs our adapters: 1e-4 on logprobs, 1e-4 relative (to the largest entry) on gradients,
  as in the parity tests: the same math in a different order moves results by ~1e-6.
"""

import json

import pytest
import torch
from lora_helpers import (
    CHECKPOINTS,
    peft_logprobs_and_gradients,
    run_scenarios,
    shared_a_gradients,
)
from safetensors.torch import load_file

from modelzoo import runtime
from modelzoo.lora import export_adapter

MERGE_TOLERANCE = 1e-5
LOGPROB_TOLERANCE = 1e-4
GRADIENT_TOLERANCE = 1e-4
ADAPTER_EFFECT = 1e-2  # non-zero B must move the logits by more than this, or the comparisons prove nothing


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def scenarios(workdir):
    """{tp: {arch: results}}: TP 1 in this process, TP 2 in one pair of processes (start-up is most of the cost)."""
    return {tp: runtime.run(run_scenarios, tp, tp, str(workdir))[0] for tp in (1, 2)}


ARCH_TP = [(arch, tp) for arch in CHECKPOINTS for tp in (1, 2)]


@pytest.mark.parametrize("arch, tp", ARCH_TP)
def test_zero_initialised_adapters_leave_every_logit_bit_identical(scenarios, arch, tp):
    result = scenarios[tp][arch]
    assert torch.equal(result["zero_adapter_logits"], result["base_logits"])


@pytest.mark.parametrize("arch, tp", ARCH_TP)
def test_merged_model_forward_equals_adapter_forward(scenarios, arch, tp):
    result = scenarios[tp][arch]
    assert (result["adapter_logits"] - result["base_logits"]).abs().max().item() > ADAPTER_EFFECT
    assert (result["merged_logits"] - result["adapter_logits"]).abs().max().item() <= MERGE_TOLERANCE


@pytest.mark.parametrize("arch, tp", ARCH_TP)
def test_peft_adapter_on_the_hf_model_gives_our_logprobs_and_gradients(scenarios, workdir, arch, tp):
    result = scenarios[tp][arch]
    reference_logprobs, peft_gradients = peft_logprobs_and_gradients(arch, workdir / f"{arch}-tp{tp}-adapter")
    assert (result["logprobs"] - reference_logprobs).abs().max().item() <= LOGPROB_TOLERANCE
    expected = shared_a_gradients(peft_gradients)
    assert result["gradients"].keys() == expected.keys()
    for name, reference in expected.items():
        scale = reference.abs().max().item()
        assert scale > 0, f"{name}: the PEFT gradient is zero, the comparison would prove nothing"
        error = (result["gradients"][name] - reference).abs().max().item() / scale
        assert error <= GRADIENT_TOLERANCE, f"{name}: relative gradient error {error:.2e}"


@pytest.mark.parametrize("arch", CHECKPOINTS)
def test_adapters_add_no_collective_at_tp2(scenarios, arch):
    # forward + backward: the adapters' sums ride on the base layers' all-reduces
    base_calls, lora_calls = scenarios[2][arch]["collectives"]
    assert base_calls > 0
    assert lora_calls == base_calls


def test_peft_config_names_exactly_the_adapted_projections_and_vllm_packing(scenarios, workdir):
    config = json.loads((workdir / "loopcoder-tp1-adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "o_proj", "q_proj", "v_proj"]
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["packed_modules_mapping"] == {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                "gate_up_proj": ["gate_proj", "up_proj"]}
    tensors = load_file(workdir / "loopcoder-tp1-adapter" / "adapter_model.safetensors")
    layer = "base_model.model.model.layers.1.self_attn"
    assert tensors[f"{layer}.q_proj.lora_A.weight"].shape == (4, 64)
    assert tensors[f"{layer}.q_proj.lora_B.weight"].shape == (64, 4)
    assert tensors[f"{layer}.v_proj.lora_B.weight"].shape == (32, 4)
    assert not any(".k_proj." in name or ".up_proj." in name for name in tensors)


@pytest.mark.parametrize("through", ["api", "cli"])
def test_export_adapter_from_a_tp2_checkpoint_at_tp1_reproduces_the_tp2_adapter(scenarios, workdir, tmp_path, through):
    if through == "api":
        export_adapter(workdir / "loopcoder-tp2-checkpoint", tmp_path / "adapter", tp=1)
    else:
        from modelzoo.conversion.cli import main

        assert main(["export-adapter", str(workdir / "loopcoder-tp2-checkpoint"), str(tmp_path / "adapter")]) == 0
    direct = workdir / "loopcoder-tp2-adapter"
    exported, expected = load_file(tmp_path / "adapter" / "adapter_model.safetensors"), \
        load_file(direct / "adapter_model.safetensors")
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in expected.items())
    assert (tmp_path / "adapter" / "adapter_config.json").read_text() == (direct / "adapter_config.json").read_text()
