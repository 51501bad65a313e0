"""Pipeline parallelism (PP 2, two gloo ranks) for the Megatron DeepSeek-V4.1 through Megatron's schedules
(`get_forward_backward_func`, `provider.pipeline_seq_length`), against our reference (hf_model.py), fp32 on
deepseek-v41-tiny, Engram tables trainable on both sides (as in test_v41_megatron_parity.py).

Two splits of the 10 layers, each crossing the CSA2 state between stages (model/pipeline.py):
- even (Megatron's default, 5 + 5): layer 5, a ratio-2 reuse layer, reads the latents and top-k that layer 4 (KV and
  index source) published on stage 0;
- 3 + 7 (`num_layers_in_first_pipeline_stage=3`): layer 3, a reuse layer, reads layer 2's state, and the Engram
  layer 4 on stage 1 hashes the token ids stage 0 sent.
Each split also runs with activation recompute (full, uniform runs of 2 layers, on the even split; selective
core_attn + layernorm + moe on the 3 + 7 split): the state a stage receives enters the checkpointed runs as their
inputs. Batches: 2 micro-batches of 2 rows x 64 tokens (past the sliding window 8, the top-k 8 and the candidate budget),
and one micro-batch of the sequences of lengths 3, 21 and 34 packed into a row (each run alone by the reference).

- The last stage's per-token loss from the forward-only schedule is minus the reference's log-probs
  (LOGPROB_TOLERANCE = 1e-5: the same fp32 math in another order).
- The gradients of the schedule's loss (Megatron's DDP and finalize_model_grads), exported by checkpoint name from
  both stages, equal the reference's by test_v41_megatron_parity.py's per-tensor scheme (dsv41_helpers: against the
  float64 reference, bars from 1e-5 up to 4 x the fp32 reference's own error); frozen tensors get none.
- A torch_dist checkpoint written at PP 2 loads at PP 1 and one written at PP 1 loads at PP 2: the weights exported
  after loading are bit-identical to the checkpoint's; every rank's export at PP 2 yields each tensor once.
- DSpark drafts are refused at PP 2, and PP 2 x CP 2 and PP 2 x TP 2 + SP by the provider, each in one sentence.
- The boundary tensor: under bf16 (no spawn) the fp32 `pre` and token ids above 256 come back exactly.
- The CLI's `parity --pp 2` passes (rows and packed).
"""

from __future__ import annotations

import json

import pytest
import torch
from dsv41_helpers import (
    BUFFERS,
    LOGPROB_TOLERANCE,
    V41_TINY,
    grad_tolerances,
    gradients_too_far,
    random_rows,
    reference_by_form,
)
from safetensors.torch import load_file

from modelzoo import build_provider, runtime
from modelzoo.conversion import megatron_ckpt
from modelzoo.layers.sequences import pack_sequences

MICRO_BATCHES, ROWS, SEQ = 2, 2, 64
LENGTHS = (3, 21, 34)
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
SELECTIVE_RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "moe"])
SPLITS = {"even": {}, "3+7": dict(num_layers_in_first_pipeline_stage=3),
          "even, full recompute": FULL_RECOMPUTE,
          "3+7, selective recompute": dict(num_layers_in_first_pipeline_stage=3, **SELECTIVE_RECOMPUTE)}
FORMS = ("rows", "packed")


def _tokens() -> list[torch.Tensor]:
    """Each micro-batch's rows of SEQ + 1 tokens (inputs and their next tokens)."""
    return [random_rows(ROWS, SEQ + 1, seed=number) for number in range(MICRO_BATCHES)]


def _sequences() -> list[list[int]]:
    return [random_rows(1, length, seed=10 + number)[0].tolist() for number, length in enumerate(LENGTHS)]


def _micro_batches(form: str) -> list[dict]:
    if form == "rows":
        return [dict(input_ids=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(ROWS, SEQ))
                for tokens in _tokens()]
    batch = pack_sequences(_sequences())
    labels, loss_mask = batch.labels()
    return [dict(input_ids=batch.input_ids, labels=labels, loss_mask=loss_mask,
                 packed_seq_params=batch.packed_seq_params, batch=batch)]


