"""`fake_quant=True` on the Megatron DeepSeek-V4.1 against our reference with `fake_quant=True`, on deepseek-v41-tiny,
fp32 on the CPU, 2 rows x 64 tokens, at TP 1 (this process) and TP 2 (two gloo processes): the window K/V rounded to
FP8, the compressed K/V and the indexer's queries and keys to FP4, in the backbone and the DSpark layers, with
straight-through gradients. The Engram tables are trainable on both sides, as in test_v41_megatron_parity.py, whose
tolerances (dsv41_helpers) apply: LOGPROB_TOLERANCE = 1e-5, DRAFT_TOLERANCE, and the per-tensor gradient scheme.

Rounding flips. Where a value sits within the two sides' fp32 difference (~1e-6) of a rounding boundary, the sides
round it one step apart (an FP8 step is 1/8 to 1/16 of a value; an FP4 step up to 1/2). On these rows one of the
139,264 rounded numbers flips between the Megatron model and the fp32 reference (a window K/V channel of layer 5,
-9.9e-5, a step of 1.5e-5), moving the log-probs by less than 2e-6; on other rows a flip can move them by 1e-2
(docs/deepseek_v41.md), so the log-prob bar holds for these rows, not for every row.

The gradient bar of each tensor is the parity scheme's: GRAD_TOLERANCE, or CONDITIONING_FACTOR times the fp32
reference's own error against the float64 reference. The float64 reference itself rounds one number otherwise than
the fp32 one (the same window K/V channel), and a flip in the fp32 reference would widen the bars; so the fp32
reference measured here rounds exactly as the float64 one does (`rounding_as`), and its error is fp32 summation alone.
That error is larger than without the setting (measured: worst 2.5e-4 on layer 4's Engram q_weight / k_weight, 114
tensors above 1e-5, against 7.3e-5 and 46 without it): the quantised forward's gradients cancel more.
"""

import contextlib
import json
import shutil

import pytest
import torch
from dsv41_helpers import (
    DRAFT_TOLERANCE,
    LOGPROB_TOLERANCE,
    V41_TINY,
    grad_tolerances,
    load_tiny,
    megatron_run,
    next_token_logprobs,
    random_rows,
    reference_run,
    relative_errors,
)

import modelzoo.deepseek_v41.hf_model as reference_module
import modelzoo.deepseek_v41.model.attention as megatron_attention
from modelzoo import build_provider, runtime

QUANTISERS = ("fake_quant_fp4", "fake_quant_fp8")


@contextlib.contextmanager
def recorded_rounding(module, record: list):
    """Every value `module`'s fake quantisers return, appended to `record` in call order."""
    with pytest.MonkeyPatch.context() as patch:
        for name in QUANTISERS:
            def recording(x, *args, quantise=getattr(module, name)):
                rounded = quantise(x, *args)
                record.append(rounded.detach().double())
                return rounded

            patch.setattr(module, name, recording)
        yield


@contextlib.contextmanager
def rounding_as(record: list):
    """Our reference's fake quantisers replaced by the values of `record`, in call order (straight through)."""
    values = iter(record)

    def replay(x, *args):
        return x + (next(values).to(x.dtype) - x).detach()

    with pytest.MonkeyPatch.context() as patch:
        for name in QUANTISERS:
            patch.setattr(reference_module, name, replay)
        yield


def _tp2(rank: int, rows: torch.Tensor):
    rounded = []
    with recorded_rounding(megatron_attention, rounded):
        return megatron_run(V41_TINY, rows, 2, 1, rank, fake_quant=True)[:4], rounded


@pytest.fixture(scope="module")
def rows():
    return random_rows(2, 64, seed=0)


@pytest.fixture(scope="module")
def reference(rows):
    return reference_run(V41_TINY, rows, fake_quant=True)


@pytest.fixture(scope="module")
def float64_run(rows):
    """The float64 reference's gradients, and every value it rounded to."""
    rounded = []
    with recorded_rounding(reference_module, rounded):
        grads = reference_run(V41_TINY, rows, torch.float64, fake_quant=True)[2]
    return grads, rounded


@pytest.fixture(scope="module")
def tolerances(rows, float64_run):
    float64_grads, rounded = float64_run
    with rounding_as(rounded):
        fp32_grads = reference_run(V41_TINY, rows, fake_quant=True)[2]
    return grad_tolerances(fp32_grads, float64_grads)


@pytest.fixture(scope="module")
def tp1(rows):
    return megatron_run(V41_TINY, rows, 1, 1, 0, fake_quant=True)


