"""Recording and replaying the discrete decisions (routed experts, indexer picks) of the tiny DeepSeek-V4, fp32 CPU."""

import pytest
import torch
from dsv4_helpers import max_diff, provider_for, random_tokens, write_tiny

from modelzoo import runtime
from modelzoo.deepseek_v4.model.decisions import recording_decisions, replaying_decisions
from modelzoo.deepseek_v4.model.indexer import Indexer
from modelzoo.deepseek_v4.model.moe import Router


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("dsv4-decisions") / "deepseek-v4-tiny")


def _loaded(folder):
    provider = provider_for(folder)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    return provider, model


def test_replaying_a_recording_reproduces_the_forward_bit_for_bit(tiny):
    ids = random_tokens(seed=3)
    with runtime.parallel(), torch.no_grad():
        provider, model = _loaded(tiny)
        with recording_decisions(model) as decisions:
            recorded_run = provider.token_logprobs(model, ids)
        with replaying_decisions(model, decisions):
            replayed_run = provider.token_logprobs(model, ids)
        free_run = provider.token_logprobs(model, ids)
        deciders = {name for name, m in model.named_modules() if isinstance(m, (Router, Indexer))
                    and not name.startswith("mtp.")}   # MTP runs only with its loss switched on
    assert set(decisions) == deciders and any("indexer" in name for name in deciders)
    assert torch.equal(replayed_run, recorded_run) and torch.equal(free_run, recorded_run)


def test_replayed_experts_are_used_with_the_replaying_models_own_scores(tiny):
    ids = random_tokens(seed=4)
    with runtime.parallel(), torch.no_grad():
        provider, model = _loaded(tiny)
        with recording_decisions(model) as decisions:
            free_run = provider.token_logprobs(model, ids)
        name, router = next((n, m) for n, m in model.named_modules() if isinstance(m, Router) and not m.hash_routed)
        experts = router.weight.shape[0]
        shifted = {**decisions, name: (decisions[name] + 1) % experts}   # every token to other experts
        seen = {}
        handle = router.register_forward_hook(lambda module, args, output: seen.update(output=output))
        with replaying_decisions(model, shifted):
            replayed_run = provider.token_logprobs(model, ids)
        handle.remove()
    logits, weights, indices = seen["output"]
    assert torch.equal(indices, shifted[name])
    scores = torch.nn.functional.softplus(logits.double()).sqrt().gather(1, indices)   # sqrtsoftplus, by hand
    expected = scores / scores.sum(-1, keepdim=True) * router.routed_scaling_factor
    assert max_diff(weights, expected) <= 1e-6   # fp32 vs the fp64 hand computation
    assert max_diff(replayed_run, free_run) > 1e-3   # the replayed experts really ran


def test_replay_refuses_a_recording_of_another_layout_or_length(tiny):
    with runtime.parallel(), torch.no_grad():
        provider, model = _loaded(tiny)
        with recording_decisions(model) as decisions:
            provider.token_logprobs(model, random_tokens(seq=32))
        name = sorted(decisions)[0]
        with pytest.raises(KeyError, match=f"no recorded decision for {name}"):
            with replaying_decisions(model, {k: v for k, v in decisions.items() if k != name}):
                provider.token_logprobs(model, random_tokens(seq=32))
        with pytest.raises(ValueError, match=r"recorded decision has shape \(64, 2\), this forward needs \(96, 2\) \(same batch"):
            with replaying_decisions(model, decisions):
                provider.token_logprobs(model, random_tokens(seq=48))


def test_replay_refuses_an_indexer_pick_of_an_entry_not_complete_at_its_token(tiny):
    """The attention scores only the entries complete at each query, so a replayed pick of a later one (no causal
    indexer makes it) is refused, not dropped: token 0 has no complete entry at all."""
    ids = random_tokens(seed=5)
    with runtime.parallel(), torch.no_grad():
        provider, model = _loaded(tiny)
        with recording_decisions(model) as decisions:
            provider.token_logprobs(model, ids)
        name, indexer = next((n, m) for n, m in model.named_modules() if isinstance(m, Indexer))
        early = decisions[name].clone()
        early[0, 0, 0] = 0
        with pytest.raises(ValueError, match=r"the replayed pick 0 of token 0 in row 0 is a compressed entry not "
                                             rf"complete at that token \(entries before 0 are, at compress ratio "
                                             rf"{indexer.ratio}\); a causal indexer never picks it"):
            with replaying_decisions(model, {**decisions, name: early}):
                provider.token_logprobs(model, ids)
