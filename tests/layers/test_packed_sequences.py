"""The trainer's call on packed (THD) rows and padded batches, for Llama, LoopCoder and DeepSeek-V4.

Oracle: each sequence run alone through the Hugging Face model (transformers' Llama and DeepseekV4, our
LoopCoder reference), full-sequence forward in fp32.

- A packed row of sequences of lengths 1, 17, 40, 5 and 70 (longer than LoopCoder's window of 8 and
  DeepSeek-V4's window of 16 and compress ratios 4 / 16), each slot padded to a multiple of 8: every
  sequence's log-probs equal its own HF run, LOGPROB_TOLERANCE = 1e-5 (fp32; the same math in another
  order moves them by ~3e-6, a token that reads another sequence by > 1e-2). With `labels`, the per-token
  loss is minus those log-probs (same tolerance).
- Gradients of the packed row's summed loss equal the sum of the gradients of each sequence run alone
  (GRADIENT_TOLERANCE = 1e-4 relative to the largest entry of each tensor, max-norm).
- Left- and right-padded batches ([b, 1, 1, s] padding masks with position ids, SkyRL's form, and the full
  [b, 1, s, s] mask of the same padding): the real tokens' log-probs equal the unpadded run (1e-5).
At TP 1 (exact and fast attention: on the CPU, SDPA with the layout's mask for the dense models and DeepSeek-V4's
blocked kernel per sequence) and TP 2 (two gloo processes), and EP 2 for DeepSeek-V4, where the two ranks hold
different rows.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

from modelzoo import build_provider, runtime
from modelzoo.parity import load_hf_model, logprobs_from_logits
from modelzoo.layers.sequences import pack_sequences

LOGPROB_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4
LENGTHS = (1, 17, 40, 5, 70)
DIVISOR = 8
ARCHITECTURES = {"llama": "llama-tiny", "loopcoder": "loopcoder-tiny", "deepseek_v4": "deepseek-v4-tiny"}
BUFFERS = ("tid2eid", "e_score_correction_bias", "ffn.gate.bias")  # checkpoint tensors that are buffers


def sequences(vocab: int = 250, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for length in LENGTHS]


def padded_batch(first: list[int], second: list[int]):
    """Row 0 right-padded, row 1 left-padded: ids, [2, 1, 1, S] padding mask, position ids, full [2, 1, S, S] mask."""
    seq = max(len(first), len(second)) + 5
    ids = torch.zeros(2, seq, dtype=torch.long)
    padding = torch.ones(2, 1, 1, seq, dtype=torch.bool)
    positions = torch.zeros(2, seq, dtype=torch.long)
    full = torch.ones(2, 1, seq, seq, dtype=torch.bool)
    for row, (tokens, start) in enumerate([(first, 0), (second, seq - len(second))]):
        span = slice(start, start + len(tokens))
        ids[row, span] = torch.tensor(tokens)
        padding[row, 0, 0, span] = False
        positions[row, span] = torch.arange(len(tokens))
        full[row, 0, span, span] = ~torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
    return ids, padding, positions, full


def _grads_by_name(provider, model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, exported through the weight mapping (HF names, full tensors; collective)."""
    saved = {}
    with torch.no_grad():
        for param in model.parameters():
            saved[param] = param.detach().clone()
            param.copy_(param.grad if param.grad is not None else torch.zeros_like(param))
        grads = {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)
                 if not name.endswith(BUFFERS)}
        for param, value in saved.items():
            param.copy_(value)
            param.grad = None
    return grads


