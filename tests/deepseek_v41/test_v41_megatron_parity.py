"""The Megatron DeepSeek-V4.1 against our reference (hf_model.py) on deepseek-v41-tiny, fp32 on the CPU, at TP 1 (this
process), TP 2 and EP 2 (two gloo processes): log-probs, gradients, DSpark draft logits, and the HF round trip.

Rows of 64 tokens: beyond the sliding window (8), the index top-k (8) and the candidate budget (3 blocks of 4
latents at ratio 1, so the candidate restriction acts), through every layer role (sliding-only, ratio-2 and
ratio-1 KV sources, reuse, re-index, candidate source, Engram layers). The Engram tables are made trainable on both
sides so that their row-sharded backward is compared too; the checkpoint is deepseek-v41-tiny with layer 1's table
grown to 241 rows (no hash id reaches the extra row), which the model pads (to 256 rows, sharded 128 a rank at TP 2).

The log-prob and gradient bars (LOGPROB_TOLERANCE, the per-tensor gradient scheme and why), the runs of both models
and the fixtures are dsv41_helpers', shared with the other V4.1 parity tests. EP 2: the two ranks are data-parallel
replicas with one row each; the dense gradients are summed over them (what DDP does), the experts' are not (each
expert already saw both rows). Round trips move values only: bit-exact.
"""

import pytest
import torch
from dsv41_helpers import (  # noqa: F401 (fixtures: grown, rows, reference, float64_grads, tolerances)
    DRAFT_TOLERANCE,
    LOGPROB_TOLERANCE,
    MECHANISMS,
    float64_grads,
    gradients_too_far,
    grown,
    megatron_run,
    next_token_logprobs,
    reference,
    rows,
    switch_off,
    tolerances,
)
from safetensors.torch import load_file

from modelzoo.conversion import megatron_ckpt
from modelzoo import build_provider, runtime

MATTERS = 1e-3  # the bar for "a mechanism matters" (as in test_v41_reference.py)


def _both_layouts(rank: int, folder, rows, checkpoints):
    # one pair of processes for both layouts: start-up and imports are most of the cost
    return {layout: megatron_run(folder, rows, tp, ep, rank, checkpoints / layout)
            for layout, tp, ep in (("tp2", 2, 1), ("ep2", 1, 2))}


@pytest.fixture(scope="module")
def tp1(grown, rows):
    return megatron_run(grown, rows, 1, 1, 0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron-checkpoints")


@pytest.fixture(scope="module")
def spawned(grown, rows, checkpoints):
    return runtime.spawn(_both_layouts, 2, grown, rows, checkpoints)


def _layout_results(layout, request):
    if layout == "tp1":
        return [request.getfixturevalue("tp1")]
    return [rank[layout] for rank in request.getfixturevalue("spawned")]


@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_logprob_parity(reference, layout, request):
    for rank, (logprobs, *_) in enumerate(_layout_results(layout, request)):
        expected = reference[0] if layout != "ep2" else reference[0][rank:rank + 1]
        assert (logprobs - expected).abs().max().item() <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_the_reference_without_a_mechanism_is_far_from_the_megatron_model(grown, rows, tp1, mechanism, monkeypatch):
    """Parity cannot pass vacuously: each of V4.1's mechanisms, switched off in the reference, moves its log-probs by
    more than MATTERS from the Megatron model's (which parity puts within LOGPROB_TOLERANCE of the full reference)."""
    from modelzoo.deepseek_v41 import DeepseekV41ForCausalLM

    changed = switch_off(DeepseekV41ForCausalLM.from_pretrained(grown, dtype=torch.float32).eval(), mechanism,
                         monkeypatch)
    with torch.no_grad():
        without = next_token_logprobs(changed(rows).logits, rows)
    assert (without - tp1[0]).abs().max().item() > MATTERS


@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_dspark_draft_parity(reference, layout, request):
    ref_logits, ref_confidence, ref_ids = reference[1]
    for rank, (_, (logits, confidence, ids), *_) in enumerate(_layout_results(layout, request)):
        rows = slice(None) if layout != "ep2" else slice(rank, rank + 1)
        assert torch.equal(ids, ref_ids[rows])
        assert (logits - ref_logits[rows]).abs().max().item() <= DRAFT_TOLERANCE
        assert (confidence - ref_confidence[rows]).abs().max().item() <= DRAFT_TOLERANCE


@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_gradient_parity_and_the_same_parameters_train(float64_grads, tolerances, layout, request):
    for _, _, grads, trainable, _ in _layout_results(layout, request):
        assert trainable == set(float64_grads)
        assert not gradients_too_far(grads, float64_grads, tolerances)
        frozen = [name for name in grads if name not in float64_grads]
        assert frozen and all(grads[name].abs().max() == 0 for name in frozen)


@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_hf_round_trip_is_bit_exact(layout, grown, request):
    source = load_file(grown / "model.safetensors")
    results = _layout_results(layout, request)
    exported = results[0][4]
    assert sorted(exported) == sorted(source)
    assert all(result[4] == sorted(source) for result in results[1:])
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_torch_dist_checkpoint_reloads_in_one_process(layout, grown, spawned, checkpoints):
    """The Megatron checkpoint written sharded loads into one process and exports the HF weights bit-exactly."""
    source = load_file(grown / "model.safetensors")
    with runtime.parallel():
        provider = build_provider(grown)
        model = provider.provide()
        megatron_ckpt.load(model, checkpoints / layout)
        exported = dict(provider.export_hf_weights(model))
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
