"""Routing replay for DeepSeek-V4.1 (Megatron-Core's RouterReplay API, as SkyRL and miles drive it; the trainers'
own code runs it in tests/trainers/test_trainers.py) when the model lays the tokens out otherwise than the batch.

A packed or padded batch runs each sequence as a right-padded row of its own (`each_sequence`), so the tokens a
router sees are not in the batch's order: the router is told where each of its tokens sits in Megatron's order
(`MegatronOrder`). The oracle is each sequence run alone as a plain row, whose routers see the tokens in order
(`each_sequence` gives a sequence exactly what it would get alone, so the choices are the same ones).
"""

from __future__ import annotations

import pytest
import torch
from dsv41_helpers import V41_TINY, random_rows
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from modelzoo import build_provider, runtime
from modelzoo.deepseek_v4.model.decisions import recording_decisions
from modelzoo.layers.sequences import pack_sequences

LENGTHS = (17, 40, 5)


@pytest.fixture
def model():
    RouterReplay.clear_global_router_replay_instances()
    with runtime.parallel(), torch.no_grad():
        provider = build_provider(V41_TINY, moe_enable_routing_replay=True)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        yield model
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_router_replay_instances()


def _recorded(model, *args, **kwargs) -> list[torch.Tensor]:
    """Each decoder layer's recorded ids [tokens, k] of one forward, in Megatron's token order."""
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    model(*args, **kwargs)
    recorded = RouterReplay.get_recorded_data()[:len(model.decoder.layers)]
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()
    return [ids.clone() for ids in recorded]


def _sequences() -> list[torch.Tensor]:
    return [random_rows(1, length, seed=30 + number)[0] for number, length in enumerate(LENGTHS)]


def test_a_packed_row_records_each_sequences_own_choices_at_its_places(model):
    sequences = _sequences()
    batch = pack_sequences([sequence.tolist() for sequence in sequences], divisor=8)
    assert batch.input_ids.shape[1] > sum(LENGTHS)  # slot padding between the sequences
    packed = _recorded(model, batch.input_ids, packed_seq_params=batch.packed_seq_params)
    for sequence, start, length in zip(sequences, batch.offsets, batch.lengths):
        alone = _recorded(model, sequence[None])
        for layer, (ours, theirs) in enumerate(zip(packed, alone, strict=True)):
            assert torch.equal(ours[start:start + length], theirs), (layer, start)


def test_a_padded_batch_records_in_megatrons_sequence_major_order(model):
    rows = random_rows(2, 24, seed=40)
    lengths = (24, 15)
    padding = torch.zeros(2, 1, 1, 24, dtype=torch.bool)  # GPTModel's mask: True = padding
    padding[1, ..., lengths[1]:] = True
    padded = _recorded(model, rows, attention_mask=padding)
    for row, length in enumerate(lengths):
        alone = _recorded(model, rows[row:row + 1, :length])
        for layer, (ours, theirs) in enumerate(zip(padded, alone, strict=True)):
            assert torch.equal(ours.view(24, 2, -1)[:length, row], theirs), (layer, row)  # token s of row b: s * 2 + b


def test_replayed_ids_reach_each_token_of_a_packed_row(model):
    batch = pack_sequences([sequence.tolist() for sequence in _sequences()], divisor=8)
    tokens, routers = batch.input_ids.shape[1], [layer.mlp.router for layer in model.decoder.layers]
    generator = torch.Generator().manual_seed(2)
    experts, top_k = routers[0].weight.shape[0], routers[0].top_k
    engine = [torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
              for _ in routers]
    RouterReplay.set_replay_data(engine + [torch.zeros_like(engine[0])] * len(model.mtp.layers))
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with recording_decisions(model) as used:
        model(batch.input_ids, packed_seq_params=batch.packed_seq_params)
    RouterReplay.clear_global_router_replay_action()
    longest = max(LENGTHS)
    for layer, ids in enumerate(engine):
        rows = used[f"decoder.layers.{layer}.mlp.router"].view(len(LENGTHS), longest, top_k)  # a row per sequence
        for number, (start, length) in enumerate(zip(batch.offsets, batch.lengths)):
            assert torch.equal(rows[number, :length], ids[start:start + length]), (layer, number)
            assert (rows[number, length:] == -1).all(), (layer, number)  # the row's padding: no expert
