"""Initialisation of DeepSeek-V4's own sharded parameters (wo_a groups, routed experts): each rank's shard
is drawn from Megatron's per-rank RNG stream, so shards differ across ranks and replicas do not."""

import pytest
import torch

from modelzoo import runtime
from modelzoo.deepseek_v4.model.layers import init_sharded
from modelzoo.registry import build_provider

TINY = "tiny_checkpoints/deepseek-v4-tiny"


def _layer_weights(rank: int, tp: int, ep: int) -> dict:
    with runtime.parallel(tp=tp, ep=ep):
        model = build_provider(TINY).provide()
        layer = model.decoder.layers[1]
        return {"experts": layer.mlp.experts.weight1.detach().clone(),
                "wo_a": layer.self_attention.linear_o_down_proj.weight.detach().clone()}


@pytest.mark.parametrize("tp, ep, differ", [(2, 1, {"experts", "wo_a"}), (1, 2, {"experts"})])
def test_each_rank_draws_its_own_shard(tp, ep, differ):
    """TP=2: both are split (experts along their intermediate dim), so the two halves differ. EP=2: each
    rank holds different experts; wo_a is a data-parallel replica and must be the same on both."""
    first, second = runtime.spawn(_layer_weights, 2, tp, ep)
    assert {name for name in first if not torch.equal(first[name], second[name])} == differ


@pytest.mark.gpu
def test_on_a_gpu_the_values_come_from_the_forked_cuda_generator():
    """With CUDA, Megatron's tracker forks the CUDA generator: a CPU-built shard must take its values from
    that stream (what a draw on the GPU under the fork gives), and the CPU generator must not move."""
    from megatron.core import tensor_parallel

    with runtime.parallel():
        tracker = tensor_parallel.get_cuda_rng_tracker()
        states = tracker.get_states()
        expected = torch.empty(64, 32, device="cuda")
        with tracker.fork("model-parallel-rng"):
            torch.nn.init.normal_(expected)
        tracker.set_states(states)
        cpu_state = torch.get_rng_state()
        param = torch.empty(64, 32)
        init_sharded(param, torch.nn.init.normal_, "model-parallel-rng")
        assert torch.equal(param, expected.cpu())
        assert torch.equal(torch.get_rng_state(), cpu_state)
