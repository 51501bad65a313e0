"""Context parallelism (`runtime.parallel(cp=N)`) for DeepSeek-V4 against transformers' DeepseekV4ForCausalLM.

Oracle: transformers' DeepseekV4ForCausalLM on the shipped tiny checkpoint, fp32, each packed sequence run alone.
MTP, which transformers does not build: its logits against the published formulation on transformers' modules
(dsv4_helpers.reference_mtp_logits, per sequence), the gradients of the MTP loss against the same model without
context parallelism (whose MTP logits are that formulation's, test_mtp.py, and other gradients transformers',
test_model.py).

Each CP rank gets its share of the batch in Megatron's load-balanced layout (2 x CP chunks per sequence or packed
slot, rank r holding chunks r and 2 x CP - 1 - r), `split_for_rank` as a trainer hands it over, and runs
`model(local_ids, labels=local_labels, packed_seq_params=the whole row's)`.
Batches: a packed row of sequences of lengths 1, 17, 40, 5 and 70 (slots padded to a multiple of 2 x CP) and plain
rows [2, 32]. The tiny model's sliding window is 16 and its compress ratios 4 (CSA, whose indexer keeps the top 4
entries) and 16 (HCA): the 70-token sequence crosses the window, has 17 CSA entries (more than the top-k) and 4 HCA
entries with a last partial window of 6 tokens, and its chunks of 18 (CP 2) or 9 (CP 4) tokens put window keys,
compressor windows and MTP's next token on other ranks; the 32-token rows have 8 CSA and 2 HCA entries.
Layouts: CP 2 (two ranks); CP 4, EP 2 x CP 2 and TP 2 x CP 2 (four ranks, one spawn). Megatron forms the expert
groups from the data x context ranks: at EP 2 x CP 2 the two ranks of a CP group are an EP group (the experts see
both ranks' tokens through the dispatcher), and two such replicas run.

- The per-token loss each rank returns, gathered, is minus the HF log-probs; `provider.token_logprobs` of the whole
  batch on every rank (rows of 29 tokens, no multiple of 2 x CP, included: they run packed) equals them
  (LOGPROB_TOLERANCE = 1e-5: fp32, the same math in another order moves them by ~1e-6; a token that reads a wrong
  key or a compressed entry of another sequence moves by > 1e-3).
- Gradients through Megatron's schedule, DDP and finalize_model_grads with the token-sum loss
  (`calculate_per_token_loss`, Megatron-Bridge's): they are summed over the data-parallel group with context
  parallelism (expert parameters over the expert data-parallel group) and divided by the loss tokens of every rank,
  which must give the HF gradient of the mean (GRADIENT_TOLERANCE = 1e-4 relative to the largest entry of each
  tensor, max-norm). The indexer (a top-k of indices) and the MTP layers (their loss off) get no gradient.
- The fast attention (at CP 2 and CP 4: each rank's runs of a sequence with the window's halo from other ranks'
  chunks) and, at CP 2, the core attention recomputed (selective recompute; its gathers run again in the backward):
  log-probs as above, and the local losses' gradients summed over the CP group equal the HF gradients.
- MTP (mtp_loss_scale 0.3, at CP 2 and CP 4): the gathered depth-1 logits within MTP_TOLERANCE = 1e-4 of the
  formulation's (test_mtp.py's); the gradients of the local losses (main + MTP, whose share each rank adds),
  summed over the CP group, within GRADIENT_TOLERANCE of the gradients without context parallelism.
- Rollout routing replay (Megatron's RouterReplay, at CP 2 and CP 4), each rank handed its share of the engine's
  ids cut like its input ids, as trainers do for Megatron's own MoE: the ids each router records, gathered, are
  those of one rank, and the log-probs with an engine's ids replayed equal one rank's replay of the whole ids
  (LOGPROB_TOLERANCE; test_routing_replay.py checks that replay against modelzoo's decision replay).
- Recorded decisions (modelzoo's `recording_decisions`, at CP 2) are each rank's share: replayed into the same
  model they give its log-probs bit for bit; altered (every routed expert id moved to the next expert) and replayed
  into the exact and the fast attention, the two agree within LOGPROB_TOLERANCE and differ from the model's own
  routing by > 1e-3.
- The CLI's `logprobs --cp 2` (rows and `--pack`) equals the HF backend.
Measured: log-probs within 4.3e-6; gradients within 2.5e-5 relative (the hyper-connection `scale` and `base`, sums
with heavy cancellation; the rest within 4.9e-6); MTP logits within 5.2e-6, MTP gradients within 1.5e-5.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from conftest import TINY
from dsv4_helpers import BUFFERS, VOCAB, hf_grads_by_name, hf_model, hf_token_logprobs, reference_mtp_logits

from modelzoo import build_provider, runtime
from modelzoo.layers import context_parallel
from modelzoo.layers.sequences import pack_sequences

LOGPROB_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4
MTP_TOLERANCE = 1e-4
MTP_LOSS_SCALE = 0.3
CHECKPOINT = TINY / "deepseek-v4-tiny"
LENGTHS = (1, 17, 40, 5, 70)
ROWS = (2, 32)
CUT = ROWS[1] - 3
WORLDS = {2: [(1, 1, 2)], 4: [(1, 1, 4), (1, 2, 2), (2, 1, 2)]}  # world size -> (tp, ep, cp) layouts, one spawn


def _data():
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in LENGTHS]
    return sequences, torch.randint(0, VOCAB, ROWS, generator=generator)


def _row_labels(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows: labels[t] = input_ids[t + 1]; the last position has no target (loss mask 0)."""
    loss_mask = torch.ones(input_ids.shape)
    loss_mask[:, -1] = 0
    return input_ids.roll(-1, dims=1), loss_mask


