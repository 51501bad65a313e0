"""`modelzoo.logprobs`: vocab-parallel token log-probabilities against torch's log_softmax on the whole logits.

The oracle is `torch.log_softmax` of the unpadded fp32 logits, gathered at the targets, and autograd's
gradient through it: nothing of ours. Checked at one rank and at two (each holding half of the padded
vocabulary, one of them padding only), and the Triton kernels against the plain ops they replace: in
Triton's CPU interpreter (a subprocess with TRITON_INTERPRET=1, set before triton is imported) and on a GPU
(`pytest -m gpu tests/test_logprobs.py`).
"""

import pytest
import torch

from modelzoo import runtime
from modelzoo.logprobs import PlainOps, next_token_logprobs, vocab_parallel_logprobs

# fp32 logits: the same fp32 sums as log_softmax in another order (an online maximum, blocks of columns)
FP32_TOLERANCE = 1e-5


def oracle(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, upstream: torch.Tensor):
    """(log-probabilities, d sum(upstream * log-probabilities) / d logits) with torch's ops on the real columns."""
    logits = logits.detach().float().requires_grad_()
    logprobs = torch.log_softmax(logits[..., :vocab_size], -1).gather(-1, targets[..., None]).squeeze(-1)
    (logprobs * upstream).sum().backward()
    return logprobs.detach(), logits.grad


def ours(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, upstream: torch.Tensor):
    logits = logits.detach().requires_grad_()
    logprobs = vocab_parallel_logprobs(logits, targets, vocab_size)
    (logprobs * upstream).sum().backward()
    return logprobs.detach(), logits.grad


def example(batch=2, seq=7, columns=96, vocab_size=90, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, columns, generator=generator) * 3).to(dtype)
    targets = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    return logits, targets, torch.randn(batch, seq, generator=generator)


@pytest.mark.parametrize("vocab_size", [96, 90])  # no padding; 6 padding columns
def test_one_rank_matches_log_softmax(vocab_size):
    logits, targets, upstream = example(vocab_size=vocab_size)
    expected, expected_grad = oracle(logits, targets, vocab_size, upstream)
    logprobs, grad = ours(logits, targets, vocab_size, upstream)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=FP32_TOLERANCE)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=FP32_TOLERANCE)
    assert torch.all(grad[..., vocab_size:] == 0), "padding columns got a gradient"


def test_bf16_logits_give_fp32_logprobs_and_a_bf16_gradient():
    """bf16 logits: the log-probabilities are computed in fp32 from the bf16 values, like the oracle on those
    values; the gradient is that fp32 gradient rounded once to bf16 (2^-8 relative)."""
    logits, targets, upstream = example(dtype=torch.bfloat16)
    expected, expected_grad = oracle(logits, targets, 90, upstream)
    logprobs, grad = ours(logits, targets, 90, upstream)
    assert logprobs.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=FP32_TOLERANCE)
    torch.testing.assert_close(grad.float(), expected_grad, rtol=2.0 ** -8, atol=1e-6)


def test_next_token_logprobs_shift_the_targets():
    logits, ids, upstream = example()
    for shift in (1, 3):
        expected, _ = oracle(logits[:, :-shift], ids[:, shift:], 90, upstream[:, :-shift])
        torch.testing.assert_close(next_token_logprobs(logits, ids, 90, shift), expected, rtol=0, atol=FP32_TOLERANCE)


def _sharded_rank(rank: int, logits, targets, vocab_size, upstream):
    with runtime.parallel(tp=2):
        local = logits.shape[-1] // 2
        return ours(logits[..., rank * local:(rank + 1) * local], targets, vocab_size, upstream)


@pytest.mark.parametrize("vocab_size", [90, 40])  # rank 1 holds 42 real columns and 6 padding; padding only
def test_two_ranks_match_log_softmax_on_the_whole_vocabulary(vocab_size):
    logits, targets, upstream = example(vocab_size=vocab_size)
    expected, expected_grad = oracle(logits, targets, vocab_size, upstream)
    (first, first_grad), (second, second_grad) = runtime.spawn(_sharded_rank, 2, logits, targets, vocab_size, upstream)
    torch.testing.assert_close(first, expected, rtol=0, atol=FP32_TOLERANCE)
    torch.testing.assert_close(second, expected, rtol=0, atol=FP32_TOLERANCE)
    torch.testing.assert_close(torch.cat([first_grad, second_grad], -1), expected_grad, rtol=0, atol=FP32_TOLERANCE)


def check_kernels(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """The kernels against `PlainOps` on the same rows: 4100 columns (three blocks, the last partial), of which
    `valid` are not padding; targets among the real columns, before them, past the shard and (valid 3000) on
    a padding column: those three are not this shard's."""
    from modelzoo import logprob_kernels

    generator = torch.Generator().manual_seed(1)
    for dtype in dtypes:
        for valid in (4100, 3000, 0):
            rows = (torch.randn(6, 4100, generator=generator) * 4).to(dtype).to(device)
            targets = torch.tensor([0, valid - 1, 2047, -3, 5000, 3500]).to(device)
            expected = PlainOps.statistics(rows, targets, valid)
            for name, got, want in zip(("largest", "sum_exp", "target"), logprob_kernels.statistics(rows, targets, valid),
                                       expected, strict=True):
                torch.testing.assert_close(got, want, rtol=FP32_TOLERANCE, atol=0, msg=f"{name} ({dtype}, {valid})")
            if valid == 0:
                continue
            grad = torch.randn(6, generator=generator).to(device)
            log_normaliser = expected[0] + torch.log(expected[1])
            got = logprob_kernels.gradient(grad, rows, targets, log_normaliser, valid)
            want = PlainOps.gradient(grad, rows, targets, log_normaliser, valid)
            # bf16: both round the same fp32 value once, which summation order may put on either side of a tie
            torch.testing.assert_close(got.float(), want.float(), rtol=FP32_TOLERANCE if dtype == torch.float32 else 2.0 ** -8,
                                       atol=1e-7, msg=f"gradient ({dtype}, {valid})")


def test_kernels_match_the_plain_ops_in_triton_interpreter(run_in_triton_interpreter):
    """CPU tensors through Triton's interpreter: the kernels' indexing and maths, without a GPU. fp32 only:
    the interpreter truncates fp32 to bf16 instead of rounding (triton 3.8), so bf16 is checked on the GPU."""
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_kernels_match_the_plain_ops_on_the_gpu():
    check_kernels("cuda", (torch.float32, torch.bfloat16))


@pytest.mark.gpu
def test_gpu_logprobs_match_log_softmax():
    logits, targets, upstream = example(batch=2, seq=300, columns=32768, vocab_size=32000, dtype=torch.bfloat16)
    expected, expected_grad = oracle(logits, targets, 32000, upstream)
    logprobs, grad = ours(logits.cuda(), targets.cuda(), 32000, upstream.cuda())
    torch.testing.assert_close(logprobs.cpu(), expected, rtol=0, atol=FP32_TOLERANCE)
    torch.testing.assert_close(grad.float().cpu(), expected_grad, rtol=2.0 ** -8, atol=1e-7)


if __name__ == "__main__":
    check_kernels("cpu", (torch.float32,))
