"""Context parallelism (`runtime.parallel(cp=N)`) for Llama and LoopCoder against the Hugging Face references.

Oracle: transformers' LlamaForCausalLM and our LoopCoder reference (modelzoo/loopcoder/hf_model.py), fp32, full-sequence
forward, each packed sequence run alone. Each CP rank gets its share of the batch in Megatron's load-balanced layout
(2 x CP chunks per sequence, rank r holding chunks r and 2 x CP - 1 - r), as a trainer hands it over:

- the trainer's call: `split_for_rank` of input ids, labels and loss mask (checked against Megatron's own
  `get_batch_on_this_cp_rank` for rows), `model(local_ids, labels=local_labels, packed_seq_params=whole row's)`;
  each rank's per-token loss covers its own tokens only, and gathered back it is minus the HF log-probs
  (LOGPROB_TOLERANCE = 1e-5: fp32, the same math in another order moves them by ~1e-6; a token that reads a
  wrong key moves by > 1e-2);
- gradients: the local loss's backward on each rank, summed over the CP group, equal the HF model's gradients of
  the whole loss (GRADIENT_TOLERANCE = 1e-4 relative to the largest entry of each tensor, max-norm); and through
  Megatron's schedule and DDP (Megatron-Bridge's token-sum loss, `calculate_per_token_loss`), which reduce over the
  data-parallel group with context parallelism, DDP's grad buffer holds the HF gradient of the mean over all loss
  tokens;
- `provider.token_logprobs` of the whole batch on every rank (rows of a length that is no multiple of 2 x CP
  included) equals the HF log-probs.
Batches: a packed row of sequences of lengths 1, 17, 40, 5 and 70 (1: no log-prob at all; 17, 5, 70: no multiple
of 2 x CP; 70 is longer than LoopCoder's window of 8, whose halo then lies in other ranks' chunks), each slot
padded to a multiple of 2 x CP, and plain rows [2, 32]. Layouts: CP 2 (also with the fast attention), CP 4 and
TP 2 x CP 2; one spawn per world size; at CP 2 also with full recompute (gradients). Measured: log-probs within 9.6e-7, gradients within 1.4e-6.
The CLI's `--cp` (`logprobs` with and without `--pack` against the HF backend, `parity` at TP 2 x CP 2) and its
refusals are checked at the end.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from conftest import TINY
from megatron.core.packed_seq_params import PackedSeqParams

from modelzoo import build_provider, runtime
from modelzoo.layers import context_parallel
from modelzoo.parity import load_hf_model, logprobs_from_logits
from modelzoo.runtime import ParallelLayout
from modelzoo.layers.sequences import (BatchLayoutError, ContextParallel, context_parallel_indices, pack_sequences,
                                token_layout)

LOGPROB_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4
LENGTHS = (1, 17, 40, 5, 70)
ROWS = (2, 32)
MODELS = {"llama": "llama-tiny", "loopcoder": "loopcoder-tiny"}
WORLDS = {2: [(1, 2)], 4: [(1, 4), (2, 2)]}  # world size -> (tp, cp) layouts run in one spawn


def _data():
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 250, (length,), generator=generator).tolist() for length in LENGTHS]
    return sequences, torch.randint(0, 250, ROWS, generator=generator)


def _next_token_labels(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows: labels[t] = input_ids[t + 1]; the last position has no target (loss mask 0)."""
    labels = input_ids.roll(-1, dims=1)
    loss_mask = torch.ones(input_ids.shape)
    loss_mask[:, -1] = 0
    return labels, loss_mask


