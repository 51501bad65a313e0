"""Context parallelism (`runtime.parallel(cp=N)`) for the Megatron DeepSeek-V4.1 against our reference (hf_model.py).

Each CP rank gets its share of the batch in Megatron's load-balanced layout (2 x CP chunks per row or packed slot,
rank r holding chunks r and 2 x CP - 1 - r), `split_for_rank` as a trainer hands it over, and runs
`model(local_ids, labels=local_labels, packed_seq_params=the whole row's)`. fp32 on deepseek-v41-tiny, Engram
tables trainable on both sides (as in test_v41_megatron_parity.py).

Batches: rows [2, 64] (as test_v41_megatron_parity.py's: past the sliding window 8, the index top-k 8 and the
candidate budget of 3 blocks of 4 latents at ratio 1, through every layer role) and a packed row of sequences of
lengths 3, 21 and 34 (slots of 4, 24 and 36 tokens: multiples of 2 x CP, with slot padding), each run alone by the
reference. At CP 2 a rank's chunks are 16 tokens of a row (9, 6 and 1 tokens of a packed slot): window keys,
compressor groups, candidate blocks and n-grams reach into the other rank's chunks.
Layouts, one spawn of four ranks: CP 2 (two data-parallel replicas), EP 2 x CP 2 (Megatron forms the expert groups
from the data x context ranks: the two ranks of a CP group are an EP group, and the experts see both ranks' tokens
through the dispatcher), TP 2 x CP 2, and TP 2 + SP x CP 2 (the TP ranks split each sequence's share, padded to a
multiple of 2, as SkyRL runs TP > 1 with CP).

- The per-token loss each rank returns, gathered over the CP group, is minus the reference's log-probs
  (LOGPROB_TOLERANCE = 1e-5, the issue's bar: the same fp32 math in another order).
- Gradients of the local losses (each rank's tokens' share of minus the batch's mean log-prob), summed as DDP sums
  them (the dense ones over the data-parallel group with context parallelism, the experts' over the expert
  data-parallel group) and divided by the data-parallel replicas, which run the same batch: the sum over the CP
  group, where an expert shard's gradient at EP 2 x CP 2 already holds every token its EP group (the CP group)
  routed to it. They equal the reference's by test_v41_megatron_parity.py's per-tensor scheme
  (dsv41_helpers.grad_tolerances: against the float64 reference, bars from 1e-5 up to 4 x the fp32 reference's own
  error; at least FAST_GRAD_TOLERANCE = 1e-4 with the fast attention, whose sums run in another order: see
  dsv41_helpers).
- Every layout runs with both attention paths: "exact" (dense masks) and "fast" (each run of a rank's consecutive
  queries over its window keys, its halo of other ranks' tokens and its picked latents: V4's window attention).
- Each rank holds only its share: 64 / CP tokens. DSpark drafts (`draft_anchor_ids`) are refused under CP.
- Full recompute at CP 2 gives the loss and gradients of the run without it, bit for bit (the same ops on the same
  inputs: the keys a recomputed layer gathers again are the forward's).
- The CLI: `logprobs --cp 2` (sequences one at a time and `--pack`) equals the hf backend, and `modelzoo parity
  --cp 2` and `--tp 2 --sp --cp 2` pass.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from dsv41_helpers import (
    FAST_GRAD_TOLERANCE,
    LOGPROB_TOLERANCE,
    V41_TINY,
    grad_tolerances,
    gradients_too_far,
    megatron_grads_as_hf,
    random_rows,
    reference_by_form,
)

from modelzoo import build_provider, runtime
from modelzoo.layers import context_parallel
from modelzoo.layers.sequences import pack_sequences

LENGTHS = (3, 21, 34)
LAYOUTS = ((1, 1, 2, False), (1, 2, 2, False), (2, 1, 2, False), (2, 1, 2, True))  # (tp, ep, cp, sp), four ranks
FORMS = ("rows", "packed")


def _data() -> tuple[torch.Tensor, list[list[int]]]:
    rows = random_rows(2, 64, seed=0)
    sequences = [random_rows(1, length, seed=10 + number)[0].tolist() for number, length in enumerate(LENGTHS)]
    return rows, sequences


def _batches() -> dict[str, list[torch.Tensor]]:
    """Each form as the reference runs it: the rows together, each packed sequence alone."""
    rows, sequences = _data()
    return {"rows": [rows], "packed": [torch.tensor([sequence]) for sequence in sequences]}


def _reference(dtype: torch.dtype) -> dict:
    """Per form: the log-probs of each batch and the gradients of minus the mean log-prob over the form's tokens."""
    return reference_by_form(_batches(), dtype, lambda form, logprobs: sum(values.numel() for values in logprobs))