# --- the oracles ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """HF log-probs (each packed sequence alone, the rows, the cut rows), the HF gradients of minus their sums, and
    the MTP logits of each packed sequence by the published formulation."""
    sequences, rows = _data()
    scratch = tmp_path_factory.mktemp("hf")
    model = hf_model(CHECKPOINT)
    alone = [hf_token_logprobs(model, torch.tensor([sequence]))[0] for sequence in sequences]
    (-sum(logprobs.sum() for logprobs in alone)).backward()
    packed_grads = hf_grads_by_name(model, scratch / "packed")
    row_logprobs = hf_token_logprobs(model, rows)
    (-row_logprobs.sum()).backward()
    row_grads = hf_grads_by_name(model, scratch / "rows")
    with torch.no_grad():
        cut = hf_token_logprobs(model, rows[:, :CUT])
        mtp = [reference_mtp_logits(CHECKPOINT, scratch / "mtp-block", torch.tensor([sequence]))[0]
               for sequence in sequences]
    return dict(alone=[t.detach() for t in alone], rows=row_logprobs.detach(), cut=cut, mtp=mtp,
                packed_grads=packed_grads, row_grads=row_grads, packed_tokens=sum(LENGTHS) - len(LENGTHS),
                row_tokens=ROWS[0] * (ROWS[1] - 1))


@pytest.fixture(scope="module")
def grads_without_context_parallelism():
    """The MTP model's gradients of the packed row's main + MTP loss on one rank, by parameter name."""
    sequences, _ = _data()
    with runtime.parallel():
        provider = build_provider(CHECKPOINT, mtp_loss_scale=MTP_LOSS_SCALE)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        batch = pack_sequences(sequences)
        labels, loss_mask = batch.labels()
        loss = model(batch.input_ids, None, None, labels=labels, packed_seq_params=batch.packed_seq_params,
                     loss_mask=loss_mask)
        (loss * loss_mask).sum().backward()
        return _grads_by_parameter(model)


def _grads_by_parameter(model) -> dict[str, torch.Tensor]:
    return {name: (param.grad if param.grad is not None else torch.zeros_like(param)).clone()
            for name, param in model.named_parameters()}


# --- the ranks ------------------------------------------------------------------------------------------------------
def _exported_main_grads(provider, model) -> dict[str, torch.Tensor]:
    """DDP's gradient buffer (main_grad) by checkpoint name, full tensors (collective); the weights are restored."""
    weights = {}
    with torch.no_grad():
        for param in model.parameters():
            weights[param] = param.detach().clone()
            grad = getattr(param, "main_grad", None)
            param.copy_(grad if grad is not None else torch.zeros_like(param))
        grads = {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)
                 if not name.endswith(BUFFERS)}
        for param, weight in weights.items():
            param.copy_(weight)
    return grads