# --- the oracle ---------------------------------------------------------------------------------------------
def _hf_grads(model) -> dict[str, torch.Tensor]:
    grads = {name: (param.grad if param.grad is not None else torch.zeros_like(param)).clone()
             for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _hf_reference(folder):
    """Per-sequence and row log-probs of the HF model, and the gradients of minus their sum (packed, rows)."""
    sequences, rows = _data()
    model = load_hf_model(folder)
    for name, param in model.named_parameters():  # the loop gates are frozen in modelzoo by default
        param.requires_grad_("gate_projections" not in name)
    alone = [logprobs_from_logits(model(torch.tensor([s]), use_cache=False).logits, torch.tensor([s]))[0]
             for s in sequences]
    (-sum(logprobs.sum() for logprobs in alone)).backward()
    packed_grads = _hf_grads(model)
    row_logprobs = logprobs_from_logits(model(rows, use_cache=False).logits, rows)
    (-row_logprobs.sum()).backward()
    row_grads = _hf_grads(model)
    with torch.no_grad():
        cut = rows[:, :ROWS[1] - 3]  # no multiple of 2 x CP
        cut_logprobs = logprobs_from_logits(model(cut, use_cache=False).logits, cut)
    return dict(alone=[t.detach() for t in alone], rows=row_logprobs.detach(), cut=cut_logprobs,
                packed_grads=packed_grads, row_grads=row_grads)


# --- the ranks ----------------------------------------------------------------------------------------------
def _summed_grads_by_name(provider, model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient summed over the CP group, exported by HF name (full tensors; collective)."""
    from megatron.core import parallel_state

    saved = {}
    with torch.no_grad():
        for param in model.parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
            saved[param] = param.detach().clone()
            param.copy_(grad)
        grads = {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)}
        for param, value in saved.items():
            param.copy_(value)
            param.grad = None
    return grads


def _trainer_step(provider, model, input_ids, labels, loss_mask, packed_seq_params=None):
    """The trainer's call on this rank's share; returns (whole per-token loss, summed gradients, local shape)."""
    local = [context_parallel.split_for_rank(t, packed_seq_params) for t in (input_ids, labels, loss_mask)]
    loss = model(local[0], None, None, labels=local[1], packed_seq_params=packed_seq_params)
    (loss * local[2]).sum().backward()
    whole = context_parallel.gather_from_ranks(loss.detach(), packed_seq_params)
    return whole, _summed_grads_by_name(provider, model), tuple(loss.shape)


def _schedule_grads(provider, input_ids, labels, loss_mask, packed_seq_params) -> dict[str, torch.Tensor]:
    """Megatron-Bridge's step under context parallelism: this rank's share through Megatron's schedule and DDP,
    the token-sum loss with its count (`calculate_per_token_loss`); DDP's grad buffer by HF name."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    model.config.calculate_per_token_loss = True  # read by DDP's constructor
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func, model.config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    local = [context_parallel.split_for_rank(t, packed_seq_params) for t in (input_ids, labels, loss_mask)]

    def forward_step(data_iterator, model):
        ids, labels, mask = next(data_iterator)
        loss = model(ids, None, None, labels=labels, packed_seq_params=packed_seq_params)
        return loss, lambda output: ((output * mask).sum(), mask.sum().int(), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([local]), model=ddp,
                                num_microbatches=1, seq_length=local[0].shape[1], micro_batch_size=1)
    with torch.no_grad():
        for param in model.parameters():
            grad = getattr(param, "main_grad", None)
            param.copy_(grad if grad is not None else torch.zeros_like(param))
    return {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)}


def _megatron_split_agrees(input_ids: torch.Tensor) -> bool:
    """Megatron's own split of rows for this CP rank equals ours (tokens, labels, loss mask, position ids)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    labels, loss_mask = _next_token_labels(input_ids)
    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    batch = dict(tokens=input_ids, labels=labels, loss_mask=loss_mask, position_ids=position_ids, cu_seqlens=None)
    theirs = get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False,
                                       cp_group=parallel_state.get_context_parallel_group())
    return all(torch.equal(theirs[key], context_parallel.split_for_rank(batch[key]))
               for key in ("tokens", "labels", "loss_mask", "position_ids"))


def _rank(rank: int, layouts):
    sequences, rows = _data()
    results = {}
    for tp, cp in layouts:
        with runtime.parallel(tp=tp, cp=cp):
            for name, folder in MODELS.items():
                provider = build_provider(TINY / folder)
                model = provider.provide()
                provider.load_hf_weights(model, progress=False)
                model.eval()
                batch = pack_sequences(sequences, divisor=2 * cp)
                labels, loss_mask = batch.labels()
                packed_loss, packed_grads, local_shape = _trainer_step(
                    provider, model, batch.input_ids, labels, loss_mask, batch.packed_seq_params)
                row_loss, row_grads, _ = _trainer_step(provider, model, rows, *_next_token_labels(rows))
                with torch.no_grad():
                    logprobs = provider.token_logprobs(model, batch.input_ids,
                                                       packed_seq_params=batch.packed_seq_params)
                    cut_logprobs = provider.token_logprobs(model, rows[:, :ROWS[1] - 3])
                schedule_grads = _schedule_grads(provider, batch.input_ids, labels, loss_mask,
                                                 batch.packed_seq_params)
                result = dict(packed_loss=[-t for t in batch.split(packed_loss, shift=1)],
                              row_loss=-row_loss[:, :-1], packed_grads=packed_grads, row_grads=row_grads,
                              schedule_grads=schedule_grads, loss_tokens=int(loss_mask.sum()),
                              logprobs=logprobs, cut=cut_logprobs, local_shape=local_shape,
                              row_count=batch.input_ids.shape[1], megatron_split=_megatron_split_agrees(rows))
                if (tp, cp) == (1, 2):
                    # full recompute: the gathers of keys and values run again in the backward
                    recomputing = build_provider(TINY / folder, recompute_granularity="full",
                                                 recompute_method="uniform", recompute_num_layers=1)
                    recomputing_model = recomputing.provide()
                    recomputing.load_hf_weights(recomputing_model, progress=False)
                    result["recompute_grads"] = _trainer_step(recomputing, recomputing_model, batch.input_ids, labels,
                                                              loss_mask, batch.packed_seq_params)[1]
                    # the fast attention (SDPA with the layout's mask on the CPU)
                    fast = build_provider(TINY / folder, attention="fast")
                    fast_model = fast.provide()
                    fast.load_hf_weights(fast_model, progress=False)
                    with torch.no_grad():
                        result["fast"] = fast.token_logprobs(fast_model.eval(), batch.input_ids,
                                                             packed_seq_params=batch.packed_seq_params)
                results[(name, tp, cp)] = result
    return results


@pytest.fixture(scope="module")
def reference():
    return {name: _hf_reference(TINY / folder) for name, folder in MODELS.items()}


@pytest.fixture(scope="module", params=sorted(WORLDS))
def ranks(request):
    return runtime.spawn(_rank, request.param, WORLDS[request.param])


def _max_diff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _each(ranks):
    for rank, results in enumerate(ranks):
        for (name, tp, cp), result in results.items():
            yield f"{name} tp{tp} cp{cp} rank{rank}", name, cp, result


def test_each_rank_holds_its_share_in_megatrons_layout(ranks):
    for where, _, cp, result in _each(ranks):
        assert result["local_shape"] == (1, result["row_count"] // cp), where
        assert result["megatron_split"], where


def test_the_gathered_loss_is_minus_the_hf_logprobs(ranks, reference):
    for where, name, _, result in _each(ranks):
        expected = reference[name]
        for number, (ours, theirs) in enumerate(zip(result["packed_loss"], expected["alone"])):
            assert _max_diff(ours, theirs) <= LOGPROB_TOLERANCE, (where, "packed", number)
        assert _max_diff(result["row_loss"], expected["rows"]) <= LOGPROB_TOLERANCE, (where, "rows")


def test_token_logprobs_of_the_whole_batch_equal_the_hf_logprobs(ranks, reference):
    for where, name, _, result in _each(ranks):
        expected = reference[name]
        for key in ("logprobs", "fast"):
            for number, (ours, theirs) in enumerate(zip(result.get(key, []), expected["alone"])):
                assert _max_diff(ours, theirs) <= LOGPROB_TOLERANCE, (where, key, number)
        assert _max_diff(result["cut"], expected["cut"]) <= LOGPROB_TOLERANCE, (where, "rows of 29 tokens")


def test_gradients_summed_over_the_group_equal_the_hf_gradients(ranks, reference):
    for where, name, _, result in _each(ranks):
        expected_grads = dict(reference[name])
        # through the schedule and DDP: the mean over every rank's loss tokens
        expected_grads["schedule_grads"] = {tensor_name: grad / result["loss_tokens"]
                                            for tensor_name, grad in reference[name]["packed_grads"].items()}
        expected_grads["recompute_grads"] = reference[name]["packed_grads"]
        for kind in [kind for kind in expected_grads if kind.endswith("grads") and kind in result]:
            ours, theirs = result[kind], expected_grads[kind]
            assert ours.keys() == theirs.keys(), where
            for tensor_name, expected in theirs.items():
                scale = expected.abs().max().item()
                if scale == 0:  # frozen (LoopCoder's gates): no gradient on either side
                    assert ours[tensor_name].abs().max().item() == 0, (where, kind, tensor_name)
                    continue
                error = (ours[tensor_name] - expected).abs().max().item() / scale
                assert error <= GRADIENT_TOLERANCE, (where, kind, tensor_name, error)


# --- the layout and its refusals, without processes ---------------------------------------------------------
def thd(cu_seqlens, cu_padded=None) -> PackedSeqParams:
    as_tensor = lambda values: None if values is None else torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=as_tensor(cu_seqlens), cu_seqlens_kv=as_tensor(cu_seqlens),
                           cu_seqlens_q_padded=as_tensor(cu_padded), cu_seqlens_kv_padded=as_tensor(cu_padded))


def test_packed_rows_are_cut_per_sequence_slot():
    # slots of 4, 8 and 8 tokens at CP 2: chunks of 1, 2 and 2; rank 0 takes chunks 0 and 3 of each, rank 1 1 and 2
    # (Transformer Engine's thd_get_partitioned_indices, written out)
    slots = [4, 8, 8]
    assert context_parallel_indices(slots, 2, 0).tolist() == [0, 3, 4, 5, 10, 11, 12, 13, 18, 19]
    assert context_parallel_indices(slots, 2, 1).tolist() == [1, 2, 6, 7, 8, 9, 14, 15, 16, 17]
    # rows: one slot; CP 4 cuts 16 tokens into 8 chunks of 2
    assert context_parallel_indices([16], 4, 1).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("window", [None, 3])
def test_a_ranks_view_is_its_rows_of_the_whole_visibility(window):
    # sequences of 3, 6 and 1 tokens in slots of 4, 8 and 4; every rank's queries over every rank's keys
    params = thd([0, 3, 9, 10], [0, 4, 12, 16])
    whole = token_layout(torch.zeros(1, 16, dtype=torch.long), packed_seq_params=params).visible(window)[0]
    every = torch.cat([context_parallel_indices([4, 8, 4], 2, rank) for rank in range(2)])
    for rank in range(2):
        mine = context_parallel_indices([4, 8, 4], 2, rank)
        layout = token_layout(torch.zeros(1, 8, dtype=torch.long), packed_seq_params=params,
                              context_parallel=ContextParallel(None, 2, rank))
        assert torch.equal(layout.positions[0], token_layout(torch.zeros(1, 16, dtype=torch.long),
                                                             packed_seq_params=params).positions[0, mine])
        assert torch.equal(layout.visible(window)[0], whole[mine][:, every])


def test_batches_that_cannot_be_split_are_refused():
    cp2 = ContextParallel(None, 2, 0)
    with pytest.raises(BatchLayoutError, match=r"context parallel size 2 cuts every sequence into 4 equal chunks, "
                                               r"but the row has 6 tokens: pad it to a multiple of 4"):
        token_layout(torch.zeros(1, 3, dtype=torch.long), context_parallel=cp2)
    with pytest.raises(BatchLayoutError, match=r"but packed sequence 1's slot has 6 tokens"):
        token_layout(torch.zeros(1, 5, dtype=torch.long), packed_seq_params=thd([0, 3, 9], [0, 4, 10]),
                     context_parallel=cp2)
    with pytest.raises(BatchLayoutError, match=r"cu_seqlens_q_padded ends at 8, but the packed row has 16 tokens \(this "
                                               r"rank's 8 tokens x context parallel size 2: input_ids must be this "
                                               r"rank's share"):
        token_layout(torch.zeros(1, 8, dtype=torch.long), packed_seq_params=thd([0, 3, 5], [0, 4, 8]),
                     context_parallel=cp2)
    mask = torch.zeros(1, 1, 1, 8, dtype=torch.bool)
    with pytest.raises(BatchLayoutError, match="attention_mask with context parallel size 2"):
        token_layout(torch.zeros(1, 4, dtype=torch.long), attention_mask=mask, context_parallel=cp2)


def test_models_without_context_parallelism_refuse_it():
    from modelzoo.llama.provider import LlamaProvider

    class WithoutContextParallelism(LlamaProvider):
        supports_context_parallel = False

    provider = WithoutContextParallelism(build_provider(TINY / "llama-tiny").hf_config)
    with pytest.raises(ValueError, match="^context parallel size 2: context parallelism is not implemented for this "
                                         "llama model$"):
        provider.check_parallel_layout(1, 1, 2)
    build_provider(TINY / "llama-tiny").check_parallel_layout(2, 1, 4)
    with pytest.raises(ValueError, match="not divisible by tp\\*pp\\*cp = 4"):
        ParallelLayout(tp=2, cp=2).check(6)


# --- the CLI: `--cp N` runs tp x ep x cp ranks; the outputs are those of one rank -----------------------------
CLI_SEQUENCES = [[1, 2, 3, 4, 5, 6, 7], [9, 8], list(range(10, 50)), [200, 3, 17, 99, 5]]


def test_cli_logprobs_with_cp_equal_the_hf_backend(tmp_path):
    from modelzoo.conversion.cli import main

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(CLI_SEQUENCES))
    folder = str(TINY / "loopcoder-tiny")
    runs = {"rows": ["--cp", "2"], "packed": ["--cp", "2", "--pack"], "hf": ["--backend", "hf"]}
    for kind, options in runs.items():
        assert main(["logprobs", folder, "--tokens", str(tokens), "--out", str(tmp_path / f"{kind}.json"),
                     *options]) == 0
    outputs = {kind: json.loads((tmp_path / f"{kind}.json").read_text())["logprobs"] for kind in runs}
    for kind in ("rows", "packed"):
        assert [len(sequence) for sequence in outputs[kind]] == [len(sequence) - 1 for sequence in CLI_SEQUENCES]
        for ours, theirs in zip(outputs[kind], outputs["hf"]):
            assert max(abs(a - b) for a, b in zip(ours, theirs)) <= LOGPROB_TOLERANCE, kind


def test_cli_parity_at_tp2_cp2(capsys):
    from modelzoo.conversion.cli import main

    assert main(["parity", str(TINY / "llama-tiny"), "--tp", "2", "--cp", "2", "--seq-len", "40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["tp"], report["cp"], report["passed"]) == (2, 2, True)
    assert max(report["max_abs_diff_logprobs"], report["max_abs_diff_logprobs_packed"]) <= LOGPROB_TOLERANCE


def test_cli_refuses_cp_in_one_line(capsys):
    from modelzoo.conversion.cli import main

    assert main(["parity", str(TINY / "deepseek-v4-tiny"), "--cp", "0"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == "modelzoo: error: --cp 0: it must be at least 1"