def _reference(dtype: torch.dtype) -> dict:
    """Per form: the log-probs of each batch the reference runs and the gradients of the schedule's loss (the mean
    over micro-batches of each one's summed -log-probs)."""
    batches = {"rows": _tokens(), "packed": [torch.tensor([sequence]) for sequence in _sequences()]}
    return reference_by_form(batches, dtype, lambda form, _: len(_micro_batches(form)))


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
def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["input_ids"], None, None, labels=batch["labels"],
                   packed_seq_params=batch.get("packed_seq_params"))
    return output, lambda loss: ((loss * batch["loss_mask"]).sum(), {"per_token_loss": loss.detach()})


def _schedule(provider, ddp, form: str, forward_only: bool) -> list[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = _micro_batches(form)
    return get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[ddp], num_microbatches=len(batches),
        seq_length=provider.pipeline_seq_length(batches[0]["input_ids"].shape[1]),
        micro_batch_size=batches[0]["input_ids"].shape[0], forward_only=forward_only)


def _logprobs(form: str, per_token_losses: list[torch.Tensor]) -> list[torch.Tensor]:
    """Minus the last stage's per-token losses as the reference's log-probs."""
    if form == "rows":
        return [-loss for loss in per_token_losses]
    return [-values[None] for values in _micro_batches(form)[0]["batch"].split(per_token_losses[0], 1)]


