"""window_sink_attention (attention="fast": dense blocks of GEMMs) against a per-query float64 oracle.

The oracle is written here from the definition, one query at a time: softmax over the query's visible
keys (window t - W < s <= t, then its visible compressed entries, from a dense mask built here from the picks or
the window ratio) and the head's sink logit, times the values, with the sink adding none. TOLERANCE = 1e-5 (max |diff|, outputs and gradients of O(1)): the
function computes in fp32 (scores accumulated in fp32, fp32 softmax), ~1e-7 relative per op over sums
of tens of terms; a wrong mask, block edge or sink term is off by > 1e-2.
"""

import pytest
import torch

from modelzoo.deepseek_v4.model import window_attention
from modelzoo.deepseek_v4.model.window_attention import window_sink_attention

TOLERANCE = 1e-5


def oracle(q, kv, sinks, scale, window, compressed_visible):
    """q [B, S, h, D], kv [B, S + C, D], compressed_visible [B or 1, S, C] -> [B, S, h, D] (float64)."""
    batch, seq_len, heads, _ = q.shape
    q, kv, sinks = q.double(), kv.double(), sinks.double()
    rows = []
    for b in range(batch):
        for t in range(seq_len):
            keys = list(range(max(0, t - window + 1), t + 1))
            if compressed_visible is not None:
                visible = compressed_visible[min(b, compressed_visible.shape[0] - 1), t]
                keys += [seq_len + c for c in range(visible.shape[0]) if visible[c]]
            values = kv[b, keys]                                                      # [keys, D]
            logits = torch.cat([q[b, t] @ values.T * scale, sinks[:, None]], dim=-1)  # [h, keys + 1]
            rows.append(torch.softmax(logits, dim=-1)[:, :-1] @ values)
    return torch.stack(rows).view(batch, seq_len, heads, -1)


CASES = {
    # name: (batch, seq_len, compressed entries, window, visibility of the compressed entries)
    "sliding, length not a multiple of the window": (2, 37, 0, 8, None),
    "sliding, window as long as the sequence": (1, 16, 0, 16, None),
    "CSA-like: each query's own picks, some slots empty": (2, 45, 11, 8, "picks"),
    "HCA-like: the complete windows (ratio 8)": (1, 40, 5, 8, "ratio"),
    # with the ratio given, each chunk scores only the entries complete at its last query
    "CSA: picks of complete entries, ratio 4": (2, 45, 11, 8, "complete picks"),
}
PICKS = 4      # entries per query in the CSA-like case
RATIO = 8      # tokens per entry in the HCA-like case
CSA_RATIO = 4  # tokens per entry in the CSA case with complete picks


def _picked(picks, compressed_len):
    """[B, S, k] entry ids (-1: none) -> [B, S, C] bool."""
    visible = torch.zeros(*picks.shape[:2], compressed_len, dtype=torch.bool)
    for (b, t, _), entry in zip(torch.nonzero(picks >= 0).tolist(), picks[picks >= 0].tolist()):
        visible[b, t, entry] = True
    return visible


def _inputs(batch, seq_len, compressed_len, visibility, heads=3, dim=16, seed=0):
    """-> q, kv, sinks, picks (or None), ratio (or None) and the dense [B or 1, S, C] visibility for the oracle."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dim, generator=generator)
    kv = torch.randn(batch, seq_len + compressed_len, dim, generator=generator)
    sinks = torch.randn(heads, generator=generator)
    picks = ratio = visible = None
    if visibility == "picks":  # distinct entries per query, as a top-k gives them; about a quarter of the slots empty
        picks = torch.rand(batch, seq_len, compressed_len, generator=generator).argsort(-1)[..., :PICKS]
        picks = picks.masked_fill(torch.rand(picks.shape, generator=generator) < 0.25, -1)
        visible = _picked(picks, compressed_len)
    elif visibility == "ratio":
        ratio = RATIO
        visible = (torch.arange(compressed_len) < (torch.arange(seq_len)[:, None] + 1) // RATIO)[None]
    elif visibility == "complete picks":  # PICKS of the entries complete at each query (fewer early on: -1)
        ratio = CSA_RATIO
        complete = torch.arange(compressed_len) < (torch.arange(seq_len)[:, None] + 1) // CSA_RATIO   # [S, C]
        order = torch.rand(batch, seq_len, compressed_len, generator=generator).masked_fill(~complete, 2.0).argsort(-1)
        picks = order[..., :PICKS].masked_fill(~complete.expand(batch, -1, -1).gather(-1, order[..., :PICKS]), -1)
        visible = _picked(picks, compressed_len)
    return q, kv, sinks, picks, ratio, visible


@pytest.mark.parametrize("score_budget", [2**27, 300], ids=["one chunk", "chunks of one block"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_oracle_forward_and_backward(case, score_budget, monkeypatch):
    monkeypatch.setattr(window_attention, "SCORE_BUDGET", score_budget)
    batch, seq_len, compressed_len, window, visibility = CASES[case]
    q, kv, sinks, picks, ratio, visible = _inputs(batch, seq_len, compressed_len, visibility)
    scale = q.shape[-1] ** -0.5
    inputs = [t.requires_grad_() for t in (q, kv, sinks)]
    reference_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ours = window_sink_attention(*inputs, scale, window, picks, ratio)
    reference = oracle(*reference_inputs, scale, window, visible)
    assert ours.shape == reference.shape and ours.dtype == q.dtype
    assert (ours.double() - reference).abs().max().item() <= TOLERANCE

    out_grad = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    ours_grads = torch.autograd.grad(ours, inputs, out_grad)
    reference_grads = torch.autograd.grad(reference, reference_inputs, out_grad.double())
    for name, got, expected in zip(("q", "kv", "sinks"), ours_grads, reference_grads):
        assert (got.double() - expected).abs().max().item() <= TOLERANCE, name


def test_bf16_inputs_give_bf16_outputs_and_gradients():
    q, kv, sinks, picks, _, _ = _inputs(1, 24, 4, "picks")
    q, kv = q.bfloat16().requires_grad_(), kv.bfloat16().requires_grad_()
    sinks.requires_grad_()
    out = window_sink_attention(q, kv, sinks, 0.25, 8, picks)
    out.float().sum().backward()
    assert out.dtype == q.grad.dtype == kv.grad.dtype == torch.bfloat16 and sinks.grad.dtype == torch.float32