def _rank(rank: int, folder, tp: int, ep: int, attention: str, all_sequences):
    with runtime.parallel(tp=tp, ep=ep):
        provider = build_provider(folder, attention=attention)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        model.eval()
        # EP ranks are data-parallel replicas: rank 1 packs the sequences in reverse, in slots of another size
        other_data = ep > 1 and rank == 1
        seqs = all_sequences[::-1] if other_data else all_sequences
        batch = pack_sequences(seqs, divisor=DIVISOR // 2 if other_data else DIVISOR)
        params = batch.packed_seq_params
        packed = provider.token_logprobs(model, batch.input_ids, packed_seq_params=params)

        labels, loss_mask = batch.labels()
        loss = model(batch.input_ids, None, None, labels=labels, packed_seq_params=params)
        (loss * loss_mask).sum().backward()
        packed_grads = _grads_by_name(provider, model)
        for seq in seqs:
            if len(seq) > 1:
                ids = torch.tensor([seq])
                (-provider.token_logprobs(model, ids).sum()).backward()
        alone_grads = _grads_by_name(provider, model)

        with torch.no_grad():
            ids, padding, positions, full = padded_batch(seqs[2], seqs[4])
            padded = provider.token_logprobs(model, ids, attention_mask=padding, position_ids=positions)
            full_mask = provider.token_logprobs(model, ids, attention_mask=full, position_ids=positions)
        return dict(packed=[p.detach() for p in packed], losses=[l.detach() for l in batch.split(loss, shift=1)],
                    packed_grads=packed_grads, alone_grads=alone_grads, padded=padded, full_mask=full_mask,
                    order=int(other_data), seq=ids.shape[1])


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def architecture(request):
    folder = TINY / ARCHITECTURES[request.param]
    seqs = sequences()
    model = load_hf_model(folder)
    with torch.no_grad():
        reference = [logprobs_from_logits(model(torch.tensor([s]), use_cache=False).logits, torch.tensor([s]))[0]
                     for s in seqs]
    layouts = [(1, 1, "fast"), (2, 1, "exact")] + ([(1, 2, "exact")] if request.param == "deepseek_v4" else [])
    results = {(1, 1, "exact"): runtime.run(_rank, 1, folder, 1, 1, "exact", seqs)}
    for tp, ep, attention in layouts:
        results[(tp, ep, attention)] = runtime.run(_rank, tp * ep, folder, tp, ep, attention, seqs)
    return request.param, seqs, reference, results


def _max_diff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _rank_results(architecture):
    _, seqs, reference, results = architecture
    for (tp, ep, attention), ranks in results.items():
        for result in ranks:
            order = reference if result["order"] == 0 else reference[::-1]
            yield f"tp{tp}-ep{ep}-{attention}", result, order


def test_every_packed_sequence_equals_its_own_hf_run(architecture):
    for layout, result, reference in _rank_results(architecture):
        assert [len(p) for p in result["packed"]] == [len(r) for r in reference]
        for number, (ours, theirs) in enumerate(zip(result["packed"], reference)):
            assert _max_diff(ours, theirs) <= LOGPROB_TOLERANCE, (layout, number)


def test_the_loss_with_labels_is_minus_those_logprobs(architecture):
    for layout, result, reference in _rank_results(architecture):
        for number, (loss, theirs) in enumerate(zip(result["losses"], reference)):
            assert _max_diff(-loss, theirs) <= LOGPROB_TOLERANCE, (layout, number)


def test_packed_gradients_are_the_sum_of_each_sequences_gradients(architecture):
    for layout, result, _ in _rank_results(architecture):
        packed, alone = result["packed_grads"], result["alone_grads"]
        assert packed.keys() == alone.keys()
        for name, expected in alone.items():
            scale = expected.abs().max().item()
            if scale == 0:   # no gradient path (DeepSeek-V4's indexer: a top-k of indices)
                assert packed[name].abs().max().item() == 0, (layout, name)
                continue
            error = (packed[name] - expected).abs().max().item() / scale
            assert error <= GRADIENT_TOLERANCE, (layout, name, error)


def test_left_and_right_padded_rows_equal_the_unpadded_runs(architecture):
    for layout, result, reference in _rank_results(architecture):
        first, second = reference[2], reference[4]
        seq = result["seq"]
        for padded in (result["padded"], result["full_mask"]):
            assert _max_diff(padded[0, : len(first)], first) <= LOGPROB_TOLERANCE, layout
            assert _max_diff(padded[1, seq - 1 - len(second):], second) <= LOGPROB_TOLERANCE, layout
