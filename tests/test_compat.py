"""Each CPU patch of Megatron-Core (modelzoo/compat.py) does its job, and only without CUDA."""

import pytest
import torch

from modelzoo import compat, runtime

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply only without CUDA")


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    with runtime.parallel(tp=1):
        yield


def test_rotary_embedding_stays_on_cpu_and_matches_the_formula():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=100, use_cpu_initialization=True)
    emb = rope(5)
    inv_freq = 1.0 / 100 ** (torch.arange(0, 8, 2).float() / 8)
    angles = torch.arange(5).float()[:, None] * inv_freq[None]
    assert emb.device.type == "cpu" and emb.shape == (5, 1, 1, 8)
    assert torch.equal(emb[:, 0, 0], torch.cat([angles, angles], dim=-1))


def test_default_causal_mask_on_cpu():
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    for function in (utils.get_default_causal_mask, fused_softmax.get_default_causal_mask):
        mask = function(4)
        assert mask.device.type == "cpu"
        assert torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).triu(1))


def test_global_memory_buffer_on_cpu_and_reused():
    from megatron.core.utils import GlobalMemoryBuffer

    buffer = GlobalMemoryBuffer()
    first = buffer.get_tensor((2, 3), torch.float32, "x")
    second = buffer.get_tensor((3, 2), torch.float32, "x")
    assert first.device.type == "cpu" and second.shape == (3, 2)
    assert first.data_ptr() == second.data_ptr()


def test_rng_tracker_forks_a_separate_reproducible_cpu_stream():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(7)
    torch.manual_seed(0)
    with get_cuda_rng_tracker().fork():
        forked = torch.rand(3)
    after_fork = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after_fork, torch.rand(3)), "the fork must leave the default stream untouched"
    model_parallel_cuda_manual_seed(7)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(forked, torch.rand(3)), "the same seed must give the same forked stream"


def test_recompute_replays_dropout_exactly():
    # activation recompute saves and restores the (CPU) generator through the patched state functions
    from megatron.core import tensor_parallel

    x = torch.randn(4, 8, requires_grad=True)

    def layer(t):
        return torch.nn.functional.dropout(t, 0.5, training=True) * 3

    torch.manual_seed(1)
    out = tensor_parallel.checkpoint(layer, False, x)
    out.sum().backward()
    # the dropout mask used in backward equals the forward one: grad is 3 exactly where output kept x
    kept = out != 0
    assert torch.equal(x.grad != 0, kept)


def test_alltoall_dispatcher_builds_without_a_cuda_stream():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=2,
                               moe_router_topk=2, moe_token_dispatcher_type="alltoall", use_cpu_initialization=True)
    dispatcher = MoEAlltoAllTokenDispatcher(num_local_experts=2, local_expert_indices=[0, 1], config=config,
                                            pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    assert dispatcher is not None


def test_dist_checkpointing_round_trip_on_cpu(tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    tensor = torch.randn(4, 3)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", tensor)}, str(tmp_path))
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, str(tmp_path))
    assert torch.equal(loaded["w"], tensor)


def test_cuda_allocations_of_ddp_optimizers_schedules_and_sequence_parallel_land_on_the_cpu():
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import layers, mappings

    for module in (param_and_grad_buffer, megatron_optimizer, clip_grads, schedules, p2p_communication, mappings,
                   layers):
        assert module.torch.zeros(2, device="cuda").device.type == "cpu"
        assert module.torch.tensor([1.0], device=module.torch.cuda.current_device()).device.type == "cpu"
    # the pipeline stages' receive buffers (p2p_communication's torch.empty on current_device()); sends and receives
    # between gloo stages run in tests/test_pipeline_parallel.py
    assert p2p_communication.torch.empty((2, 3), device=p2p_communication.torch.cuda.current_device(),
                                         requires_grad=True).device.type == "cpu"
    p2p_communication.torch.cuda.synchronize()
    stream = param_and_grad_buffer.torch.cuda.current_stream()
    stream.wait_stream(stream)  # nothing to wait for on the CPU
    assert torch.zeros(1).type() == "torch.FloatTensor", "torch itself is untouched"
    # the gradient norm (utils.local_multi_tensor_l2_norm without Apex or Transformer Engine) on the CPU
    assert clip_grads.get_grad_norm_fp32([torch.tensor([3.0]), torch.tensor([4.0])]) == pytest.approx(5.0)


def test_clipping_takes_cpu_gradients_and_type_names_stay_inside_the_call():
    from megatron.core.optimizer import clip_grads

    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([3.0, 4.0])
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=5.0)
    assert torch.allclose(param.grad, torch.tensor([0.6, 0.8]), rtol=1e-6)  # scaled by 1 / (5 + 1e-6)
    assert param.type() == "torch.FloatTensor"


class _Linear(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_ddp_and_megatron_optimizers_step_on_cpu_parameters(dtype, distributed):
    # FP32Optimizer / Float16OptimizerWithFloat16Params / DistributedOptimizer (fp32 and bf16): one clipped Adam
    # step equals torch's AdamW on the fp32 weights (1e-6: the same fp32 math; the 16-bit model copy is those
    # weights rounded to bf16)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    bf16 = dtype == torch.bfloat16
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, bf16=bf16, params_dtype=dtype)
    torch.manual_seed(0)
    module = _Linear(config).to(dtype)
    reference = _Linear(config).to(dtype)
    reference.load_state_dict(module.state_dict())
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True), module)
    assert all(buffer.grad_data.device.type == "cpu" for buffer in ddp.buffers)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=0.1, weight_decay=0.0, clip_grad=0.5, bf16=bf16, use_distributed_optimizer=distributed),
        [ddp])
    x = torch.randn(2, 4).to(dtype)
    ddp(x).float().square().sum().backward()
    finalize_model_grads([ddp])
    succeeded, grad_norm, _ = optimizer.step()

    reference(x).float().square().sum().backward()
    weights = [p.detach().float().requires_grad_() for p in reference.parameters()]
    for weight, param in zip(weights, reference.parameters()):
        weight.grad = param.grad.float()
    expected_norm = torch.nn.utils.clip_grad_norm_(weights, 0.5).item()
    torch.optim.AdamW(weights, lr=0.1, weight_decay=0.0).step()
    assert succeeded and grad_norm == pytest.approx(expected_norm, rel=1e-6) and grad_norm > 0.5
    for param, weight in zip(module.parameters(), weights):
        assert param.dtype == dtype
        torch.testing.assert_close(param, weight.to(dtype), rtol=1e-6, atol=0)


def test_apply_is_a_no_op_with_cuda(monkeypatch):
    monkeypatch.setattr(compat, "_applied", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    called = []
    monkeypatch.setattr(compat, "_patch_rng", lambda: called.append("rng"))
    compat.apply()
    assert called == [] and compat._applied is False
