"""Pipeline parallelism (PP 2 on two gloo ranks; PP 2 x CP 2 and PP 2 x TP 2 + SP on four) for the Megatron
DeepSeek-V4.1 through Megatron's schedules (`get_forward_backward_func`, `provider.pipeline_seq_length`), against
our reference (hf_model.py), fp32 on deepseek-v41-tiny, Engram tables trainable on both sides (as in
test_v41_megatron_parity.py).

Two splits of the 10 layers, each crossing the CSA2 state between stages (model/pipeline.py):
- even (Megatron's default, 5 + 5): layer 5, a ratio-2 reuse layer, reads the latents and top-k that layer 4 (KV and
  index source) published on stage 0;
- 3 + 7 (`num_layers_in_first_pipeline_stage=3`): layer 3, a reuse layer, reads layer 2's state, and the Engram
  layer 4 on stage 1 hashes the token ids stage 0 sent.
Each split also runs with activation recompute (full, uniform runs of 2 layers, on the even split; selective
core_attn + layernorm + moe on the 3 + 7 split): the state a stage receives enters the checkpointed runs as their
inputs. The even split runs once more with `variable_seq_lengths=True` and the schedule's `seq_length` the rows' own,
as SkyRL's worker sets them (the stages exchange each tensor's shape before it). Batches: 2 micro-batches of 2 rows x 64 tokens (past the sliding window 8, the top-k 8 and the candidate budget),
one micro-batch of the sequences of lengths 3, 21 and 34 packed into a row, and one of 2 rows x 64 tokens of which
the second is right-padded after 45 (a [2, 1, 1, 64] padding mask); the reference runs each packed or padded
sequence alone. On four ranks CP 2 and TP 2 + SP run through the same schedule at PP 1 and at PP 2 (even, even with full recompute,
3 + 7 with selective recompute): under CP each rank's forward step takes its share of the micro-batch in Megatron's
layout (slots padded to 4; no padded batch: CP refuses an attention_mask) and the stages exchange each sequence's
share with the whole sequence's latents; under SP each TP rank sends its slice of each row's streams and the state
of the whole rows.

- The last stage's per-token loss from the forward-only schedule is minus the reference's log-probs
  (LOGPROB_TOLERANCE = 1e-5: the same fp32 math in another order).
- The gradients of the schedule's loss (Megatron's DDP and finalize_model_grads), exported by checkpoint name from
  both stages, equal the reference's by test_v41_megatron_parity.py's per-tensor scheme (dsv41_helpers: against the
  float64 reference, bars from 1e-5 up to 4 x the fp32 reference's own error); frozen tensors get none. At TP 2
  only the packed batch: on the plain and padded rows the order of TP's reductions puts a few tensors past their
  bar (rows: layer 3's attn_sink at 1.67 x, 3.5e-5 against 2.1e-5; padded: layer 2's hc_ffn_base at 1.33 x) at PP 1
  too, with or without SP, in the same digits; those layouts' gradients are checked against PP 1 of the same layout
  instead (below), and test_v41_sp_recompute.py checks TP 2 + SP at PP 1 against the reference on its batches.
- The gradients at PP 2 equal those at PP 1 of the same four-rank layout: bit for bit under TP 2 + SP, within 1e-6
  (relative to each tensor's largest entry) under CP 2, where DDP adds the ranks' parts in another order.
- A torch_dist checkpoint written at PP 2 loads at PP 1 and one written at PP 1 loads at PP 2: the weights exported
  after loading are bit-identical to the checkpoint's; every rank's export at PP 2 yields each tensor once.
- DSpark drafts are refused at PP 2 in one sentence.
- The boundary tensor: under bf16 (no spawn) the fp32 `pre` and token ids above 256 come back exactly; under
  sequence parallelism a TP rank's slice of a row shorter than the padded length carries only its real tokens.
- The CLI's `parity` passes at `--pp 2`, `--pp 2 --cp 2`, `--pp 2 --tp 2 --sp` and, on eight ranks,
  `--pp 2 --tp 2 --sp --cp 2` (rows and packed); with `--attention fast` at `--pp 2` and `--pp 2 --cp 2`, whose
  stages send the picks as ids.
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
from modelzoo.layers import context_parallel
from modelzoo.layers.sequences import pack_sequences

MICRO_BATCHES, ROWS, SEQ = 2, 2, 64
LENGTHS = (3, 21, 34)
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
SELECTIVE_RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "moe"])
SPLITS = {"even": {}, "3+7": dict(num_layers_in_first_pipeline_stage=3),
          "even, full recompute": FULL_RECOMPUTE,
          "3+7, selective recompute": dict(num_layers_in_first_pipeline_stage=3, **SELECTIVE_RECOMPUTE),
          # SkyRL's setting: the stages exchange each tensor's shape first; its schedule's seq_length is the rows'
          "even, variable_seq_lengths": dict(variable_seq_lengths=True)}
# four ranks: each layout at PP 1 (`runtime.parallel` sizes, provider options), then at PP 2 with three splits
ONE_STAGE = {"cp2": (dict(cp=2), {}), "tp2 + sp": (dict(tp=2), dict(sequence_parallel=True))}
FOUR_RANK_SPLITS = {"": {}, ", full recompute": FULL_RECOMPUTE,
                    ", 3+7, selective recompute": SPLITS["3+7, selective recompute"]}
FOUR_RANK_LAYOUTS = {f"pp2 x {base}{split}": base for base in ONE_STAGE for split in FOUR_RANK_SPLITS}
# gradients at PP 2 against PP 1 of the same layout (relative to each tensor's largest entry): with sequence
# parallelism bit-identical (each rank runs the same ops; the boundary tensor is exact); with context parallelism
# DDP sums the CP ranks' gradients in another order: fp32 rounding of a few additions, measured 1.2e-7
STAGES_TOLERANCE = {"cp2": 1e-6, "tp2 + sp": 0.0}
SLOT_DIVISOR = 4  # packed slots: a multiple of 2 x CP (Megatron's CP layout) and of TP (sequence parallelism)
PADDED_LENGTHS = (64, 45)  # the real tokens of the padded micro-batch's two rows (a [2, 1, 1, 64] padding mask)
FORMS = ("rows", "packed", "padded")
CP_FORMS = ("rows", "packed")  # under CP an attention_mask is refused: padded batches go packed


def _tokens() -> list[torch.Tensor]:
    """Each micro-batch's rows of SEQ + 1 tokens (inputs and their next tokens)."""
    return [random_rows(ROWS, SEQ + 1, seed=number) for number in range(MICRO_BATCHES)]


