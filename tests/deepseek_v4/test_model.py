"""The whole DeepSeek-V4 model at TP=1 against transformers' DeepseekV4ForCausalLM (fp32, CPU, batch 2 x 64).

LOGPROB_TOLERANCE = 1e-4 (max |diff| of token log-probabilities): the same fp32 math in the same
order, with differences from matmul blocking and Megatron's vocab-parallel cross entropy
(measured ~1e-6); a wrong weight, mask or routing moves log-probabilities by > 1e-2 on this model.
GRAD_TOLERANCE = 1e-4, relative max-norm per tensor (max |g_ours - g_hf| <= 1e-4 max |g_hf|):
backward sums over 128 tokens and 4 layers accumulate a few 1e-7 relative errors; a missing
gradient path (e.g. an un-reduced replicated weight) is off by O(1).
"""

import pytest
import torch
from dsv4_helpers import (
    hf_logprobs_and_grads,
    hf_token_logprobs,
    max_diff,
    megatron_grads_as_hf,
    provider_for,
    random_tokens,
    worst_relative_grad_error,
    write_tiny,
)
from safetensors.torch import load_file

from modelzoo import runtime

LOGPROB_TOLERANCE = 1e-4
GRAD_TOLERANCE = 1e-4
FAST_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("dsv4") / "deepseek-v4-tiny")


def test_logprob_and_gradient_parity(tiny, tmp_path):
    ids = random_tokens()
    reference, reference_grads = hf_logprobs_and_grads(tiny, ids, tmp_path / "hf-grads")
    with runtime.parallel():
        provider = provider_for(tiny)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        model.eval()
        ours = provider.token_logprobs(model, ids)
        (-ours.mean()).backward()
        grads = megatron_grads_as_hf(provider, model)

    assert ours.shape == (2, 63)
    assert max_diff(ours, reference) <= LOGPROB_TOLERANCE
    assert len(reference_grads) > 100 and set(reference_grads) <= set(grads)
    worst, name = worst_relative_grad_error(grads, reference_grads)
    assert worst <= GRAD_TOLERANCE, name


def test_round_trip_is_bit_exact(tiny):
    source = load_file(tiny / "model.safetensors")
    with runtime.parallel():
        provider = provider_for(tiny)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        exported = dict(provider.export_hf_weights(model))
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_fast_attention_matches_exact_forward_and_backward(tiny):
    # FAST_TOLERANCE = 1e-5 on log-probabilities and relative gradients: the same fp32 scores, a different
    # softmax (blocks, log-sum-exp) and a hand-written backward move results by ~1e-7.
    ids = random_tokens(seed=5)
    outputs, grads = {}, {}
    with runtime.parallel():
        for attention in ("exact", "fast"):
            provider = provider_for(tiny, attention=attention)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            outputs[attention] = provider.token_logprobs(model, ids)
            (-outputs[attention].mean()).backward()
            grads[attention] = megatron_grads_as_hf(provider, model)
    assert max_diff(outputs["fast"], outputs["exact"]) <= FAST_TOLERANCE
    for name, reference in grads["exact"].items():  # zero where neither has a path (MTP, the indexer's top-k)
        assert max_diff(grads["fast"][name], reference) <= FAST_TOLERANCE * reference.abs().max().item(), name


def test_cuda_graph_capture_on_cpu_is_refused_and_the_model_still_runs(tiny):
    ids = random_tokens(seed=6)
    with runtime.parallel():
        provider = provider_for(tiny)
        model = provider.provide()
        with pytest.raises(ValueError, match="CUDA graphs need CUDA tensors: the sample inputs are on cpu"):
            model.capture_cuda_graphs(ids)
        assert model.layer_graphs is None
        with torch.no_grad():
            assert torch.isfinite(provider.token_logprobs(model, ids)).all()


def test_swiglu_limit_zero_means_no_clamp_as_in_deepseeks_inference_code(tmp_path):
    """DeepSeek's inference code clamps only `if swiglu_limit > 0`; transformers clamps at 0 too, zeroing every
    expert. Oracle: transformers with the clamp out of reach (a limit of 1e30 clamps no finite activation)."""
    from transformers import DeepseekV4ForCausalLM

    folder = write_tiny(tmp_path / "limit0", swiglu_limit=0.0)
    ids = random_tokens(seed=7)

    def transformers_logprobs(**config):
        model = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32, **config).eval()
        with torch.no_grad():
            return hf_token_logprobs(model, ids)

    unclamped, clamped_at_zero = transformers_logprobs(swiglu_limit=1e30), transformers_logprobs()
    with runtime.parallel(), torch.no_grad():
        provider = provider_for(folder)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        ours = provider.token_logprobs(model.eval(), ids)
    assert max_diff(ours, unclamped) <= LOGPROB_TOLERANCE
    assert max_diff(ours, clamped_at_zero) > 1e-2  # transformers' literal reading: experts contribute nothing