@pytest.fixture(scope="module")
def reference():
    return _reference(torch.float32)


@pytest.fixture(scope="module")
def float64_grads():
    return {form: result["grads"] for form, result in _reference(torch.float64).items()}


@pytest.fixture(scope="module")
def tolerances(reference, float64_grads):
    return {form: grad_tolerances(reference[form]["grads"], float64_grads[form]) for form in FORMS}


# --- the ranks ------------------------------------------------------------------------------------------------------
def _local_step(provider, model, input_ids, labels, loss_mask, packed_seq_params=None) -> dict:
    """This rank's share: the whole per-token loss (gathered), the gradients of this rank's share of the mean loss
    reduced as DDP reduces them (dense ones over the data-parallel group with context parallelism, experts' over the
    expert data-parallel group; under sequence parallelism the marked ones also over TP, as finalize_model_grads
    does) and divided by the data-parallel replicas (which all run the same batch), by checkpoint name
    (collective), and this rank's token count."""
    from megatron.core import parallel_state

    ids, local_labels, local_mask = (context_parallel.split_for_rank(tensor, packed_seq_params)
                                     for tensor in (input_ids, labels, loss_mask))
    model.zero_grad(set_to_none=True)
    loss = model(ids, None, None, labels=local_labels, packed_seq_params=packed_seq_params)
    ((loss * local_mask).sum() / loss_mask.sum()).backward()
    replicas = parallel_state.get_data_parallel_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
                            if getattr(param, "allreduce", True) else parallel_state.get_expert_data_parallel_group())
            param.grad /= replicas
            if getattr(param, "sequence_parallel", False):  # this TP rank's tokens' share, as finalize_model_grads
                dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    weights = [param.detach().clone() for param in model.parameters()]
    grads = megatron_grads_as_hf(provider, model)
    for param, weight in zip(model.parameters(), weights):
        param.data = weight
    return dict(loss=context_parallel.gather_from_ranks(loss.detach(), packed_seq_params), grads=grads,
                local_tokens=ids.shape[1])


def _rank(rank: int, attention: str) -> dict:
    rows, sequences = _data()
    results = {"attention": attention}
    for tp, ep, cp, sp in LAYOUTS:
        with runtime.parallel(tp=tp, ep=ep, cp=cp):
            provider = build_provider(V41_TINY, train_engram_tables=True, attention=attention,
                                      **({"sequence_parallel": True} if sp else {}))
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            model.eval()
            batch = pack_sequences(sequences, divisor=2 * cp)
            row_mask = torch.ones(rows.shape)
            row_mask[:, -1] = 0  # the last token has no target
            row_step = _local_step(provider, model, rows, rows.roll(-1, 1), row_mask)
            packed_step = _local_step(provider, model, batch.input_ids, *batch.labels(), batch.packed_seq_params)
            if (tp, ep, cp, sp) == LAYOUTS[0]:
                local = context_parallel.split_for_rank(rows)
                with pytest.raises(ValueError) as refused:
                    model(local, draft_anchor_ids=local)
                results["draft refusal"] = str(refused.value)
            results[(tp, ep, cp, sp)] = {
                "rows": dict(row_step, logprobs=[-row_step["loss"][:, :-1]], whole_tokens=rows.shape[1]),
                "packed": dict(packed_step, logprobs=[-values[None] for values in batch.split(packed_step["loss"], 1)],
                               whole_tokens=batch.input_ids.shape[1]),
            }
    with runtime.parallel(cp=2):  # the first layout again, with full recompute (runs of 3 layers)
        provider = build_provider(V41_TINY, train_engram_tables=True, attention=attention, recompute_granularity="full",
                                  recompute_method="uniform", recompute_num_layers=3)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        model.eval()
        batch = pack_sequences(sequences, divisor=4)
        row_mask = torch.ones(rows.shape)
        row_mask[:, -1] = 0
        results["recompute"] = {"rows": _local_step(provider, model, rows, rows.roll(-1, 1), row_mask),
                                "packed": _local_step(provider, model, batch.input_ids, *batch.labels(),
                                                      batch.packed_seq_params)}
    return results