def _sequences() -> list[list[int]]:
    return [random_rows(1, length, seed=10 + number)[0].tolist() for number, length in enumerate(LENGTHS)]


def _padded_rows() -> torch.Tensor:
    return random_rows(len(PADDED_LENGTHS), SEQ + 1, seed=20)


def _micro_batches(form: str, divisor: int = 1) -> list[dict]:
    if form == "rows":
        return [dict(input_ids=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(ROWS, SEQ))
                for tokens in _tokens()]
    if form == "padded":
        tokens = _padded_rows()
        padding = torch.zeros(len(PADDED_LENGTHS), 1, 1, SEQ, dtype=torch.bool)  # GPTModel's mask: True = padding
        loss_mask = torch.zeros(len(PADDED_LENGTHS), SEQ)
        for row, length in enumerate(PADDED_LENGTHS):
            padding[row, ..., length:] = True
            loss_mask[row, :length - 1] = 1  # the row's last real token has no real next token
        return [dict(input_ids=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=loss_mask, attention_mask=padding)]
    batch = pack_sequences(_sequences(), divisor=divisor)
    labels, loss_mask = batch.labels()
    return [dict(input_ids=batch.input_ids, labels=labels, loss_mask=loss_mask,
                 packed_seq_params=batch.packed_seq_params, batch=batch)]


def _reference(dtype: torch.dtype) -> dict:
    """Per form: the log-probs of each batch the reference runs and the gradients of the schedule's loss (the mean
    over micro-batches of each one's summed -log-probs)."""
    batches = {"rows": _tokens(), "packed": [torch.tensor([sequence]) for sequence in _sequences()],
               "padded": [row[None, :length] for row, length in zip(_padded_rows(), PADDED_LENGTHS)]}
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
    """This CP rank's share of the micro-batch (all of it without context parallelism); the last stage gathers
    the per-token loss over the CP group (the schedule multiplies each rank's loss by the CP size and DDP averages
    over the CP ranks: the sum of their losses remains)."""
    batch = next(data_iterator)
    packed_seq_params = batch.get("packed_seq_params")
    input_ids, labels, loss_mask = (context_parallel.split_for_rank(batch[key], packed_seq_params)
                                    for key in ("input_ids", "labels", "loss_mask"))
    output = model(input_ids, None, batch.get("attention_mask"), labels=labels, packed_seq_params=packed_seq_params)
    return output, lambda loss: ((loss * loss_mask).sum(), {
        "per_token_loss": context_parallel.gather_from_ranks(loss.detach(), packed_seq_params)})


