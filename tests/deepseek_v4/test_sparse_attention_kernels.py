"""The CSA attention kernels (`sparse_attention_kernels.py`) against the dense blocks they replace on a GPU.

The oracle is `window_sink_attention`'s dense path on CPU (fp32; tested against a per-query float64 oracle in
test_window_attention.py and with a halo in the context-parallel tests): outputs and the gradients of q, kv and the
sinks. On CPU the kernels run in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, set before triton is
imported), fp32; on a GPU, compiled, in bf16 too: `pytest -m gpu tests/deepseek_v4/test_sparse_attention_kernels.py`.
Both also run the kernels under a recompute that keeps the attention output (`keep_attention_output`).
"""

from unittest import mock

import pytest
import torch

from modelzoo.deepseek_v4.model import window_attention
from modelzoo.deepseek_v4.model.sparse_attention_kernels import sparse_sink_attention

# fp32: the same fp32 formulas summed in another order (an online softmax over blocks of keys, atomic adds of the
# kv gradient in any order), on O(1) values over sums of tens of terms: 1e-5 max |diff|. A wrong row, mask or sink
# term is off by > 1e-2.
FP32_TOLERANCE = 1e-5
# bf16, against the fp32 oracle on the same bf16 values: both paths round probabilities and score gradients to bf16
# for the products with the keys; the kernels' error may exceed the dense blocks' by one bf16 rounding (2^-8) of
# each tensor's largest value.
BF16_ROUNDING = 2.0 ** -8

CASES = {
    # name: (batch, seq_len, compressed entries, picks per query, window, heads, head_dim, halo)
    "window shorter than a key block, empty slots": (2, 45, 11, 4, 8, 3, 16, 0),
    "picks over several key blocks, 16 heads": (1, 50, 30, 20, 40, 16, 16, 0),
    "a halo of window keys before the queries": (1, 40, 9, 5, 16, 5, 32, 7),
}


def inputs(case: str, device: str, dtype: torch.dtype, seed: int = 0):
    """q, kv, sinks (leaf tensors wanting gradients), picks, window, halo and the output gradient of one case."""
    batch, seq_len, entries, per_query, window, heads, dim, halo = CASES[case]
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dim, generator=generator)
    kv = torch.randn(batch, halo + seq_len + entries, dim, generator=generator)
    sinks = torch.randn(heads, generator=generator)
    # distinct entries per query, as a top-k gives them; about a quarter of the slots empty
    picks = torch.rand(batch, seq_len, entries, generator=generator).argsort(-1)[..., :per_query]
    picks = picks.masked_fill(torch.rand(picks.shape, generator=generator) < 0.25, -1)
    out_grad = torch.randn(q.shape, generator=generator)
    leaves = [t.to(dtype).to(device).requires_grad_() for t in (q, kv)] + [sinks.to(device).requires_grad_()]
    return leaves, picks.to(device), window, halo, out_grad.to(device)


def outputs_and_gradients(attention, leaves, picks, window, halo, out_grad):
    out = attention(*leaves, leaves[0].shape[-1] ** -0.5, window, picks, halo=halo)
    grads = torch.autograd.grad(out, leaves, out_grad.to(out.dtype))
    return [t.detach().float().cpu() for t in (out, *grads)]


def dense(q, kv, sinks, scale, window, picks, halo):
    with mock.patch.object(window_attention, "_sparse_kernels", lambda q, kv: None):
        return window_attention.window_sink_attention(q, kv, sinks, scale, window, picks, halo=halo)


def max_errors(results, reference):
    return [(a - b).abs().max().item() for a, b in zip(results, reference, strict=True)]


def check(device: str, bf16: bool) -> None:
    names = ["out", "q grad", "kv grad", "sinks grad"]
    for case in CASES:
        reference = outputs_and_gradients(dense, *inputs(case, "cpu", torch.float32))
        ours = outputs_and_gradients(sparse_sink_attention, *inputs(case, device, torch.float32))
        errors = max_errors(ours, reference)
        assert max(errors) <= FP32_TOLERANCE, (case, dict(zip(names, errors)))
        if not bf16:
            continue
        leaves, picks, window, halo, out_grad = inputs(case, "cpu", torch.bfloat16)
        oracle = outputs_and_gradients(dense, [t.detach().float().requires_grad_() for t in leaves], picks, window,
                                       halo, out_grad)
        kernel_errors = max_errors(outputs_and_gradients(sparse_sink_attention, *inputs(case, device, torch.bfloat16)),
                                   oracle)
        dense_errors = max_errors(outputs_and_gradients(dense, *inputs(case, device, torch.bfloat16)), oracle)
        for name, kernel, plain, expected in zip(names, kernel_errors, dense_errors, oracle, strict=True):
            assert kernel <= plain + BF16_ROUNDING * expected.abs().max().item(), (case, name, kernel, plain)


def check_kept_across_recompute(device: str) -> None:
    """keep_attention_output through the kernels: a recomputed region that keeps attention outputs runs the forward
    kernel once (the forward's output goes to the recompute) and gives the gradients of a run without recompute."""
    from modelzoo.deepseek_v4.model import sparse_attention_kernels
    from modelzoo.layers.recompute import ATTENTION_OUTPUT, recomputed

    leaves, picks, window, halo, out_grad = inputs("picks over several key blocks, 16 heads", device, torch.float32)

    def loss(q, kv, sinks):
        return (sparse_sink_attention(q, kv, sinks, q.shape[-1] ** -0.5, window, picks, halo=halo) * out_grad).sum()

    reference = torch.autograd.grad(loss(*leaves), leaves)
    for keeps, runs in ((frozenset(), 2), (frozenset({ATTENTION_OUTPUT}), 1)):   # recomputed, then kept
        with mock.patch.object(sparse_attention_kernels, "_attend", wraps=sparse_attention_kernels._attend) as attend:
            grads = torch.autograd.grad(recomputed(loss, True, keeps)(*leaves), leaves)
        assert attend.call_count == runs, (keeps, attend.call_count)
        assert max(max_errors(grads, reference)) <= FP32_TOLERANCE, keeps


def test_kernels_match_the_dense_blocks_in_triton_interpreter(run_in_triton_interpreter):
    """CPU tensors through Triton's interpreter: the kernels' rows, masks and maths without a GPU (fp32: the
    interpreter truncates fp32 to bf16 instead of rounding, so bf16 is checked on the GPU)."""
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_kernels_match_the_dense_blocks_on_the_gpu():
    check("cuda", bf16=True)
    check_kept_across_recompute("cuda")


if __name__ == "__main__":
    check("cpu", bf16=False)
    check_kept_across_recompute("cpu")
