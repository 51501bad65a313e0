"""DeepSeek-V4 decoder layers replayed as CUDA graphs (`capture_cuda_graphs`) against the same model run eagerly.

Run on the accelerator: `pytest -m gpu tests/deepseek_v4/test_cuda_graphs_gpu.py -s`. bf16, attention="fast"
(the graphs replay the fast path's kernels; fp32 experts on GPU loop over experts with a host sync).
The forward replays the kernels the eager forward launches, on the same inputs: its log-probs are
compared exactly. Gradients are sums whose order the backward kernels need not keep from run to run,
so they are compared at GRAPH_GRAD_TOLERANCE = 2e-2 of each parameter's largest
gradient: a few bf16 roundings (2^-8 each); a stale or overwritten graph buffer is off by O(1).
"""

import pytest
import torch
from dsv4_helpers import provider_for, random_tokens, write_tiny

from modelzoo import runtime

pytestmark = pytest.mark.gpu

GRAPH_GRAD_TOLERANCE = 2e-2


def _model(tmp_path):
    folder = write_tiny(tmp_path / "tiny")
    provider = provider_for(folder, params_dtype=torch.bfloat16, attention="fast")
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    return provider, model


def _step(provider, model, ids):
    model.zero_grad(set_to_none=True)
    logprobs = provider.token_logprobs(model, ids)
    (-logprobs.mean()).backward()
    return logprobs.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(actual: dict, expected: dict, factor: float = 1.0):
    assert actual.keys() == expected.keys()
    for name, reference in expected.items():
        scale = max(factor * reference.abs().max().item(), 1e-30)
        diff = (actual[name].float() - factor * reference.float()).abs().max().item()
        assert diff <= GRAPH_GRAD_TOLERANCE * scale, f"{name}: {diff} > {GRAPH_GRAD_TOLERANCE} x {scale}"


def _eager_layer_ran(*args, **kwargs):
    raise AssertionError("a decoder layer ran eagerly where its CUDA graph should have replayed")


def test_graphed_layers_match_eager_forward_and_backward(tmp_path):
    ids = random_tokens(2, 128).cuda()
    with runtime.parallel():
        provider, model = _model(tmp_path)
        eager_logprobs, eager_grads = _step(provider, model, ids)
        model.capture_cuda_graphs(ids)
        for layer in model.decoder.layers:  # from here on a layer's Python forward must not run
            layer.forward = _eager_layer_ran
        for _ in range(2):  # the second replay runs on the first's leftover buffers
            logprobs, grads = _step(provider, model, ids)
            assert torch.equal(logprobs, eager_logprobs)
            _assert_grads_close(grads, eager_grads)
        for layer in model.decoder.layers:
            del layer.forward
        # another shape runs eagerly, and still agrees with the eager model
        other = random_tokens(2, 64, seed=1).cuda()
        graphed_other = _step(provider, model, other)
        model.release_cuda_graphs()
        eager_other = _step(provider, model, other)
        assert torch.equal(graphed_other[0], eager_other[0])


def test_graphed_gradients_accumulate_over_micro_batches(tmp_path):
    ids = random_tokens(2, 128).cuda()
    with runtime.parallel():
        provider, model = _model(tmp_path)
        model.capture_cuda_graphs(ids)
        _, single = _step(provider, model, ids)
        model.zero_grad(set_to_none=True)
        for _ in range(2):  # no zero_grad in between: the second backward adds to the first
            (-provider.token_logprobs(model, ids).mean()).backward()
        _assert_grads_close({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, single, 2.0)


def test_a_forward_before_the_previous_backward_is_refused(tmp_path):
    ids = random_tokens(2, 128).cuda()
    with runtime.parallel():
        provider, model = _model(tmp_path)
        model.capture_cuda_graphs(ids)
        pending = provider.token_logprobs(model, ids).mean()
        with pytest.raises(RuntimeError, match="before the previous graphed forward's backward"):
            provider.token_logprobs(model, ids)
        del pending  # its autograd graph is gone: nothing waits for a backward any more
        with torch.no_grad():
            provider.token_logprobs(model, ids)


def test_graphed_backward_hands_over_its_buffers_without_copies(tmp_path):
    """A `.grad` that was None becomes the backward graph's own buffer (no copy), which the next replay refills.

    Autograd itself copies a buffer whose strides differ from its parameter's (its layout contract), so
    the parameters checked are those whose `.grad` is a graph buffer after the first step: after the
    second, each must hold the same buffer (a copy per step would be new memory: the old one is kept alive).
    """
    ids = random_tokens(2, 128).cuda()
    with runtime.parallel():
        provider, model = _model(tmp_path)
        model.capture_cuda_graphs(ids)
        graphs = model.layer_graphs
        _step(provider, model, ids)
        handed_over = [graphs.params[index] for index, pointer in graphs.adopted.items()
                       if graphs.params[index].grad.data_ptr() == pointer]
        assert handed_over, "no parameter's .grad is a graph buffer"
        first = [param.grad for param in handed_over]  # kept alive across the next step
        first_values = [grad.clone() for grad in first]
        _step(provider, model, torch.roll(ids, 1, dims=1))
        for param, grad in zip(handed_over, first, strict=True):
            assert param.grad.data_ptr() == grad.data_ptr()
        # the second step's gradients (other tokens) went into the same buffers
        assert any(not torch.equal(grad, values) for grad, values in zip(first, first_values, strict=True))