def _trained(split_options: dict) -> dict:
    """Per form: the forward-only schedule's log-probs (last stage) and the gradients of one forward-backward."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    provider = build_provider(V41_TINY, train_engram_tables=True, **split_options)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func, model.config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    results = dict(layers=[(layer.layer_idx, layer.engram is not None) for layer in model.decoder.layers])
    weights = [param.detach().clone() for param in model.parameters()]
    for form in FORMS:
        with torch.no_grad():
            losses = [output["per_token_loss"] for output in _schedule(provider, ddp, form, forward_only=True)]
        ddp.zero_grad_buffer()
        _schedule(provider, ddp, form, forward_only=False)
        with torch.no_grad():
            for param in model.parameters():
                grad = getattr(param, "main_grad", None)
                param.copy_(grad if grad is not None else torch.zeros_like(param))
            grads = {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)
                     if not name.endswith(BUFFERS)}
            for param, weight in zip(model.parameters(), weights):
                param.copy_(weight)
        results[form] = dict(logprobs=_logprobs(form, losses) if losses else [], grads=grads)
    return results


def _exported(provider, model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)}


def _checkpoint_round_trips(scratch) -> dict:
    """Written at PP 2 and read at PP 1, written at PP 1 and read at PP 2: the weights exported after each load."""
    results = {}
    for written_at, read_at in ((2, 1), (1, 2)):
        checkpoint = scratch / f"pp{written_at}"
        with runtime.parallel(pp=written_at):
            provider = build_provider(V41_TINY)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            megatron_ckpt.save(model, checkpoint, metadata={"architecture": provider.name}, progress=False)
        with runtime.parallel(pp=read_at):
            model = provider.provide()
            megatron_ckpt.load(model, checkpoint)
            results[written_at, read_at] = _exported(provider, model)
    return results


def _two_ranks(rank: int, scratch) -> dict:
    results = {}
    for split, options in SPLITS.items():
        with runtime.parallel(pp=2):
            results[split] = _trained(options)
    with runtime.parallel(pp=2):
        provider = build_provider(V41_TINY)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        results["export"] = list(_exported(provider, model))
        if model.pre_process:
            rows = _tokens()[0][:, :-1]
            with pytest.raises(ValueError) as refused:
                model(rows, draft_anchor_ids=rows)
            results["draft refusal"] = str(refused.value)
    results["checkpoints"] = _checkpoint_round_trips(scratch)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return runtime.spawn(_two_ranks, 2, tmp_path_factory.mktemp("v41-pp-checkpoints"))


def _each(two_ranks):
    for rank, results in enumerate(two_ranks):
        for split in SPLITS:
            for form in FORMS:
                yield f"{split} rank{rank} {form}", rank, form, results[split][form]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def test_the_splits_cut_between_a_kv_source_and_its_reuse_layer_with_an_engram_layer_on_stage_1(two_ranks):
    stage0, stage1 = (two_ranks[rank]["even"]["layers"] for rank in (0, 1))
    assert [layer for layer, _ in stage0] == [0, 1, 2, 3, 4] and [layer for layer, _ in stage1] == [5, 6, 7, 8, 9]
    stage0, stage1 = (two_ranks[rank]["3+7"]["layers"] for rank in (0, 1))
    assert [layer for layer, _ in stage0] == [0, 1, 2] and (4, True) in stage1


def test_the_last_stage_gives_the_reference_logprobs(two_ranks, reference):
    for where, rank, form, result in _each(two_ranks):
        if rank == 0:
            assert result["logprobs"] == [], where
            continue
        expected = reference[form]["logprobs"]
        assert len(result["logprobs"]) == len(expected), where
        for number, (ours, theirs) in enumerate(zip(result["logprobs"], expected)):
            assert _max_diff(ours, theirs) <= LOGPROB_TOLERANCE, (where, number)


def test_gradients_through_the_schedule_equal_the_reference(two_ranks, float64_grads, tolerances):
    for where, _, form, result in _each(two_ranks):
        grads = result["grads"]
        assert set(float64_grads[form]) <= set(grads), where
        assert not gradients_too_far(grads, float64_grads[form], tolerances[form]), where
        frozen = [name for name in grads if name not in float64_grads[form]]
        assert frozen and all(grads[name].abs().max() == 0 for name in frozen), where


def test_torch_dist_checkpoints_move_between_pp_1_and_pp_2_bit_exactly(two_ranks):
    checkpoint = load_file(V41_TINY / "model.safetensors")
    for result in two_ranks:
        names = result["export"]
        assert len(names) == len(set(names)) and set(names) == set(checkpoint)
        for (written_at, read_at), exported in result["checkpoints"].items():
            assert exported.keys() == checkpoint.keys(), (written_at, read_at)
            for name, tensor in checkpoint.items():
                assert torch.equal(exported[name], tensor), (written_at, read_at, name)


def test_drafts_are_refused_at_pp_2(two_ranks):
    assert two_ranks[0]["draft refusal"] == (
        "deepseek_v41: draft_anchor_ids at pipeline parallel size > 1: the DSpark drafts read the word embedding "
        "and the target layers of every stage (run them at one stage)")


def test_pp_with_cp_is_refused_saying_why():
    provider = build_provider(V41_TINY)
    with pytest.raises(ValueError, match=r"^deepseek_v41: pipeline parallel size 2 with context parallel size 2 is "
                                         r"not implemented"):
        provider.check_parallel_layout(1, cp=2, pp=2)


def test_pp_with_sequence_parallelism_is_refused_saying_why():
    provider = build_provider(V41_TINY, sequence_parallel=True)
    with pytest.raises(ValueError) as refused:
        provider.check_parallel_layout(2, pp=2)
    assert str(refused.value) == ("deepseek_v41: sequence parallelism with pipeline parallel size 2 is not "
                                  "implemented (use tensor parallelism without sequence_parallel there)")
    build_provider(V41_TINY).check_parallel_layout(2, pp=2)  # without sequence parallelism: accepted


def test_the_boundary_tensor_carries_pre_and_ids_exactly_in_bf16():
    from modelzoo.deepseek_v41.config import DeepseekV41Args
    from modelzoo.deepseek_v41.hf_model import CompressedState
    from modelzoo.deepseek_v41.model.pipeline import Boundary, boundary_length, pack, received_ids, unpack

    args = DeepseekV41Args.from_hf(build_provider(V41_TINY).hf_config)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200_000, (2, 16), generator=generator)
    streams = torch.randn(2, 16, args.hc_mult, args.hidden_size, generator=generator).bfloat16()
    pre = torch.rand(2, 16, args.hc_mult, generator=generator) * 3  # fp32 values bf16 cannot hold
    boundary = Boundary(0, False, False)
    sent = pack(args, boundary, streams, pre, CompressedState(), [16, 16], ids, torch.bfloat16)
    assert sent.shape == (boundary_length(args, 16, torch.bfloat16), 2, args.hidden_size)
    assert torch.equal(received_ids(sent), ids)
    received_streams, received_pre, _ = unpack(args, boundary, sent, [16, 16], torch.bfloat16, torch.bfloat16)
    assert torch.equal(received_streams, streams) and torch.equal(received_pre, pre)
    assert not torch.equal(pre.bfloat16().float(), pre)


def test_cli_parity_at_pp_2(capsys):
    from modelzoo.conversion.cli import main

    assert main(["parity", str(V41_TINY), "--pp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["pp"] == 2 and report["passed"]
    assert report["max_abs_diff_logprobs"] <= LOGPROB_TOLERANCE
    assert report["max_abs_diff_logprobs_packed"] <= LOGPROB_TOLERANCE
