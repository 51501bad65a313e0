"""LoopCoder on Megatron vs our HF reference: logprobs, gradients, memory, frozen gate, recompute, CLI.

Tolerances: 1e-4 absolute on fp32 token log-probabilities and 1e-4 relative (to the largest entry)
on gradients. The two implementations do the same fp32 math in a different order (fused QKV,
Megatron's RoPE), which moves results by ~1e-6; a wrong weight, window or gate moves them by > 1e-2.
"""

import gc
import weakref

import pytest
import torch
from conftest import TINY

from modelzoo import build_provider, runtime
from modelzoo.loopcoder.hf_model import IQuestLoopCoderForCausalLM
from modelzoo.parity import logprobs_from_logits

LOOPCODER = TINY / "loopcoder-tiny"
LOGPROB_TOLERANCE = 1e-4
GRADIENT_TOLERANCE = 1e-4


def batch(seq=48, seed=0):
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seed))


def hf_reference(ids):
    model = IQuestLoopCoderForCausalLM.from_pretrained(LOOPCODER, dtype=torch.float32, attn_implementation="eager")
    logprobs = logprobs_from_logits(model(ids, use_cache=False).logits, ids)
    (-logprobs.mean()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return logprobs.detach(), grads


def _megatron_logprobs_and_grads(rank, tp, ids, overrides):
    with runtime.parallel(tp=tp):
        provider = build_provider(LOOPCODER, train_gate=True, **overrides)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        logprobs = provider.token_logprobs(model, ids)
        (-logprobs.mean()).backward()
        with torch.no_grad():  # export gradients through the weight mapping: HF names, full tensors
            for param in model.parameters():
                param.copy_(param.grad)
        return logprobs.detach(), dict(provider.export_hf_weights(model))


def assert_matches_reference(logprobs, grads, reference_logprobs, reference_grads):
    assert (logprobs - reference_logprobs).abs().max().item() <= LOGPROB_TOLERANCE
    assert grads.keys() == reference_grads.keys()
    for name, reference in reference_grads.items():
        scale = reference.abs().max().item()
        assert scale > 0, f"{name}: the reference gradient is zero, the test would prove nothing"
        error = (grads[name] - reference).abs().max().item() / scale
        assert error <= GRADIENT_TOLERANCE, f"{name}: relative gradient error {error:.2e}"


@pytest.fixture(scope="module")
def reference():
    ids = batch()
    return ids, *hf_reference(ids)


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_and_every_gradient_match_the_hf_reference(reference, tp):
    ids, reference_logprobs, reference_grads = reference
    results = runtime.run(_megatron_logprobs_and_grads, tp, tp, ids, {})
    for logprobs, grads in results:
        assert_matches_reference(logprobs, grads, reference_logprobs, reference_grads)


FULL_RECOMPUTE = {  # Megatron's settings -> how often each layer runs in a step (two loops, x 2 where recomputed)
    "full-uniform-1": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                       [4, 4]),
    "full-uniform-2": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
                       [4, 4]),
    "full-block-1": (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
                     [4, 2]),
}


SELECTIVE_RECOMPUTE = {  # recompute_modules -> how often each layer's MLP runs in a step (two loops, x 2 recomputed)
    "selective-core_attn": (["core_attn"], 2),
    "selective-mlp": (["mlp"], 4),
    "selective-core_attn-mlp": (["core_attn", "mlp"], 4),
}


@pytest.mark.parametrize("overrides", [
    *(dict(recompute_granularity="selective", recompute_modules=modules) for modules, _ in SELECTIVE_RECOMPUTE.values()),
    *(overrides for overrides, _ in FULL_RECOMPUTE.values()),
    {"attention": "fast"},
], ids=[*SELECTIVE_RECOMPUTE, *FULL_RECOMPUTE, "fast-attention"])
def test_recompute_and_fast_attention_give_the_same_gradients(reference, overrides):
    ids, reference_logprobs, reference_grads = reference
    logprobs, grads = runtime.run(_megatron_logprobs_and_grads, 1, 1, ids, overrides)[0]
    assert_matches_reference(logprobs, grads, reference_logprobs, reference_grads)