@pytest.fixture(scope="module", params=["exact", "fast"])
def ranks(request):
    return runtime.spawn(_rank, 4, request.param)


def _each(ranks):
    for rank, results in enumerate(ranks):
        for layout, result in results.items():
            if layout not in LAYOUTS:
                continue
            tp, ep, cp, sp = layout
            for form in FORMS:
                yield f"tp{tp}{' + sp' if sp else ''} ep{ep} cp{cp} rank{rank} {form}", form, cp, result[form]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def test_each_rank_holds_its_share(ranks):
    for where, _, cp, result in _each(ranks):
        assert result["local_tokens"] == result["whole_tokens"] // cp, where


def test_the_gathered_logprobs_equal_the_reference(ranks, reference):
    for where, form, _, result in _each(ranks):
        expected = reference[form]["logprobs"]
        for number, (ours, theirs) in enumerate(zip(result["logprobs"], expected, strict=True)):
            assert _max_diff(ours, theirs) <= LOGPROB_TOLERANCE, (where, number)


def test_gradients_summed_over_the_group_equal_the_reference(ranks, float64_grads, tolerances):
    fast = ranks[0]["attention"] == "fast"
    for where, form, _, result in _each(ranks):
        grads = result["grads"]
        bars = {name: max(bar, FAST_GRAD_TOLERANCE) if fast else bar for name, bar in tolerances[form].items()}
        assert not gradients_too_far(grads, float64_grads[form], bars), where
        frozen = [name for name in grads if name not in float64_grads[form]]
        assert frozen and all(grads[name].abs().max() == 0 for name in frozen), where


def test_drafts_are_refused_under_context_parallelism(ranks):
    for results in ranks:
        assert results["draft refusal"] == ("deepseek_v41: draft_anchor_ids under context parallelism: the DSpark "
                                            "drafts run without it (pass the whole rows at context parallel size 1)")


def test_full_recompute_under_context_parallelism_gives_the_same_loss_and_gradients_bit_for_bit(ranks):
    for rank, results in enumerate(ranks):
        for form in FORMS:
            recomputed, plain = results["recompute"][form], results[LAYOUTS[0]][form]
            assert torch.equal(recomputed["loss"], plain["loss"]), (rank, form)
            assert recomputed["grads"].keys() == plain["grads"].keys()
            assert [name for name, grad in recomputed["grads"].items()
                    if not torch.equal(grad, plain["grads"][name])] == [], (rank, form)


# --- the CLI ---------------------------------------------------------------------------------------------------------
def test_cli_logprobs_with_cp_equal_the_hf_backend(tmp_path):
    from modelzoo.conversion.cli import main

    sequences = _data()[1]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(sequences))
    runs = {"rows": ["--cp", "2"], "packed": ["--cp", "2", "--pack"], "hf": ["--backend", "hf"]}
    for kind, options in runs.items():
        assert main(["logprobs", str(V41_TINY), "--tokens", str(tokens), "--out", str(tmp_path / f"{kind}.json"),
                     *options]) == 0
    outputs = {kind: json.loads((tmp_path / f"{kind}.json").read_text())["logprobs"] for kind in runs}
    for kind in ("rows", "packed"):
        assert [len(values) for values in outputs[kind]] == [len(sequence) - 1 for sequence in sequences]
        for ours, theirs in zip(outputs[kind], outputs["hf"]):
            assert max(abs(a - b) for a, b in zip(ours, theirs)) <= LOGPROB_TOLERANCE, kind


@pytest.mark.parametrize("layout", [[], ["--tp", "2", "--sp"]], ids=["cp2", "tp2-sp-cp2"])
def test_cli_parity_with_cp_passes(capsys, layout):
    from modelzoo.conversion.cli import main

    assert main(["parity", str(V41_TINY), "--cp", "2", *layout, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["architecture"] == "deepseek_v41" and report["passed"]
    assert report["max_abs_diff_logprobs"] <= LOGPROB_TOLERANCE
    assert report["max_abs_diff_logprobs_packed"] <= LOGPROB_TOLERANCE