def _scheduled_step(provider, model, ddp, input_ids, labels, loss_mask, packed_seq_params=None):
    """This rank's share through Megatron's schedule and DDP with the token-sum loss; -> (the whole per-token loss,
    gathered; the gradients by checkpoint name; this rank's token count)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    local = [context_parallel.split_for_rank(tensor, packed_seq_params) for tensor in (input_ids, labels, loss_mask)]
    losses = []

    def forward_step(data_iterator, model):
        ids, labels, mask = next(data_iterator)
        loss = model(ids, None, None, labels=labels, packed_seq_params=packed_seq_params)
        losses.append(loss.detach())
        return loss, lambda output: ((output * mask).sum(), mask.sum().int(), {})

    ddp.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([local]), model=ddp,
                                num_microbatches=1, seq_length=local[0].shape[1], micro_batch_size=1)
    whole = context_parallel.gather_from_ranks(losses[0], packed_seq_params)
    return whole, _exported_main_grads(provider, model), local[0].shape[1]


def _mtp(batch, labels, loss_mask) -> dict:
    """The MTP model on this rank's share: its depth-1 logits gathered, and the gradients of the local main + MTP
    loss summed over the CP group, by parameter name."""
    from megatron.core import parallel_state

    provider = build_provider(CHECKPOINT, mtp_loss_scale=MTP_LOSS_SCALE)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    params = batch.packed_seq_params
    ids, local_labels, local_mask = (context_parallel.split_for_rank(t, params) for t in (batch.input_ids, labels,
                                                                                          loss_mask))
    with torch.no_grad():
        _, (mtp_logits,) = model(ids, packed_seq_params=params, return_mtp=True)
    logits = batch.split(context_parallel.gather_from_ranks(mtp_logits[..., :VOCAB], params))
    loss = model(ids, None, None, labels=local_labels, packed_seq_params=params, loss_mask=local_mask)
    (loss * local_mask).sum().backward()
    grads = _grads_by_parameter(model)
    for grad in grads.values():
        dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
    return dict(logits=logits, grads=grads)


def _variant(batch, labels, loss_mask, rows, **options) -> dict:
    """The model built with `options` (the fast attention, recompute): the gradients of the local loss on the
    packed row, summed over the CP group, by checkpoint name (collective); the log-probs of the packed row and the
    cut rows."""
    from megatron.core import parallel_state

    provider = build_provider(CHECKPOINT, **options)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    params = batch.packed_seq_params
    ids, local_labels, local_mask = (context_parallel.split_for_rank(t, params) for t in (batch.input_ids, labels,
                                                                                          loss_mask))
    (model(ids, None, None, labels=local_labels, packed_seq_params=params) * local_mask).sum().backward()
    with torch.no_grad():
        logprobs = provider.token_logprobs(model, batch.input_ids, packed_seq_params=params)
        cut = provider.token_logprobs(model, rows[:, :CUT])
        for param in model.parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
            param.copy_(grad)
        grads = {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)
                 if not name.endswith(BUFFERS)}
    return dict(grads=grads, logprobs=logprobs, cut=cut)


def _engine_ids(tokens: int, routers: int, experts: int, top_k: int) -> list[torch.Tensor]:
    """Per router [tokens, top_k] distinct expert ids, as an engine that routed differently would report them
    (seeded: the same on every rank)."""
    generator = torch.Generator().manual_seed(4)
    return [torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
            for _ in range(routers)]


def _routing_replay(batch) -> dict:
    """Routing replay on this rank, at any CP size (collective): the ids each decoder router records for the packed
    row, gathered in row order; the log-probs of the row without replay and with the engine's ids replayed, each
    rank handed its share of them."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from modelzoo.deepseek_v4.model.moe import Router

    params = batch.packed_seq_params
    RouterReplay.clear_global_router_replay_instances()
    try:
        provider = build_provider(CHECKPOINT, moe_enable_routing_replay=True)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        routers = [m for name, m in model.named_modules() if isinstance(m, Router) and not name.startswith("mtp.")]
        engine = [context_parallel.split_for_rank(ids[None], params)[0]
                  for ids in _engine_ids(batch.input_ids.shape[1], len(routers), routers[0].weight.shape[0],
                                         routers[0].top_k)]
        not_run = len(RouterReplay.global_router_replay_instances) - len(routers)  # MTP's: a log-prob pass skips it
        with torch.no_grad():
            RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
            free = provider.token_logprobs(model, batch.input_ids, packed_seq_params=params)
            recorded = [context_parallel.gather_from_ranks(ids[None], params)[0]
                        for ids in RouterReplay.get_recorded_data()[:len(routers)]]
            RouterReplay.set_replay_data(engine + [torch.zeros_like(engine[0])] * not_run)
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            replayed = provider.token_logprobs(model, batch.input_ids, packed_seq_params=params)
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_router_replay_instances()
    return dict(free=free, recorded=recorded, replayed=replayed)