@pytest.mark.parametrize("setting", FULL_RECOMPUTE)
def test_full_recompute_reruns_the_layers_it_names(setting):
    overrides, expected_runs = FULL_RECOMPUTE[setting]
    with runtime.parallel(tp=1):
        provider = build_provider(LOOPCODER, **overrides)
        model = provider.provide()
        runs = [0] * len(model.decoder.layers)
        for index, layer in enumerate(model.decoder.layers):
            layer.register_forward_pre_hook(lambda *_, index=index: runs.__setitem__(index, runs[index] + 1))
        (-provider.token_logprobs(model, batch()).mean()).backward()
    assert runs == expected_runs


@pytest.mark.parametrize("setting", SELECTIVE_RECOMPUTE)
def test_selective_recompute_reruns_the_mlp_where_named(setting):
    modules, expected_runs = SELECTIVE_RECOMPUTE[setting]
    with runtime.parallel(tp=1):
        provider = build_provider(LOOPCODER, recompute_granularity="selective", recompute_modules=modules)
        model = provider.provide()
        runs = [0] * len(model.decoder.layers)
        for index, layer in enumerate(model.decoder.layers):
            layer.mlp.register_forward_pre_hook(lambda *_, index=index: runs.__setitem__(index, runs[index] + 1))
        (-provider.token_logprobs(model, batch()).mean()).backward()
    assert runs == [expected_runs] * len(runs)


def test_a_recompute_module_loopcoder_does_not_have_is_refused():
    with runtime.parallel(tp=1):
        provider = build_provider(LOOPCODER, recompute_granularity="selective", recompute_modules=["core_attn", "moe"])
        with pytest.raises(ValueError, match=r"LoopCoder: recompute_modules 'moe' names no piece of this model; it "
                                             r"recomputes 'core_attn' \(.*\); 'mlp' \(.*\)"):
            provider.provide()


@pytest.mark.parametrize("leaky", [False, True], ids=["ours", "control-keeps-keys-on-module"])
def test_loop1_keys_are_freed_after_backward(monkeypatch, leaky):
    # the control stores each key on the module, as the SkyRL port does: the check must catch it
    from modelzoo.loopcoder import model as loopcoder_model

    loop1_keys = []
    project = loopcoder_model.LoopCoderAttention._project

    def recording_project(self, hidden, rotary):
        q, k, v = project(self, hidden, rotary)
        loop1_keys.append(weakref.ref(k))
        if leaky:
            self.kept_key = k
        return q, k, v

    monkeypatch.setattr(loopcoder_model.LoopCoderAttention, "_project", recording_project)
    with runtime.parallel(tp=1):
        provider = build_provider(LOOPCODER)
        model = provider.provide()
        loss = -provider.token_logprobs(model, batch()).mean()
        loss.backward()
        del loss
        gc.collect()
        assert len(loop1_keys) == 2 * len(model.decoder.layers)
        alive = sum(ref() is not None for ref in loop1_keys)
        assert alive == (len(model.decoder.layers) if leaky else 0)


def test_gate_is_frozen_by_default_and_everything_else_trains():
    with runtime.parallel(tp=1):
        provider = build_provider(LOOPCODER)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # handed every parameter
        (-provider.token_logprobs(model, batch()).mean()).backward()
        optimizer.step()
        for name, param in model.named_parameters():
            changed = not torch.equal(param, before[name])
            assert changed != ("loop_gate" in name), f"{name}: changed={changed}"
        assert sum("loop_gate" in name for name in before) == 2 * len(model.decoder.layers)


@pytest.mark.parametrize("overrides, message", [
    ({"pipeline_model_parallel_size": 2}, "pipeline parallel size 2 is refused: loop 2 of layer l"),
])
def test_unsupported_layouts_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_provider(LOOPCODER, **overrides)


@pytest.mark.parametrize("tp", [1, 2])
def test_cli_round_trip_is_bit_exact(tmp_path, tp):
    from safetensors.torch import load_file

    from modelzoo.conversion.cli import main

    assert main(["import", str(LOOPCODER), str(tmp_path / "megatron"), "--tp", str(tp)]) == 0
    # export at the other TP size: the torch_dist checkpoint must reshard (gates by heads too)
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "hf"), "--tp", str(3 - tp)]) == 0
    original, exported = load_file(LOOPCODER / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())


def test_cli_parity_at_tp2_passes():
    from modelzoo.conversion.cli import main

    assert main(["parity", str(LOOPCODER), "--tp", "2", "--seq-len", "48"]) == 0
