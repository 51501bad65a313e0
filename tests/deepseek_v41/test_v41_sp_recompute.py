"""DeepSeek-V4.1 with sequence parallelism (TP 2 + SP, two gloo processes) and activation recompute (full "uniform"
and "block", selective core_attn + layernorm + moe; at TP 1 in this process and at TP 2 + SP), fp32 on the CPU.

Against our reference (hf_model.py) on the tiny checkpoint with a grown Engram table (dsv41_helpers' `grown`, tables
trainable), with dsv41_helpers' bars (LOGPROB_TOLERANCE 1e-5; the per-tensor gradient scheme against the float64
reference): TP 2 + SP on plain rows (2 x 64, with DSpark drafts), on packed rows (three sequences of 23, 40 and 33
tokens, pack_sequences' slots padded to even lengths) and on a right-padded batch (rows of 63 and 45 real tokens:
the longest is odd, so each_sequence pads its rows by one token for the split). The reference runs each sequence of
a packed or padded batch alone.

Recompute changes when activations are computed, not what: the same ops on the same inputs in the same order, so on
the CPU the loss and every gradient equal the same model's run without recompute bit for bit (torch.equal), at TP 1
and at TP 2 + SP; and they pass the reference's bars. The full groups (10 layers): uniform 3 -> 3 + 3 + 3 + 1 layers
(the last run partial), block 4 -> layers 0-3 one by one and 4-9 as they are, so checkpointed runs begin at KV, index
and reuse layers alike and read the CSA2 state published outside them.
"""

import pytest
import torch
import torch.distributed as dist
from dsv41_helpers import (  # noqa: F401 (fixtures: grown, rows, reference, float64_grads, tolerances)
    DRAFT_TOLERANCE,
    LOGPROB_TOLERANCE,
    V41_TINY,
    float64_grads,
    grad_tolerances,
    gradients_too_far,
    grown,
    megatron_grads_as_hf,
    next_token_logprobs,
    random_rows,
    reference,
    rows,
    tolerances,
)

from modelzoo import build_provider, runtime
from modelzoo.layers.sequences import pack_sequences

RECOMPUTE = {
    "uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    "block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=4),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "moe"]),
}
SETTINGS = ("none", *RECOMPUTE)
PADDED_LENGTHS = (63, 45)  # the real tokens of the right-padded batch's two rows


def packed_sequences() -> list[torch.Tensor]:
    tokens = random_rows(1, 96, seed=7)[0]
    return [tokens[:23], tokens[23:63], tokens[63:]]


def padded_sequences(rows: torch.Tensor) -> list[torch.Tensor]:
    return [row[:length] for row, length in zip(rows, PADDED_LENGTHS)]


def megatron_pass(provider, model, rows: torch.Tensor, batch: str, tp: int):
    """Forward and backward of -mean(next-token log-probs) over the batch's real tokens: (log-probs of each
    sequence, draft output or None, gradients by checkpoint name). Under sequence parallelism the gradients of the
    parameters that act on this rank's tokens are summed over TP first (what finalize_model_grads does)."""
    from megatron.core import parallel_state

    vocab, draft = provider.vocab_size, None
    model.zero_grad(set_to_none=True)
    if batch == "rows":
        logits, output = model(rows, draft_anchor_ids=rows.roll(-1, 1), runtime_gather_output=True)
        logprobs = list(next_token_logprobs(logits[..., :vocab], rows))
        draft = (output.logits.detach(), output.confidence.detach(), output.ids)
    elif batch == "packed":
        sequences = packed_sequences()
        packed = pack_sequences(sequences, divisor=tp)
        logits = model(packed.input_ids, packed_seq_params=packed.packed_seq_params, runtime_gather_output=True)
        logprobs = [next_token_logprobs(part[None, :, :vocab], sequence[None])[0]
                    for part, sequence in zip(packed.split(logits), sequences)]
    else:
        ids = rows.clone()
        padding = torch.zeros(2, 1, 1, rows.shape[1], dtype=torch.bool)  # GPTModel's mask: True = padding
        for row, length in enumerate(PADDED_LENGTHS):
            ids[row, length:] = 0
            padding[row, ..., length:] = True
        logits = model(ids, attention_mask=padding, runtime_gather_output=True)
        logprobs = [next_token_logprobs(logits[row:row + 1, :len(sequence), :vocab], sequence[None])[0]
                    for row, sequence in enumerate(padded_sequences(rows))]
    joined = torch.cat(logprobs)
    (-joined.sum() / joined.numel()).backward()
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    return [values.detach() for values in logprobs], draft, megatron_grads_as_hf(provider, model)


def megatron_runs(rank: int, folder, rows: torch.Tensor, tp: int) -> dict:
    """(setting, batch) -> megatron_pass's result: the model without recompute on every batch, each recompute
    setting on plain rows; at TP 2 with sequence parallelism. Also the refusal of rows the TP ranks cannot split."""
    results = {}
    for setting in SETTINGS:
        with runtime.parallel(tp=tp):
            provider = build_provider(folder, train_engram_tables=True, sequence_parallel=tp > 1,
                                      **RECOMPUTE.get(setting, {}))
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            model.eval()
            for batch in ("rows", "packed", "padded") if setting == "none" else ("rows",):
                results[setting, batch] = megatron_pass(provider, model, rows, batch, tp)
            if setting == "none" and tp > 1:
                try:
                    model(rows[:, :63])
                except ValueError as error:
                    results["odd length"] = str(error)
    return results