@pytest.fixture(scope="module")
def routing_replay_on_one_rank():
    """`_routing_replay` without context parallelism, on the packed row of each CP size's slot padding."""
    sequences, _ = _data()
    with runtime.parallel():
        return {cp: _routing_replay(pack_sequences(sequences, divisor=2 * cp)) for cp in (2, 4)}


def _decisions(batch) -> dict:
    """modelzoo's decision recording on this rank's share of the packed row (the exact attention), replayed into the
    same model, and altered (each routed expert id moved to the next expert) into the exact and the fast attention:
    the log-probs of each run."""
    from modelzoo.deepseek_v4.model.decisions import recording_decisions, replaying_decisions
    from modelzoo.deepseek_v4.model.moe import Router

    models = {}
    for attention in ("exact", "fast"):
        provider = build_provider(CHECKPOINT, attention=attention)
        models[attention] = provider.provide()
        provider.load_hf_weights(models[attention], progress=False)

    def logprobs(attention):
        return provider.token_logprobs(models[attention], batch.input_ids, packed_seq_params=batch.packed_seq_params)

    with torch.no_grad():
        with recording_decisions(models["exact"]) as decisions:
            free = logprobs("exact")
        with replaying_decisions(models["exact"], decisions):
            replayed = logprobs("exact")
        experts = provider.hf_config.n_routed_experts
        altered = {name: torch.where(ids >= 0, (ids + 1) % experts, ids)
                   if isinstance(models["exact"].get_submodule(name), Router) else ids
                   for name, ids in decisions.items()}
        results = dict(free=free, replayed=replayed)
        for attention in models:
            with replaying_decisions(models[attention], altered):
                results[f"altered_{attention}"] = logprobs(attention)
    return results


def _rank(rank: int, layouts):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    sequences, rows = _data()
    results = {}
    for tp, ep, cp in layouts:
        with runtime.parallel(tp=tp, ep=ep, cp=cp):
            provider = build_provider(CHECKPOINT)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            model.config.calculate_per_token_loss = True  # read by DDP's constructor
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
            model.config.no_sync_func, model.config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
            batch = pack_sequences(sequences, divisor=2 * cp)
            labels, loss_mask = batch.labels()
            packed_loss, packed_grads, local_tokens = _scheduled_step(provider, model, ddp, batch.input_ids, labels,
                                                                      loss_mask, batch.packed_seq_params)
            row_loss, row_grads, _ = _scheduled_step(provider, model, ddp, rows, *_row_labels(rows))
            with torch.no_grad():
                logprobs = provider.token_logprobs(model, batch.input_ids, packed_seq_params=batch.packed_seq_params)
                cut = provider.token_logprobs(model, rows[:, :CUT])
            result = dict(packed_loss=[-t for t in batch.split(packed_loss, shift=1)], row_loss=-row_loss[:, :-1],
                          packed_grads=packed_grads, row_grads=row_grads, logprobs=logprobs, cut=cut,
                          local_tokens=local_tokens, row_tokens=batch.input_ids.shape[1])
            if tp == ep == 1:
                result["mtp"] = _mtp(batch, labels, loss_mask)
                result["routing_replay"] = _routing_replay(batch)
                result["fast"] = _variant(batch, labels, loss_mask, rows, attention="fast")
            if (tp, ep, cp) == (1, 1, 2):
                result["recompute"] = _variant(batch, labels, loss_mask, rows, recompute_granularity="selective",
                                               recompute_modules=["core_attn"])
                result["decisions"] = _decisions(batch)
            results[(tp, ep, cp)] = result
    return results


