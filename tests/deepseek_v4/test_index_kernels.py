"""The Lightning Indexer's Triton kernel (`index_kernels.py`) against the plain ops it replaces.

The oracle is `index_scores` in fp32 with the incomplete entries masked to -inf (the plain path, which the CPU
parity tests check against transformers); `Indexer.top_k`'s picks on the kernel path are compared with the plain
path's. On CPU the kernel runs in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, which must be set
before triton is imported); on a GPU, compiled: `pytest -m gpu tests/deepseek_v4/test_index_kernels.py`.
"""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from modelzoo.deepseek_v4.model import indexer
from modelzoo.deepseek_v4.model.indexer import Indexer, index_scores

# fp32: the same fp32 products, summed in another order (over d in the dot, then over the heads): 1e-5 of the
# largest |score|. A dropped head or a wrong key or weight moves scores by ~1e-1 of it.
FP32_TOLERANCE = 1e-5
# bf16 inputs on a GPU against the fp32 oracle on the same bf16 values: the products are exact in fp32, but the
# tensor cores' fp32 sums are not rounded to nearest (a few fp32 ulps per sum of d terms).
TENSOR_CORE_TOLERANCE = 1e-4

# (batch, queries, heads, head_dim, entries): queries and entries that do not fill the 64-wide tiles; d 48 pads to
# 64; the last shape is the released configs' h and d
SHAPES = [(2, 150, 4, 32, 90), (1, 70, 3, 48, 130), (1, 200, 32, 128, 100)]


def _scales(heads: int, head_dim: int) -> tuple[float, float]:
    return head_dim**-0.5, heads**-0.5   # softmax_scale, weights_scaling, as Indexer has them


def inputs(shape, device: str, dtype: torch.dtype, causal: bool, seed: int = 0):
    """q, keys, head weights in `dtype`, and complete [B, s]: causal (rising from 0 to E) or random in [0, E]."""
    batch, queries, heads, head_dim, entries = shape
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, queries, heads, head_dim, generator=generator)
    keys = torch.randn(batch, entries, head_dim, generator=generator)
    weights = torch.randn(batch, queries, heads, generator=generator)
    if causal:
        complete = ((torch.arange(queries) + 1) * entries // queries).expand(batch, -1)
    else:
        complete = torch.randint(0, entries + 1, (batch, queries), generator=generator)
    return [t.to(device, dtype) for t in (q, keys, weights)] + [complete.to(device)]


def oracle(q, keys, weights, complete) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 plain scores of the same values, masked to -inf where not visible; and the visible mask."""
    visible = torch.arange(keys.shape[1], device=keys.device) < complete[..., None]
    scores = index_scores(q.float(), keys.float(), weights.float(), *_scales(q.shape[2], q.shape[3]))
    return scores.masked_fill(~visible, float("-inf")), visible


def check_scores(device: str, dtype: torch.dtype, tolerance: float) -> float:
    """The kernel's scores against the oracle on SHAPES; returns the largest error relative to the largest |score|."""
    from modelzoo.deepseek_v4.model.index_kernels import masked_index_scores
    worst = 0.0
    for shape in SHAPES:
        for causal in (True, False):
            q, keys, weights, complete = inputs(shape, device, dtype, causal)
            expected, visible = oracle(q, keys, weights, complete)
            scores = masked_index_scores(q, keys, weights, complete, *_scales(shape[2], shape[3]))
            assert torch.equal(scores == float("-inf"), ~visible), (shape, causal)
            assert visible.any() and not visible.all(), (shape, causal)
            error = ((scores - expected)[visible].abs().max() / expected[visible].abs().max()).item()
            assert error <= tolerance, (shape, causal, error)
            worst = max(worst, error)
    return worst


def check_picks(device: str, dtype: torch.dtype, tolerance: float) -> float:
    """`Indexer.top_k`'s picks on the kernel path equal the plain path's for the queries whose top k+1 oracle
    scores are apart by more than both paths' errors together (near-ties may go either way); returns the
    share of such queries, which must be a clear majority (on these inputs 97% at the fp32 tolerance, 76% at
    the tensor cores')."""
    from modelzoo.deepseek_v4.model import index_kernels
    batch, seq_len, heads, head_dim, ratio, topk = 2, 300, 8, 64, 4, 16
    entries = seq_len // ratio
    q, keys, weights, _ = inputs((batch, seq_len, heads, head_dim, entries), device, dtype, causal=True, seed=1)
    positions = torch.arange(seq_len, device=device).expand(batch, -1)
    stub = SimpleNamespace(ratio=ratio, topk=topk, softmax_scale=head_dim**-0.5, weights_scaling=heads**-0.5)
    # chunks of 128 queries: the last one partial
    with mock.patch.object(indexer, "index_kernels_for", lambda _: index_kernels), \
            mock.patch.object(indexer, "KERNEL_SCORE_BUDGET", batch * entries * 128):
        kernel_picks = Indexer.top_k(stub, q, keys, weights, positions)
    with mock.patch.object(indexer, "index_kernels_for", lambda _: None):
        plain_picks = Indexer.top_k(stub, q, keys, weights, positions)
    expected, visible = oracle(q, keys, weights, (positions + 1) // ratio)
    top = expected.topk(topk + 1, dim=-1).values
    gaps = top[..., :-1] - top[..., 1:]   # NaN between two -inf: both become -1
    separated = ((gaps > 2 * tolerance * expected[visible].abs().max()) | gaps.isnan()).all(-1)
    assert torch.equal(kernel_picks[separated], plain_picks[separated])
    # early queries see fewer than topk entries (-1 picks), late ones choose among many
    assert (kernel_picks == -1).any() and (kernel_picks[:, -1] >= 0).all()
    share = separated.float().mean().item()
    assert share >= 0.6, share
    return share


def check(device: str, dtype: torch.dtype, tolerance: float) -> None:
    error, share = check_scores(device, dtype, tolerance), check_picks(device, dtype, tolerance)
    print(f"{device} {dtype}: largest relative score error {error:.2e}, picks compared on {share:.0%} of queries")


def test_kernel_matches_the_plain_ops_in_triton_interpreter(run_in_triton_interpreter):
    """CPU tensors through Triton's interpreter: the kernel's indexing, masks and maths, without a GPU. fp32 only:
    the interpreter truncates fp32 to bf16 instead of rounding, so bf16 is checked on the GPU."""
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_kernel_matches_the_plain_ops_on_the_gpu():
    check("cuda", torch.float32, FP32_TOLERANCE)
    check("cuda", torch.bfloat16, TENSOR_CORE_TOLERANCE)


if __name__ == "__main__":
    check("cpu", torch.float32, FP32_TOLERANCE)