def _schedule(provider, ddp, form: str, forward_only: bool, divisor: int) -> list[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = _micro_batches(form, divisor)
    seq_length = batches[0]["input_ids"].shape[1]
    return get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[ddp], num_microbatches=len(batches),
        seq_length=seq_length if ddp.config.variable_seq_lengths else provider.pipeline_seq_length(seq_length),
        micro_batch_size=batches[0]["input_ids"].shape[0], forward_only=forward_only)


def _logprobs(form: str, per_token_losses: list[torch.Tensor], divisor: int) -> list[torch.Tensor]:
    """Minus the last stage's per-token losses as the reference's log-probs."""
    if form == "rows":
        return [-loss for loss in per_token_losses]
    if form == "padded":
        return [-loss[None, :length - 1] for loss, length in zip(per_token_losses[0], PADDED_LENGTHS)]
    return [-values[None] for values in _micro_batches(form, divisor)[0]["batch"].split(per_token_losses[0], 1)]


def _trained(split_options: dict, divisor: int = 1, forms: tuple[str, ...] = FORMS) -> dict:
    """Per form: the forward-only schedule's log-probs (last stage) and the gradients of one forward-backward."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    provider = build_provider(V41_TINY, train_engram_tables=True, **split_options)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func, model.config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    results = dict(layers=[(layer.layer_idx, layer.engram is not None) for layer in model.decoder.layers],
                   last_stage=model.post_process)
    weights = [param.detach().clone() for param in model.parameters()]
    for form in forms:
        with torch.no_grad():
            losses = [output["per_token_loss"]
                      for output in _schedule(provider, ddp, form, forward_only=True, divisor=divisor)]
        ddp.zero_grad_buffer()
        _schedule(provider, ddp, form, forward_only=False, divisor=divisor)
        with torch.no_grad():
            for param in model.parameters():
                grad = getattr(param, "main_grad", None)
                param.copy_(grad if grad is not None else torch.zeros_like(param))
            grads = {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)
                     if not name.endswith(BUFFERS)}
            for param, weight in zip(model.parameters(), weights):
                param.copy_(weight)
        results[form] = dict(logprobs=_logprobs(form, losses, divisor) if losses else [], grads=grads)
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


def _four_ranks(rank: int) -> dict:
    results = {}
    for base, (sizes, options) in ONE_STAGE.items():
        forms = CP_FORMS if "cp" in sizes else FORMS
        with runtime.parallel(**sizes):
            results[base] = _trained(options, SLOT_DIVISOR, forms)
        for split, split_options in FOUR_RANK_SPLITS.items():
            with runtime.parallel(pp=2, **sizes):
                results[f"pp2 x {base}{split}"] = _trained(dict(options, **split_options), SLOT_DIVISOR, forms)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return runtime.spawn(_two_ranks, 2, tmp_path_factory.mktemp("v41-pp-checkpoints"))


@pytest.fixture(scope="module")
def four_ranks():
    return runtime.spawn(_four_ranks, 4)


def _each(two_ranks, four_ranks, four_rank_layouts=(*ONE_STAGE, *FOUR_RANK_LAYOUTS)):
    """(where, the rank's stage is the last, form, result) of every rank and layout."""
    for ranks, layouts in ((two_ranks, SPLITS), (four_ranks, four_rank_layouts)):
        for rank, results in enumerate(ranks):
            for layout in layouts:
                result = results[layout]
                for form in (form for form in FORMS if form in result):
                    yield f"{layout} rank{rank} {form}", result["last_stage"], form, result[form]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def test_the_splits_cut_between_a_kv_source_and_its_reuse_layer_with_an_engram_layer_on_stage_1(two_ranks):
    stage0, stage1 = (two_ranks[rank]["even"]["layers"] for rank in (0, 1))
    assert [layer for layer, _ in stage0] == [0, 1, 2, 3, 4] and [layer for layer, _ in stage1] == [5, 6, 7, 8, 9]
    stage0, stage1 = (two_ranks[rank]["3+7"]["layers"] for rank in (0, 1))
    assert [layer for layer, _ in stage0] == [0, 1, 2] and (4, True) in stage1


def test_the_last_stage_gives_the_reference_logprobs(two_ranks, four_ranks, reference):
    for where, last_stage, form, result in _each(two_ranks, four_ranks):
        if not last_stage:
            assert result["logprobs"] == [], where
            continue
        expected = reference[form]["logprobs"]
        assert len(result["logprobs"]) == len(expected), where
        for number, (ours, theirs) in enumerate(zip(result["logprobs"], expected)):
            assert _max_diff(ours, theirs) <= LOGPROB_TOLERANCE, (where, number)


def test_gradients_through_the_schedule_equal_the_reference(two_ranks, four_ranks, float64_grads, tolerances):
    for where, _, form, result in _each(two_ranks, four_ranks):
        if "tp2" in where and form != "packed":  # TP 2's reduction order on these rows: the next test (see the top)
            continue
        grads = result["grads"]
        assert set(float64_grads[form]) <= set(grads), where
        assert not gradients_too_far(grads, float64_grads[form], tolerances[form]), where
        frozen = [name for name in grads if name not in float64_grads[form]]
        assert frozen and all(grads[name].abs().max() == 0 for name in frozen), where


def test_gradients_at_pp_2_equal_pp_1_of_the_same_layout(four_ranks):
    for rank, results in enumerate(four_ranks):
        for layout, base in FOUR_RANK_LAYOUTS.items():
            for form in (form for form in FORMS if form in results[base]):
                one_stage, two_stages = results[base][form]["grads"], results[layout][form]["grads"]
                assert one_stage.keys() == two_stages.keys()
                for name, expected in one_stage.items():
                    scale = max(expected.abs().max().item(), torch.finfo(torch.float32).tiny)
                    assert _max_diff(two_stages[name], expected) / scale <= STAGES_TOLERANCE[base], \
                        (layout, rank, form, name)


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


def test_each_stage_ran_its_layers_at_every_four_rank_layout(four_ranks):
    for layout in FOUR_RANK_LAYOUTS:
        stages = {result[layout]["last_stage"]: [index for index, _ in result[layout]["layers"]]
                  for result in four_ranks}
        first = 3 if "3+7" in layout else 5
        assert stages == {False: list(range(first)), True: list(range(first, 10))}, layout


def test_the_boundary_tensor_carries_pre_and_ids_exactly_in_bf16():
    from modelzoo.deepseek_v41.config import DeepseekV41Args
    from modelzoo.deepseek_v41.hf_model import CompressedState
    from modelzoo.deepseek_v41.model.pipeline import Boundary, RowShapes, boundary_length, pack, received_ids, unpack

    args = DeepseekV41Args.from_hf(build_provider(V41_TINY).hf_config)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200_000, (2, 16), generator=generator)
    streams = torch.randn(2, 16, args.hc_mult, args.hidden_size, generator=generator).bfloat16()
    pre = torch.rand(2, 16, args.hc_mult, generator=generator) * 3  # fp32 values bf16 cannot hold
    boundary, shapes = Boundary(0, False, False), RowShapes.of([16, 16], 16, [16, 16], 16)
    sent = pack(args, boundary, streams, pre, CompressedState(), shapes, ids, torch.bfloat16,
                boundary_length(args, 16, torch.bfloat16))
    assert sent.shape == (boundary_length(args, 16, torch.bfloat16), 2, args.hidden_size)
    assert torch.equal(received_ids(sent), ids)
    received_streams, received_pre, _ = unpack(args, boundary, sent, shapes, torch.bfloat16, torch.bfloat16)
    assert torch.equal(received_streams, streams) and torch.equal(received_pre, pre)
    assert not torch.equal(pre.bfloat16().float(), pre)