@pytest.fixture(scope="module")
def tp1_off(rows):
    return megatron_run(V41_TINY, rows, 1, 1, 0)


@pytest.fixture(scope="module")
def tp2(rows):
    return runtime.spawn(_tp2, 2, rows)


def _results(layout, request):
    if layout == "tp1":
        return [request.getfixturevalue("tp1")]
    return [result for result, _ in request.getfixturevalue("tp2")]


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_logprobs_match_the_quantising_reference(reference, layout, request):
    for logprobs, *_ in _results(layout, request):
        assert (logprobs - reference[0]).abs().max().item() <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_dspark_drafts_match_the_quantising_reference(reference, layout, request):
    ref_logits, ref_confidence, ref_ids = reference[1]
    for _, (logits, confidence, ids), *_ in _results(layout, request):
        assert torch.equal(ids, ref_ids)
        assert (logits - ref_logits).abs().max().item() <= DRAFT_TOLERANCE
        assert (confidence - ref_confidence).abs().max().item() <= DRAFT_TOLERANCE


def test_every_tensor_parallel_rank_rounds_the_same_values(tp2):
    """The rounded tensors are replicated computations: both ranks round every one of them to the same numbers."""
    (_, first), (_, second) = tp2
    assert len(first) == len(second) > 0
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_the_setting_changes_the_log_probs(reference, tp1_off):
    """Without the setting our log-probs are far from the quantising reference's (measured: 1.85), so the parity
    above cannot pass without it."""
    assert (tp1_off[0] - reference[0]).abs().max().item() > LOGPROB_TOLERANCE


def test_the_same_parameters_get_a_gradient_with_and_without_the_setting(tp1, tp1_off):
    """Straight-through: rounding stops no gradient, so the setting reaches every weight the model reaches without it
    (every trainable one)."""
    def nonzero(grads):
        return {name for name, grad in grads.items() if grad.abs().max() > 0}

    assert nonzero(tp1[2]) == nonzero(tp1_off[2]) == tp1_off[3]


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_gradients_match_the_quantising_reference(float64_run, tolerances, layout, request):
    float64_grads = float64_run[0]
    for _, _, grads, trainable in [result[:4] for result in _results(layout, request)]:
        assert trainable == set(float64_grads)
        errors = relative_errors(grads, float64_grads)
        too_far = {name: (error, tolerances[name]) for name, error in errors.items()
                   if not error <= tolerances[name]}
        assert not too_far


def test_cli_logprobs_with_fake_quant(rows, tmp_path):
    """`modelzoo logprobs --fake-quant`: the Megatron backend within LOGPROB_TOLERANCE of the quantising reference,
    each row alone (as the command runs them); the hf backend is the quantising reference itself (bit-equal), and
    without the flag it is not."""
    from modelzoo.conversion.cli import main

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(rows.tolist()))
    reference = load_tiny()
    with torch.no_grad():
        expected = [next_token_logprobs(reference(row[None], fake_quant=True).logits, row[None])[0] for row in rows]

    def logprobs(*flags):
        out = tmp_path / f"{'-'.join(flags)}.json"
        assert main(["logprobs", str(V41_TINY), "--tokens", str(tokens), "--out", str(out), *flags]) == 0
        return [torch.tensor(values) for values in json.loads(out.read_text())["logprobs"]]

    for ours, wanted in zip(logprobs("--fake-quant"), expected):
        assert (ours - wanted).abs().max().item() <= LOGPROB_TOLERANCE
    assert all(torch.equal(ours, wanted) for ours, wanted in zip(logprobs("--fake-quant", "--backend", "hf"), expected))
    unquantised = logprobs("--backend", "hf")
    assert all((ours - wanted).abs().max().item() > LOGPROB_TOLERANCE for ours, wanted in zip(unquantised, expected))


def test_a_config_the_rounding_blocks_do_not_tile_is_refused(tmp_path):
    """FP8 / FP4 scales cover 32 channels (16 for the compressed K/V): a head_dim of 48 cannot be rounded so; refused
    when the provider is built (the reference would fail at its first forward), and accepted without the setting."""
    folder = tmp_path / "head-dim-48"
    shutil.copytree(V41_TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["head_dim"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    build_provider(folder)
    with pytest.raises(ValueError, match=r"fake_quant=True needs head_dim \(48\) and index_head_dim \(32\) of .* to be "
                                         r"multiples of 32"):
        build_provider(folder, fake_quant=True)
