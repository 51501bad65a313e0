"""The trainers' own code drives our models: SkyRL's packing, unpacked path, log-probs and routing replay, and slime's
batch, responses, log-probs, MTP training and routing replay (tests/trainers/trainer_paths.py says what is run and what
is restated), at TP 1 (two data-parallel ranks), TP 2 and CP 2 on two gloo ranks.

Samples of 1, 7, 13 and 30 tokens (30 is past DeepSeek-V4 tiny's window of 8 and its compress rates 4 and 8, and
DeepSeek-V4.1 tiny's window of 8, index top-k of 8 and candidate budget) over a vocabulary of 250 tokens, which Megatron pads to 256: the padded logit columns are in every trainer's log-softmax.
slime scores responses after a prompt of at least one token, so its batch has a sample of 2 tokens where SkyRL's has
the 1-token one (its `get_responses` reads the logit before a response's first token).

- (a) log-probs through each trainer's path equal transformers' (our reference for LoopCoder and DeepSeek-V4.1) per
  sample, run alone
  as the trainer's layout holds it: followed by the zeros it pads the sample with inside its cu_seqlens entry (SkyRL's
  packing, slime under CP). 1e-5, fp32 (measured up to ~4e-6: the same fp32 math in another order; the padded
  vocabulary columns, at 0 instead of masked, put them 0.019 off). Causal attention hides the padding from the real
  tokens, but DeepSeek-V4's indexer does not quite: transformers' top-k among equal scores (the tiny indexer's ReLU
  scores tie at 0) depends on the row's length, so two zeros after a 30-token sample move its last log-probs by 0.73
  in transformers as in ours (docs/deepseek_v4.md, "Indexer ties");
- (b) 5 steps of a policy-gradient loss through SkyRL's packed log-probs, Megatron's schedule, DDP and the distributed
  optimizer lower the loss, and leave the padded rows of the output layer exactly zero;
- (c) the HF checkpoint written from the trained model gives the trained model's log-probs: 1e-5;
- (d) slime's MTP call (`mtp_kwargs`, labels None) trains every MTP parameter of DeepSeek-V4 and no other: the rest
  of the gradient is bit-identical to the call without it;
- (e) SkyRL's and slime's routing replay (DeepSeek-V4 and V4.1): the recorded expert ids replayed give the recording
  run's log-probs, shifted ids change them by more than 1e-3.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from conftest import tiny_with_vocab

pytest.importorskip("skyrl", reason="SkyRL is installed by .ci/setup (skyrl==0.4.0 --no-deps)")

import trainer_paths as paths  # noqa: E402

from modelzoo import build_provider, runtime  # noqa: E402

ARCHITECTURES = ("llama", "loopcoder", "deepseek_v4", "deepseek_v41")
MOE_ARCHITECTURES = ("deepseek_v4", "deepseek_v41")
LAYOUTS = {"tp1": dict(tp=1), "tp2": dict(tp=2), "cp2": dict(cp=2)}
VOCAB = 250
SKYRL_SAMPLES, SKYRL_PROMPTS = [1, 7, 13, 30], [1, 3, 5, 10]
SLIME_SAMPLES, SLIME_RESPONSES = [2, 7, 13, 30], [1, 4, 8, 20]
LOGPROB_TOLERANCE = 1e-5
STEPS, LR = 5, 1e-3
REPLAY_MOVES = 1e-3


def samples(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in lengths]


def hf_logprobs(hf_dir: str, token_lists: list[list[int]], multiple: int = 1) -> list[torch.Tensor]:
    """Each sample alone through the HF model, followed by zeros up to a multiple of `multiple` (the trainer's
    padding inside the sample's sequence): log p(t[i + 1] | t[:i + 1]) [len - 1] of its real tokens, fp32."""
    from modelzoo.parity import load_hf_model

    model = load_hf_model(hf_dir)
    out = []
    with torch.no_grad():
        for tokens in token_lists:
            ids = torch.tensor([tokens + [0] * (-len(tokens) % multiple)])
            logprobs = torch.log_softmax(model(ids, use_cache=False).logits.float(), -1)
            out.append(logprobs[0, :len(tokens) - 1].gather(-1, ids[0, 1:len(tokens), None])[:, 0])
    return out


@functools.cache
def hf_reference(hf_dir: str, layout: str, path: str) -> list[torch.Tensor]:
    """transformers' per-sample log-probs of the samples a trainer's path runs, padded as it pads them."""
    tp, cp = LAYOUTS[layout].get("tp", 1), LAYOUTS[layout].get("cp", 1)
    if path == "slime":
        return hf_logprobs(hf_dir, samples(SLIME_SAMPLES, 2), paths.slime_alignment(cp))
    multiple = paths.skyrl_packed_alignment(tp, cp) if path == "skyrl_packed" else 1
    return hf_logprobs(hf_dir, samples(SKYRL_SAMPLES, 1), multiple)


def build(hf_dir: str, **overrides):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.global_router_replay_instances.clear()  # Megatron's registry is per process, not per model
    provider = build_provider(hf_dir, **overrides)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    return provider, model


def skyrl_real_columns(batch: dict) -> torch.Tensor:
    """[B, S - 1] bool: the columns where SkyRL's log-probs hold a real token's next-token log-prob."""
    mask = batch["attention_mask"].bool()
    return mask[:, :-1] & mask[:, 1:]


# --- the ranks ------------------------------------------------------------------------------------------------------
def _logprob_case(hf_dir: str, layout: str) -> dict:
    provider, model = build(hf_dir)
    skyrl_samples, slime_samples = samples(SKYRL_SAMPLES, 1), samples(SLIME_SAMPLES, 2)
    batch = paths.skyrl_batch(skyrl_samples, SKYRL_PROMPTS)
    with torch.no_grad():
        result = dict(skyrl_packed=paths.skyrl_packed_logprobs(model, batch),
                      slime=paths.slime_response_logprobs(model, slime_samples, SLIME_RESPONSES))
        if layout != "cp2":  # SkyRL's unpacked path asserts context parallel size 1
            result["skyrl_unpacked"] = paths.skyrl_unpacked_logprobs(model, batch)
    return result


def _ddp_and_optimizer(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.01,
                                                       use_distributed_optimizer=True), [ddp])
    return ddp, optimizer


