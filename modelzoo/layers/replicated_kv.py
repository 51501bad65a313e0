"""A fused QKV projection that holds copies of a key/value head when there are fewer KV heads than TP ranks.

Megatron-Core splits linear_qkv by query groups, one KV head each, so it needs TP to divide the KV heads. With
fewer KV heads than ranks, the model is built with one group per rank (`num_query_groups = tp`): each rank holds
its query heads and a copy of the KV head they read, as vLLM and Megatron-LM's GQA replication do; the weight
mapping's `FusedQKV` writes the copies on import and reads the first on export.

    rank r of tp, with K KV heads:   rows [its tp-th of the query heads; k_g; v_g],  g = r // (tp / K)

Forward is then plain column-parallel math. Backward: the input gradient is summed over all ranks by the linear
itself (each copy adds the part of its own query heads), but each copy's weight gradient holds only its own query
heads' part: `QKVParallelLinear` sums the K/V rows of the weight gradient over the ranks that share a KV head,
so the copies get the gradient of the one HF KV head and stay equal under any optimizer. In torch_dist a copy
is stored once (the others are replicas), in the layout of a model without copies, so a checkpoint reshards
between TP sizes with and without copies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel import ColumnParallelLinear


class _SumKVRowsOfGradient(torch.autograd.Function):
    """Identity on the weight; its backward sums the K/V rows of the weight gradient over the TP ranks that hold
    copies of the same KV head (one all-reduce over the TP group of a [kv_heads, kv rows] buffer, each rank
    adding into its head's slot)."""

    @staticmethod
    def forward(ctx, weight, q_rows: int, kv_head: int, num_kv_heads: int, group):
        ctx.q_rows, ctx.kv_head, ctx.num_kv_heads, ctx.group = q_rows, kv_head, num_kv_heads, group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        q_grad, kv_grad = grad[: ctx.q_rows], grad[ctx.q_rows:]
        slots = kv_grad.new_zeros(ctx.num_kv_heads, *kv_grad.shape)
        slots[ctx.kv_head] = kv_grad
        dist.all_reduce(slots, group=ctx.group)
        return torch.cat([q_grad, slots[ctx.kv_head]]), None, None, None, None


class QKVParallelLinear(ColumnParallelLinear):
    """linear_qkv that may hold a copy of a KV head (see the module docstring); a plain ColumnParallelLinear when
    the TP size divides the KV heads. `num_kv_heads`: the model's KV heads (the config's `num_query_groups` is
    the TP size when they are copied)."""

    def __init__(self, input_size: int, output_size: int, *, config, num_kv_heads: int, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        groups = config.num_query_groups
        self.kv_copies = groups // num_kv_heads if groups > num_kv_heads else 1
        if self.kv_copies == 1:
            return
        if groups != tp or groups % num_kv_heads:
            raise ValueError(f"linear_qkv with {num_kv_heads} KV heads at TP {tp}: copies of KV heads need one query "
                             f"group per rank (num_query_groups {groups}) and a TP size that is a multiple of the KV heads")
        if config.gradient_accumulation_fusion:
            raise ValueError("gradient_accumulation_fusion adds linear_qkv's weight gradient into main_grad before the "
                             "sum over copies of its KV heads: not supported with fewer KV heads than TP ranks")
        self.num_kv_heads = num_kv_heads
        self.kv_head, self.copy = divmod(parallel_state.get_tensor_model_parallel_rank(), self.kv_copies)
        self.head_dim = config.kv_channels
        self.q_rows = self.weight.shape[0] - 2 * self.head_dim
        if config.perform_initialization and self.weight.device.type != "meta":
            self._make_copies_equal()

    @torch.no_grad()
    def _make_copies_equal(self) -> None:
        """Initialisation draws every rank's rows apart: the copies take the first one's K/V rows."""
        slots = self.weight.new_zeros(self.num_kv_heads, *self.weight[self.q_rows:].shape)
        if self.copy == 0:
            slots[self.kv_head] = self.weight[self.q_rows:]
        dist.all_reduce(slots, group=self.tp_group)
        self.weight[self.q_rows:] = slots[self.kv_head]

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.kv_copies > 1 and weight is None and self.weight.requires_grad and torch.is_grad_enabled():
            weight = _SumKVRowsOfGradient.apply(self.weight, self.q_rows, self.kv_head, self.num_kv_heads,
                                                self.tp_group)
        return super().forward(input_, weight, runtime_gather_output)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.kv_copies > 1:
            state[f"{prefix}weight"] = self._stored_without_copies(state[f"{prefix}weight"], sharded_offsets)
        return state

    def _stored_without_copies(self, sharded: ShardedTensor, sharded_offsets: tuple) -> ShardedTensorFactory:
        """The weight as head-sized row pieces at their place in the layout of a model without copies (query
        heads of KV head g, then k_g, v_g, for each g): this rank's query heads, and k and v as replicas unless
        this is the first copy. Loading concatenates the pieces back."""
        d, axis = self.head_dim, len(sharded_offsets)
        q_heads = self.q_rows // d
        group_heads = q_heads * self.kv_copies + 2  # of a group without copies
        first = self.kv_head * group_heads + self.copy * q_heads
        places = [first + head for head in range(q_heads)] + [(self.kv_head + 1) * group_heads - 2,
                                                             (self.kv_head + 1) * group_heads - 1]
        total = self.num_kv_heads * group_heads

        def build(key, tensor, replica_id, flattened_range):
            kv_replica = (self.copy, *replica_id[1:])
            return [ShardedTensor.from_rank_offsets(
                        key, tensor[index * d:(index + 1) * d], *sharded_offsets, (axis, place, total),
                        replica_id=replica_id if index < q_heads else kv_replica, prepend_axis_num=axis)
                    for index, place in enumerate(places)]

        return ShardedTensorFactory(sharded.key, sharded.data, build, torch.cat, sharded.replica_id)