def reference_sequences_run(folder, sequences: list[torch.Tensor], dtype: torch.dtype = torch.float32):
    """Our reference on each sequence alone: its log-probs, and the gradients of -mean(log-probs) over all of them."""
    from modelzoo.deepseek_v41 import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    for name, param in model.named_parameters():
        if ".engram.embed.weight" in name:
            param.requires_grad_(True)
    logprobs = [next_token_logprobs(model(sequence[None]).logits, sequence[None])[0] for sequence in sequences]
    joined = torch.cat(logprobs)
    (-joined.sum() / joined.numel()).backward()
    grads = {name: param.grad for name, param in model.named_parameters() if param.requires_grad}
    return [values.detach() for values in logprobs], grads


@pytest.fixture(scope="module")
def tp1(grown, rows):
    return megatron_runs(0, grown, rows, 1)


@pytest.fixture(scope="module")
def sp(grown, rows):
    """Rank 0's and rank 1's results at TP 2 + SP (one pair of processes for every setting and batch)."""
    return runtime.spawn(megatron_runs, 2, grown, rows, 2)


@pytest.fixture(scope="module")
def unpacked_references(grown, rows):
    """batch -> (its sequences' reference log-probs, fp32 reference gradients, float64 gradients)."""
    batches = {"packed": packed_sequences(), "padded": padded_sequences(rows)}
    return {batch: (*reference_sequences_run(grown, sequences),
                    reference_sequences_run(grown, sequences, torch.float64)[1])
            for batch, sequences in batches.items()}


def expected(batch: str, reference, float64_grads, tolerances, unpacked_references):
    """(log-probs of each sequence, float64 gradients, per-tensor bars) the batch is held to."""
    if batch == "rows":
        return list(reference[0]), float64_grads, tolerances
    logprobs, grads, grads64 = unpacked_references[batch]
    return logprobs, grads64, grad_tolerances(grads, grads64)


@pytest.mark.parametrize("batch", ["rows", "packed", "padded"])
def test_sequence_parallel_logprob_and_gradient_parity(sp, batch, reference, float64_grads, tolerances,
                                                       unpacked_references):
    logprobs, grads64, bars = expected(batch, reference, float64_grads, tolerances, unpacked_references)
    for rank in sp:
        ours, _, grads = rank["none", batch]
        assert [len(values) for values in ours] == [len(values) for values in logprobs]
        assert max((a - b).abs().max().item() for a, b in zip(ours, logprobs)) <= LOGPROB_TOLERANCE
        assert not gradients_too_far(grads, grads64, bars)


def test_sequence_parallel_draft_parity(sp, reference):
    ref_logits, ref_confidence, ref_ids = reference[1]
    for rank in sp:
        logits, confidence, ids = rank["none", "rows"][1]
        assert torch.equal(ids, ref_ids)
        assert (logits - ref_logits).abs().max().item() <= DRAFT_TOLERANCE
        assert (confidence - ref_confidence).abs().max().item() <= DRAFT_TOLERANCE


def test_sequence_parallel_refuses_rows_the_ranks_cannot_split(sp):
    for rank in sp:
        assert rank["odd length"] == ("DeepSeek-V4.1: with sequence parallelism the sequence length (63) must be a "
                                      "multiple of the tensor-parallel size (2); pad the rows "
                                      "(pack_sequences(divisor=2) does)")


@pytest.mark.parametrize("setting", list(RECOMPUTE))
@pytest.mark.parametrize("layout", ["tp1", "tp2-sp"])
def test_recompute_gives_the_run_without_it_bit_for_bit_and_reference_parity(layout, setting, tp1, sp, reference,
                                                                            float64_grads, tolerances):
    for rank in [tp1] if layout == "tp1" else sp:
        logprobs, _, grads = rank[setting, "rows"]
        plain_logprobs, _, plain_grads = rank["none", "rows"]
        assert all(torch.equal(a, b) for a, b in zip(logprobs, plain_logprobs))
        assert grads.keys() == plain_grads.keys()
        assert [name for name in grads if not torch.equal(grads[name], plain_grads[name])] == []
        assert max((a - b).abs().max().item() for a, b in zip(logprobs, reference[0])) <= LOGPROB_TOLERANCE
        assert not gradients_too_far(grads, float64_grads, tolerances)


def test_a_selective_module_v41_lacks_is_refused():
    with runtime.parallel():
        provider = build_provider(V41_TINY, recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
        with pytest.raises(ValueError) as error:
            provider.provide()
    assert str(error.value) == (
        "DeepSeek-V4.1: recompute_modules 'mlp' names no piece of this model; it recomputes 'core_attn' (compressor "
        "and attention over window and compressed entries (the indexer's picks are kept)); 'layernorm' "
        "(hyper-connection maps and the norms after them); 'moe' (router, routed and shared experts)")