def test_the_fast_paths_picks_travel_as_ids_exactly_in_bf16():
    """Under attention="fast" the top-k and the candidate blocks travel as ids: rows of 600 and 300 tokens (padded
    to 600) after a ratio-1 source, ids past 255. They come back exactly, the padded queries' slots -1, in a tensor
    that grows linearly with the length where the masks' grows with its square."""
    from modelzoo.deepseek_v41.config import DeepseekV41Args
    from modelzoo.deepseek_v41.hf_model import CompressedState
    from modelzoo.deepseek_v41.model.pipeline import Boundary, RowShapes, boundary_length, pack, unpack

    args = DeepseekV41Args.from_hf(build_provider(V41_TINY).hf_config)
    generator = torch.Generator().manual_seed(0)
    lengths, text = [600, 300], args.text
    state = CompressedState(1, torch.randn(2, 600, args.head_dim, generator=generator).bfloat16(),
                            torch.randn(2, 600, args.index_head_dim, generator=generator).bfloat16())
    picks = {"selected": (args.index_topk, 1), "candidates": (text.candidate_topk_blocks, text.candidate_block_size)}
    for name, (width, per_id) in picks.items():
        ids = torch.stack([torch.randint(-1, length // per_id, (600, width), generator=generator)
                           for length in lengths])
        ids[1, 300:] = -1  # the second row's padding
        setattr(state, name, ids)
    assert state.selected.max() > 255
    boundary, shapes = Boundary(1, True, True, picks_as_ids=True), RowShapes.of(lengths, 600, lengths, 600)
    sent = pack(args, boundary, torch.zeros(2, 600, args.hc_mult, args.hidden_size), torch.zeros(2, 600, args.hc_mult),
                state, shapes, torch.zeros(2, 600, dtype=torch.long), torch.bfloat16,
                boundary_length(args, 600, torch.bfloat16, picks_as_ids=True))
    _, _, received = unpack(args, boundary, sent, shapes, torch.bfloat16, torch.bfloat16)
    assert torch.equal(received.selected, state.selected) and torch.equal(received.candidates, state.candidates)
    as_ids, as_masks = ([boundary_length(args, length, torch.bfloat16, picks_as_ids=ids) for length in (600, 6000)]
                        for ids in (True, False))
    assert as_ids[1] < 11 * as_ids[0] and as_masks[1] > 50 * as_masks[0]


def test_a_sequence_parallel_slice_carries_its_real_tokens_only():
    """TP rank 1 of 2 on rows of 5 and 12 tokens padded to 12: it holds tokens 6..11 of each, none of the first row's
    (5 tokens) and all 6 of the second's; what it sends comes back at those slots, zeros elsewhere."""
    from modelzoo.deepseek_v41.config import DeepseekV41Args
    from modelzoo.deepseek_v41.hf_model import CompressedState
    from modelzoo.deepseek_v41.model.pipeline import Boundary, RowShapes, boundary_length, pack, unpack

    args = DeepseekV41Args.from_hf(build_provider(V41_TINY).hf_config)
    shapes = RowShapes.of([5, 12], 12, [5, 12], 12, tp=2, rank=1)
    assert (shapes.tokens, shapes.padded_tokens, shapes.queries, shapes.padded_queries) == ([0, 6], 6, [5, 12], 12)
    generator = torch.Generator().manual_seed(0)
    streams = torch.randn(2, 6, args.hc_mult, args.hidden_size, generator=generator)
    pre = torch.rand(2, 6, args.hc_mult, generator=generator)
    boundary = Boundary(0, False, False)
    sent = pack(args, boundary, streams, pre, CompressedState(), shapes, torch.zeros(1, 17, dtype=torch.long),
                torch.float32, boundary_length(args, 17, torch.float32))
    received_streams, received_pre, _ = unpack(args, boundary, sent, shapes, torch.float32, torch.float32)
    assert torch.equal(received_streams[1], streams[1]) and torch.equal(received_pre[1], pre[1])
    assert received_streams[0].abs().max() == 0 and received_pre[0].abs().max() == 0


@pytest.mark.parametrize("layout", [[], ["--cp", "2"], ["--tp", "2", "--sp"], ["--tp", "2", "--sp", "--cp", "2"],
                                    ["--attention", "fast"], ["--cp", "2", "--attention", "fast"]],
                         ids=["pp2", "pp2-cp2", "pp2-tp2-sp", "pp2-tp2-sp-cp2 (eight ranks)", "pp2-fast",
                              "pp2-cp2-fast"])
def test_cli_parity_at_pp_2(capsys, layout):
    from modelzoo.conversion.cli import main

    assert main(["parity", str(V41_TINY), "--pp", "2", *layout, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["pp"] == 2 and report["passed"]
    assert (report["cp"], report["tp"], report["sp"]) == (1 + ("--cp" in layout), 1 + ("--tp" in layout),
                                                          "--sp" in layout)
    assert report["max_abs_diff_logprobs"] <= LOGPROB_TOLERANCE
    assert report["max_abs_diff_logprobs_packed"] <= LOGPROB_TOLERANCE