@pytest.fixture(scope="module", params=sorted(WORLDS))
def ranks(request):
    return runtime.spawn(_rank, request.param, WORLDS[request.param])


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _each(ranks):
    for rank, results in enumerate(ranks):
        for (tp, ep, cp), result in results.items():
            yield f"tp{tp} ep{ep} cp{cp} rank{rank}", cp, result


def _relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return _max_diff(ours, expected) / expected.abs().max().item()


def test_each_rank_holds_its_share(ranks):
    for where, cp, result in _each(ranks):
        assert result["local_tokens"] == result["row_tokens"] // cp, where


def test_the_gathered_loss_is_minus_the_hf_logprobs(ranks, reference):
    for where, _, result in _each(ranks):
        for number, (ours, theirs) in enumerate(zip(result["packed_loss"], reference["alone"], strict=True)):
            assert _max_diff(ours, theirs) <= LOGPROB_TOLERANCE, (where, "packed", number)
        assert _max_diff(result["row_loss"], reference["rows"]) <= LOGPROB_TOLERANCE, (where, "rows")


def test_token_logprobs_of_the_whole_batch_equal_the_hf_logprobs(ranks, reference):
    for where, _, result in _each(ranks):
        for number, (ours, theirs) in enumerate(zip(result["logprobs"], reference["alone"], strict=True)):
            assert _max_diff(ours, theirs) <= LOGPROB_TOLERANCE, (where, number)
        assert _max_diff(result["cut"], reference["cut"]) <= LOGPROB_TOLERANCE, (where, f"rows of {CUT} tokens")


@pytest.mark.parametrize("form", ["packed", "row"])
def test_gradients_through_ddp_equal_the_hf_gradients(ranks, reference, form):
    expected_grads = reference[f"{form}_grads"]
    tokens = reference[f"{form}_tokens"]
    for where, _, result in _each(ranks):
        grads = result[f"{form}_grads"]
        # transformers builds no MTP layers; ours are frozen (their loss is off) and get no gradient
        assert all(name.startswith("mtp.") and not grads[name].any() for name in grads.keys() - expected_grads.keys())
        for name, expected in expected_grads.items():
            if not expected.any():  # the indexer (a top-k of indices), an expert that no token chose
                assert not grads[name].any(), (where, name)
                continue
            error = _relative_error(grads[name], expected / tokens)
            assert error <= GRADIENT_TOLERANCE, (where, form, name, error)


def _at_cp2(ranks) -> list[dict]:
    """Each rank's results at CP 2 alone (TP 1, EP 1): the checks made once, in the two-rank spawn."""
    if len(ranks) != 2:
        pytest.skip("checked in the two-rank spawn (CP 2)")
    return [results[(1, 1, 2)] for results in ranks]


@pytest.mark.parametrize("variant", ["fast", "recompute"])
def test_the_fast_attention_and_recompute_equal_the_hf_model(ranks, reference, variant):
    """The fast attention at CP 2 and CP 4; the core attention recomputed at CP 2 (two-rank spawn)."""
    checked = [(where, result[variant]) for where, _, result in _each(ranks) if variant in result]
    if not checked:
        pytest.skip(f"{variant}: checked in the two-rank spawn")
    for where, ours in checked:
        for number, (logprobs, theirs) in enumerate(zip(ours["logprobs"], reference["alone"], strict=True)):
            assert _max_diff(logprobs, theirs) <= LOGPROB_TOLERANCE, (where, number)
        assert _max_diff(ours["cut"], reference["cut"]) <= LOGPROB_TOLERANCE, (where, f"rows of {CUT} tokens")
        for name, expected in reference["packed_grads"].items():
            if not expected.any():  # the indexer (a top-k of indices), an expert that no token chose
                assert not ours["grads"][name].any(), (where, name)
                continue
            error = _relative_error(ours["grads"][name], expected)
            assert error <= GRADIENT_TOLERANCE, (where, name, error)


def _with_mtp(ranks):
    """The layouts where MTP is checked: TP 1 and EP 1 (its gradients are compared by parameter, unsharded)."""
    for where, _, result in _each(ranks):
        if "mtp" in result:
            yield where, result