def _schedule_step(ddp, optimizer, forward_step, micro_batches: list) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=ddp,
                                num_microbatches=len(micro_batches), seq_length=64, micro_batch_size=1,
                                forward_only=False)
    succeeded, _, _ = optimizer.step()
    assert succeeded


def _policy_loss(logprobs: torch.Tensor, batch: dict) -> torch.Tensor:
    mask = skyrl_real_columns(batch).float()
    advantages = torch.linspace(-1.0, 1.0, mask.shape[0])[:, None] + 0.5  # most rows to raise, one to lower
    return -(advantages * logprobs * mask).sum() / mask.sum()


def _training_case(hf_dir: str, folder: str) -> dict:
    """(b) and (c): SkyRL's packed log-probs under a policy-gradient loss, 5 steps of DDP + the distributed optimizer."""
    provider, model = build(hf_dir)
    ddp, optimizer = _ddp_and_optimizer(model)
    batch = paths.skyrl_batch(samples(SKYRL_SAMPLES, 3), SKYRL_PROMPTS)

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        logits, packed_seq_params, targets = paths.skyrl_packed_forward(model, micro_batch)

        def loss_func(output):
            from skyrl.backends.skyrl_train.distributed.megatron.model_utils import (
                from_parallel_logits_to_logprobs_packed_sequences,
            )
            from megatron.core import parallel_state as mpu

            shard, rank = output.shape[-1], mpu.get_tensor_model_parallel_rank()
            logprobs = from_parallel_logits_to_logprobs_packed_sequences(
                output, targets, packed_seq_params.cu_seqlens_q_padded, micro_batch["sequences"].shape[1],
                rank * shard, (rank + 1) * shard, mpu.get_tensor_model_parallel_group(),
                cp_group=mpu.get_context_parallel_group(), attention_mask=micro_batch["attention_mask"].bool())
            loss = _policy_loss(logprobs, micro_batch)
            return loss, {"loss": loss.detach()}
        return logits, loss_func

    def evaluate() -> float:
        with torch.no_grad():
            return _policy_loss(paths.skyrl_packed_logprobs(model, batch), batch).item()

    losses = [evaluate()]
    for _ in range(STEPS):
        _schedule_step(ddp, optimizer, forward_step, [batch])
        losses.append(evaluate())
    padded_rows = _padded_rows(provider, model)
    provider.save_hf(model, folder)
    torch.distributed.barrier()
    with torch.no_grad():
        trained = paths.skyrl_packed_logprobs(model, batch)
    from megatron.core import parallel_state as mpu

    multiple = paths.skyrl_packed_alignment(mpu.get_tensor_model_parallel_world_size(),
                                            mpu.get_context_parallel_world_size())
    exported = hf_logprobs(folder, batch_samples(batch), multiple)
    return dict(losses=losses, padded_rows=padded_rows.detach().clone(), trained=trained,
                exported=paths.skyrl_layout_logprobs(batch_samples(batch), SKYRL_PROMPTS, exported),
                columns=skyrl_real_columns(batch))


