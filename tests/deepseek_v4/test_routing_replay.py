"""Rollout routing replay in the trainers' form (Megatron-Core's RouterReplay API), and padding kept from the experts.

An inference engine reports, for every token of a batch and every MoE layer, the experts it used; SkyRL and miles
hand them to Megatron's `RouterReplay` and train on those experts. With `moe_enable_routing_replay=True`
DeepSeek-V4's routers (hash layers too) take part in that API: RECORD gives each layer's ids in Megatron's token
order (sequence-major), REPLAY_FORWARD makes every router use the given ids. The oracle is modelzoo's own decision
replay (tests/deepseek_v4/test_decisions.py, checked against transformers' routing), run with the same ids.
"""

import pytest
import torch
from dsv4_helpers import max_diff, provider_for, write_tiny
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from modelzoo import runtime
from modelzoo.deepseek_v4.model.decisions import recording_decisions, replaying_decisions
from modelzoo.deepseek_v4.model.moe import RoutedExperts, Router
from modelzoo.layers.sequences import pack_sequences


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("dsv4-replay") / "deepseek-v4-tiny")


@pytest.fixture
def replaying_model(tiny):
    RouterReplay.clear_global_router_replay_instances()
    with runtime.parallel(), torch.no_grad():
        provider = provider_for(tiny, moe_enable_routing_replay=True)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        yield provider, model
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_router_replay_instances()


def _routers(model) -> dict[str, Router]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Router) and not name.startswith("mtp.")}


def _engine_choice(tokens: int, layers: int, experts: int, top_k: int, seed: int) -> list[torch.Tensor]:
    """Per layer [tokens, top_k] distinct expert ids, as an engine that routed differently would report them."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
            for _ in range(layers)]


def test_recorded_ids_are_the_routers_choices_in_megatrons_token_order(replaying_model):
    provider, model = replaying_model
    ids = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))   # b = 2: the order matters
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    with recording_decisions(model) as decisions:
        model(ids)
    recorded = RouterReplay.get_recorded_data()
    routers = _routers(model)
    assert len(recorded) == len(routers) + len(model.mtp.layers)   # decoder layers in order, then MTP (not run)
    for (name, _), megatron_ids in zip(routers.items(), recorded):
        ours = decisions[name].view(2, 24, -1)                               # [b, s] order
        assert torch.equal(megatron_ids, ours.transpose(0, 1).reshape(48, -1))


def test_replayed_engine_ids_are_what_every_router_uses(replaying_model):
    provider, model = replaying_model
    generator = torch.Generator().manual_seed(1)
    batch = pack_sequences([torch.randint(0, 250, (n,), generator=generator).tolist() for n in (17, 40, 5)],
                           divisor=8)
    routers = _routers(model)
    router = next(iter(routers.values()))
    engine = _engine_choice(batch.input_ids.shape[1], len(routers), router.weight.shape[0], router.top_k, seed=2)
    free_run = provider.token_logprobs(model, batch.input_ids, packed_seq_params=batch.packed_seq_params)

    RouterReplay.set_replay_data(engine + [torch.zeros_like(engine[0])] * len(model.mtp.layers))
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with recording_decisions(model) as used:
        replayed = provider.token_logprobs(model, batch.input_ids, packed_seq_params=batch.packed_seq_params)
    RouterReplay.clear_global_router_replay_action()

    real = torch.zeros(batch.input_ids.shape[1], dtype=torch.bool)
    for start, length in zip(batch.offsets, batch.lengths):
        real[start:start + length] = True
    for (name, _), ids in zip(routers.items(), engine):
        assert torch.equal(used[name][real], ids[real]), name                    # the engine's experts ...
        assert (used[name][~real] == -1).all(), name                            # ... and none for padding
    decisions = {name: ids.masked_fill(~real[:, None], -1) for name, ids in zip(routers, engine)}
    decisions.update({name: picks for name, picks in used.items() if name not in routers})   # indexer picks
    with replaying_decisions(model, decisions):
        expected = provider.token_logprobs(model, batch.input_ids, packed_seq_params=batch.packed_seq_params)
    for ours, theirs, free in zip(replayed, expected, free_run):
        assert torch.equal(ours, theirs)
    assert max(max_diff(ours, free) for ours, free in zip(replayed, free_run) if ours.numel()) > 1e-3


def test_routed_experts_see_exactly_the_real_tokens(tiny):
    counted = []
    original = RoutedExperts.forward

    def counting(self, tokens, indices, weights):
        counted.append(int((indices >= 0).sum()))
        return original(self, tokens, indices, weights)

    generator = torch.Generator().manual_seed(3)
    lengths = (17, 40, 5)
    batch = pack_sequences([torch.randint(0, 250, (n,), generator=generator).tolist() for n in lengths], divisor=16)
    with runtime.parallel(), torch.no_grad():
        provider = provider_for(tiny)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        RoutedExperts.forward = counting
        try:
            model(batch.input_ids, packed_seq_params=batch.packed_seq_params)
        finally:
            RoutedExperts.forward = original
    top_k = provider.hf_config.num_experts_per_tok
    assert batch.input_ids.shape[1] > sum(lengths)                                # there is padding to keep out
    assert counted == [sum(lengths) * top_k] * provider.hf_config.num_hidden_layers