def test_mtp_logits_equal_the_published_formulation(ranks, reference):
    for where, result in _with_mtp(ranks):
        for number, (ours, theirs) in enumerate(zip(result["mtp"]["logits"], reference["mtp"], strict=True)):
                assert _max_diff(ours, theirs) <= MTP_TOLERANCE, (where, number)


def test_mtp_loss_gradients_summed_over_the_group_equal_those_without_context_parallelism(
        ranks, grads_without_context_parallelism):
    checked = 0
    for where, result in _with_mtp(ranks):
        grads = result["mtp"]["grads"]
        assert grads.keys() == grads_without_context_parallelism.keys()
        for name, expected in grads_without_context_parallelism.items():
            if not expected.any():  # the indexer (a top-k of indices), an expert that no token chose
                assert not grads[name].any(), (where, name)
                continue
            checked += name.startswith("mtp.")
            error = _relative_error(grads[name], expected)
            assert error <= GRADIENT_TOLERANCE, (where, name, error)
    assert checked > 0  # the MTP layers' own gradients are among them


def test_routing_replay_with_each_ranks_share_of_the_ids_equals_one_ranks_replay(ranks, routing_replay_on_one_rank):
    sequences, _ = _data()
    checked = 0
    for where, cp, result in _each(ranks):
        if "routing_replay" not in result:
            continue
        ours, expected = result["routing_replay"], routing_replay_on_one_rank[cp]
        batch = pack_sequences(sequences, divisor=2 * cp)
        real = torch.zeros(batch.input_ids.shape[1], dtype=torch.bool)
        for start, length in zip(batch.offsets, batch.lengths):
            real[start:start + length] = True
        for layer, (recorded, theirs) in enumerate(zip(ours["recorded"], expected["recorded"], strict=True)):
            assert torch.equal(recorded[real], theirs[real]), (where, layer)
        for number, (replayed, theirs) in enumerate(zip(ours["replayed"], expected["replayed"], strict=True)):
            assert _max_diff(replayed, theirs) <= LOGPROB_TOLERANCE, (where, number)
        checked += 1
    assert checked > 0
    for expected in routing_replay_on_one_rank.values():  # the engine's ids are not the model's own choice
        assert max(_max_diff(replayed, free) for replayed, free in zip(expected["replayed"], expected["free"])) > 1e-3


def test_recorded_decisions_replay_on_each_rank(ranks):
    for rank, result in enumerate(_at_cp2(ranks)):
        runs = result["decisions"]
        for number, (free, replayed) in enumerate(zip(runs["free"], runs["replayed"], strict=True)):
            assert torch.equal(free, replayed), (rank, number)
        for number, (exact, fast) in enumerate(zip(runs["altered_exact"], runs["altered_fast"], strict=True)):
            assert _max_diff(exact, fast) <= LOGPROB_TOLERANCE, (rank, number)
        assert max(_max_diff(altered, free) for altered, free in zip(runs["altered_exact"], runs["free"])) > 1e-3


# --- the CLI ---------------------------------------------------------------------------------------------------------
def test_cli_logprobs_with_cp_equal_the_hf_backend(tmp_path):
    from modelzoo.conversion.cli import main

    sequences = [sequence for sequence in _data()[0] if len(sequence) > 1]  # the CLI needs 2 tokens or more
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(sequences))
    runs = {"rows": ["--cp", "2"], "packed": ["--cp", "2", "--pack"], "hf": ["--backend", "hf"]}
    for kind, options in runs.items():
        assert main(["logprobs", str(CHECKPOINT), "--tokens", str(tokens), "--out", str(tmp_path / f"{kind}.json"),
                     *options]) == 0
    outputs = {kind: json.loads((tmp_path / f"{kind}.json").read_text())["logprobs"] for kind in runs}
    for kind in ("rows", "packed"):
        assert [len(values) for values in outputs[kind]] == [len(sequence) - 1 for sequence in sequences]
        for ours, theirs in zip(outputs[kind], outputs["hf"]):
            assert max((abs(a - b) for a, b in zip(ours, theirs)), default=0.0) <= LOGPROB_TOLERANCE, kind