def batch_samples(batch: dict) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(batch["sequences"], batch["attention_mask"])]


def _padded_rows(provider, model) -> torch.Tensor:
    """This TP rank's rows of the output layer past the real vocabulary (the last rank's shard holds them)."""
    from megatron.core import parallel_state as mpu

    weight = model.output_layer.weight
    first_padded = provider.vocab_size - mpu.get_tensor_model_parallel_rank() * weight.shape[0]
    return weight[max(0, first_padded):]


def _mtp_case(hf_dir: str) -> dict:
    """(d): slime's MTP call. Gradients with and without mtp_kwargs, then one DDP + distributed optimizer step."""
    provider, model = build(hf_dir, mtp_loss_scale=0.3)
    token_lists = samples(SLIME_SAMPLES, 4)
    gradients = {}
    for mtp in (False, True):
        model.zero_grad(set_to_none=True)
        logits, batch = paths.slime_forward(model, token_lists, mtp=mtp)
        responses = paths.slime_get_responses(logits, batch["unconcat_tokens"], SLIME_RESPONSES)
        loss = -torch.cat([paths.slime_logprobs(chunk, tokens) for chunk, tokens, _ in responses]).sum()
        loss.backward()
        gradients[mtp] = {name: (p.grad.clone() if p.grad is not None else None)
                          for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    mtp_before = {name: p.detach().clone() for name, p in model.named_parameters() if name.startswith("mtp.")}
    ddp, optimizer = _ddp_and_optimizer(model)

    def forward_step(data_iterator, model):
        logits, batch = paths.slime_forward(model, next(data_iterator), mtp=True)

        def loss_func(output):
            responses = paths.slime_get_responses(output, batch["unconcat_tokens"], SLIME_RESPONSES)
            loss = -torch.cat([paths.slime_logprobs(c, t) for c, t, _ in responses]).mean()
            return loss, {"loss": loss.detach()}
        return logits, loss_func

    _schedule_step(ddp, optimizer, forward_step, [token_lists])
    moved = {name: not torch.equal(p.detach(), mtp_before[name]) for name, p in model.named_parameters()
             if name.startswith("mtp.")}
    return dict(gradients=gradients, moved=moved, mtp_num_layers=model.config.mtp_num_layers)


def _replay_case(hf_dir: str) -> dict:
    """(e): SkyRL's and slime's routing replay on DeepSeek-V4 or V4.1. With TP, sequence parallelism on, as SkyRL
    and miles run MoE models (SkyRL hands each TP rank the ids of its s / tp tokens)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from modelzoo.layers import context_parallel

    provider, model = build(hf_dir, moe_enable_routing_replay=True,
                            sequence_parallel=mpu.get_tensor_model_parallel_world_size() > 1)
    token_lists = samples(SKYRL_SAMPLES, 5)
    batch = paths.skyrl_batch(token_lists, SKYRL_PROMPTS)
    num_layers = provider.hf_config.num_hidden_layers
    result = {}
    with torch.no_grad():
        # the engine's ids: a recorded packed forward, each real token's ids per decoder layer
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        recording, packed_seq_params, _ = paths.skyrl_packed_forward(model, batch)
        recorded = RouterReplay.get_recorded_data()[:num_layers]
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        whole = [context_parallel.gather_from_ranks(_over_tensor_parallel(ids.long())[None], packed_seq_params)[0]
                 for ids in recorded]
        starts = packed_seq_params.cu_seqlens_q_padded[:-1].tolist()
        engine_ids = [torch.stack([ids[start:start + len(tokens)] for ids in whole], dim=1)
                      for start, tokens in zip(starts, token_lists)]
        recorded_logprobs = paths.skyrl_packed_logprobs(model, batch)
        for name, ids in (("skyrl_replayed", engine_ids),
                          ("skyrl_shifted", [(i + 1) % provider.hf_config.n_routed_experts for i in engine_ids])):
            kwargs = paths.skyrl_replay_kwargs(model, batch, ids)
            result[name] = paths.skyrl_packed_logprobs(model, batch, **kwargs)
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()
        result["skyrl_recorded"] = recorded_logprobs

        slime = paths.SlimeRoutingReplay([layer.mlp.router for layer in model.decoder.layers])
        slime_samples = samples(SLIME_SAMPLES, 6)
        stage = os.environ.get("ROUTING_REPLAY_STAGE")
        try:
            os.environ["ROUTING_REPLAY_STAGE"] = "record"
            result["slime_recorded"] = paths.slime_response_logprobs(model, slime_samples, SLIME_RESPONSES)
            recorded = slime.recorded()
            os.environ["ROUTING_REPLAY_STAGE"] = "replay_forward"
            for name, ids in (("slime_replayed", recorded),
                              ("slime_shifted", [(i + 1) % provider.hf_config.n_routed_experts for i in recorded])):
                slime.fill(ids)
                result[name] = paths.slime_response_logprobs(model, slime_samples, SLIME_RESPONSES)
        finally:
            slime.close()
            os.environ.pop("ROUTING_REPLAY_STAGE") if stage is None else os.environ.update(
                ROUTING_REPLAY_STAGE=stage)
    return result


def _over_tensor_parallel(rank_share: torch.Tensor) -> torch.Tensor:
    """Under sequence parallelism each TP rank records its s / tp tokens' ids: the row's, gathered."""
    from megatron.core import parallel_state as mpu

    size = mpu.get_tensor_model_parallel_world_size()
    if size == 1:
        return rank_share
    every = rank_share.new_empty((rank_share.shape[0] * size, *rank_share.shape[1:]))
    torch.distributed.all_gather_into_tensor(every, rank_share.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return every


def _all_cases(rank: int, layout: str, checkpoints: dict, scratch: str) -> dict:
    results = {}
    with runtime.parallel(**LAYOUTS[layout]):
        for architecture in ARCHITECTURES:
            hf_dir = checkpoints[architecture]
            results[architecture] = dict(logprobs=_logprob_case(hf_dir, layout),
                                         training=_training_case(hf_dir, f"{scratch}/{layout}-{architecture}"))
        results["mtp"] = _mtp_case(checkpoints["deepseek_v4"])
        for architecture in MOE_ARCHITECTURES:
            results["replay", architecture] = _replay_case(checkpoints[architecture])
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("vocab250")
    return {architecture: str(tiny_with_vocab(architecture, folder, VOCAB)) for architecture in ARCHITECTURES}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def ranks(request, checkpoints, tmp_path_factory):
    scratch = tmp_path_factory.mktemp(f"trained-{request.param}")
    return request.param, runtime.spawn(_all_cases, 2, request.param, checkpoints, str(scratch))


# --- the tests ------------------------------------------------------------------------------------------------------
def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_trainers_log_probs_equal_the_hf_models(ranks, checkpoints, architecture):
    layout, results = ranks
    hf_dir = checkpoints[architecture]
    batch = paths.skyrl_batch(samples(SKYRL_SAMPLES, 1), SKYRL_PROMPTS)
    columns = skyrl_real_columns(batch)
    for result in results:
        ours = result[architecture]["logprobs"]
        paths_checked = ["skyrl_packed"] + (["skyrl_unpacked"] if layout != "cp2" else [])
        for path in paths_checked:
            expected = paths.skyrl_layout_logprobs(samples(SKYRL_SAMPLES, 1), SKYRL_PROMPTS,
                                                   hf_reference(hf_dir, layout, path))
            error = max_diff(ours[path][columns], expected[columns])
            print(f"{architecture} {layout} {path}: max |diff| {error:.2e}")
            assert error <= LOGPROB_TOLERANCE, (path, error)
        for (logprobs, indices), hf in zip(ours["slime"], hf_reference(hf_dir, layout, "slime"), strict=True):
            if len(indices):
                error = max_diff(logprobs, hf[indices - 1])
                print(f"{architecture} {layout} slime: max |diff| {error:.2e}")
                assert error <= LOGPROB_TOLERANCE
    # every response token is scored once: on each rank, or under CP on one rank of the two
    held = [sum(len(indices) for _, indices in result[architecture]["logprobs"]["slime"]) for result in results]
    assert (sum(held) if layout == "cp2" else min(held)) == sum(SLIME_RESPONSES)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_policy_gradient_steps_lower_the_loss_and_leave_the_padded_rows_zero(ranks, architecture):
    layout, results = ranks
    for result in results:
        training = result[architecture]["training"]
        losses = training["losses"]
        print(f"{architecture} {layout}: policy loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        assert losses[-1] < losses[0] - 0.01
        assert torch.count_nonzero(training["padded_rows"]) == 0
    assert any(result[architecture]["training"]["padded_rows"].shape[0] for result in results)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_exported_checkpoint_gives_the_trained_models_log_probs(ranks, architecture):
    layout, results = ranks
    for result in results:
        training = result[architecture]["training"]
        columns = training["columns"]
        error = max_diff(training["trained"][columns], training["exported"][columns])
        print(f"{architecture} {layout}: exported vs trained max |diff| {error:.2e}")
        assert error <= LOGPROB_TOLERANCE


@pytest.mark.slow
def test_slime_mtp_call_trains_every_mtp_parameter_and_nothing_else(ranks):
    _, results = ranks
    for result in results:
        mtp = result["mtp"]
        assert mtp["mtp_num_layers"] == 1
        without, with_mtp = mtp["gradients"][False], mtp["gradients"][True]
        mtp_names = [name for name in with_mtp if name.startswith("mtp.")]
        assert mtp_names and all(without[name] is None for name in mtp_names)
        assert all(with_mtp[name] is not None and with_mtp[name].abs().max() > 0 for name in mtp_names)
        for name, gradient in without.items():
            if not name.startswith("mtp."):
                assert (gradient is None and with_mtp[name] is None) or torch.equal(gradient, with_mtp[name]), name
        assert mtp["moved"] and all(mtp["moved"].values()), [n for n, moved in mtp["moved"].items() if not moved]


@pytest.mark.slow
@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_routing_replay_through_skyrl_and_slime(ranks, architecture):
    _, results = ranks
    for result in results:
        replay = result["replay", architecture]
        batch = paths.skyrl_batch(samples(SKYRL_SAMPLES, 5), SKYRL_PROMPTS)
        columns = skyrl_real_columns(batch)
        assert torch.equal(replay["skyrl_replayed"][columns], replay["skyrl_recorded"][columns])
        assert max_diff(replay["skyrl_shifted"][columns], replay["skyrl_recorded"][columns]) > REPLAY_MOVES
        recorded, replayed, shifted = (torch.cat([lp for lp, _ in replay[name]])
                                       for name in ("slime_recorded", "slime_replayed", "slime_shifted"))
        assert torch.equal(replayed, recorded)
        assert max_diff(shifted, recorded) > REPLAY_MOVES
