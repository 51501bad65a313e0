"""Context parallelism: the tokens of each row spread over the ranks of Megatron's context-parallel (CP) group.

Megatron's layout (`megatron.core.utils.get_batch_on_this_cp_rank`), which a trainer that splits its batch for CP
hands over: each sequence is cut into 2 x CP equal chunks and rank r holds chunks r and 2 x CP - 1 - r, so that
every rank has as much causal attention to compute. Plain rows [b, s] are cut as one sequence each; in a packed
(THD) row each sequence's slot (`cu_seqlens_q_padded`, a multiple of 2 x CP) is cut on its own, and the
`packed_seq_params` a rank receives still describe the whole row.

    local_ids = split_for_rank(input_ids, packed_seq_params)      # also labels, loss_mask, position_ids
    loss = model(local_ids, local_position_ids, None, labels=local_labels, packed_seq_params=packed_seq_params)
    whole = gather_from_ranks(per_token_values, packed_seq_params)  # [b, s, ...] in row order, on every rank

A model attends with this rank's queries over the keys and values of every rank (`gather_keys_values`: an
all-gather forward, a reduce-scatter of their gradients backward), masked by the batch's `TokenLayout`, whose
`keys` describe every rank's tokens. What every rank computes from the whole rows (summaries pooled over windows
of tokens) reads per-token tensors gathered in row order (`gather_in_row_order`, gradients summed back over the
group). Memory for keys and values is O(s) per rank; logits and the per-token loss
stay with the rank's own tokens. Parameter gradients are each rank's share: they are summed over the data-parallel
group with context parallelism (Megatron's DDP does it, `with_context_parallel=True`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from modelzoo.layers.sequences import ContextParallel, KeyTokens, context_parallel_indices, pack_sequences, row_slots


def current() -> ContextParallel | None:
    """This rank's place in Megatron's context-parallel group, or None without context parallelism."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return None
    return ContextParallel(parallel_state.get_context_parallel_group(), size, parallel_state.get_context_parallel_rank())


def _this_rank(context_parallel: ContextParallel | None) -> ContextParallel | None:
    return context_parallel if context_parallel is not None else current()


def split_for_rank(tensor: Tensor | None, packed_seq_params=None,
                   context_parallel: ContextParallel | None = None) -> Tensor | None:
    """This CP rank's tokens of a [b, s, ...] tensor (input ids, labels, loss mask, position ids), in Megatron's
    layout; the tensor itself without context parallelism (or when it is None)."""
    context_parallel = _this_rank(context_parallel)
    if tensor is None or context_parallel is None:
        return tensor
    slots = row_slots(tensor.shape[1], packed_seq_params)
    index = context_parallel_indices(slots, context_parallel.size, context_parallel.rank, tensor.device)
    return tensor.index_select(1, index)


def rows_as_packed(input_ids: Tensor, position_ids: Tensor | None = None,
                   context_parallel: ContextParallel | None = None):
    """Rows [b, s] that the CP ranks cannot split evenly (s no multiple of 2 x CP) as one packed row, each row a
    sequence in a slot padded to a multiple of 2 x CP: (`PackedBatch`, the position ids packed alike or None); None
    when the rows split as they are (or without context parallelism). Padding appended to a row would be read as
    tokens of its sequence: causal attention never reads it, but a model that pools windows of tokens would pool it
    with them; packed, it belongs to no sequence."""
    context_parallel = _this_rank(context_parallel)
    if context_parallel is None or input_ids.shape[1] % (2 * context_parallel.size) == 0:
        return None
    divisor = 2 * context_parallel.size
    batch = pack_sequences(input_ids.tolist(), divisor=divisor, device=input_ids.device)
    if position_ids is None:
        return batch, None
    positions = pack_sequences(position_ids.expand_as(input_ids).tolist(), divisor=divisor).input_ids
    return batch, positions.to(position_ids.device)


def gather_from_ranks(local: Tensor, packed_seq_params=None, context_parallel: ContextParallel | None = None) -> Tensor:
    """Every CP rank's [b, s / CP, ...] share of a per-token tensor -> the whole [b, s, ...] in row order, on every
    rank (collective). Its backward hands each rank the gradient of its own share: each rank holds the same whole
    tensor, and its loss reaches the other ranks' tokens through their own graphs."""
    context_parallel = _this_rank(context_parallel)
    if context_parallel is None:
        return local
    return _GatherTokens.apply(local, packed_seq_params, context_parallel)


class _GatherTokens(torch.autograd.Function):

    @staticmethod
    def forward(ctx, local, packed_seq_params, context_parallel):
        size = context_parallel.size
        slots = row_slots(local.shape[1] * size, packed_seq_params)
        order = torch.cat([context_parallel_indices(slots, size, rank, local.device) for rank in range(size)])
        gathered = _all_gather(local, 1, context_parallel.group, size)
        whole = torch.empty_like(gathered)
        whole[:, order] = gathered
        ctx.mine = context_parallel_indices(slots, size, context_parallel.rank, local.device)
        return whole

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(1, ctx.mine), None, None


def gather_in_row_order(local: Tensor, keys: KeyTokens) -> Tensor:
    """Every CP rank's [b, s / CP, ...] share of a per-token tensor -> the whole [b, s, ...] in row order, on every
    rank (collective; `keys` is the layout's `context_parallel_keys`). For what every rank computes from the whole
    rows (summaries pooled over windows of tokens): backward, each rank receives the sum over the group of its tokens'
    gradients (a reduce-scatter), since every rank's loss reads every token through its own copy."""
    context_parallel = keys.context_parallel
    in_key_order = _GatherSequence.apply(local, context_parallel.group, context_parallel.size, 1)
    return in_key_order[:, keys.index.argsort()]


def sum_over_group(value: Tensor, context_parallel: ContextParallel) -> Tensor:
    """A value (a count, a normaliser; no gradient) summed over the CP group, on every rank."""
    total = value.detach().clone()
    dist.all_reduce(total, group=context_parallel.group)
    return total


def gather_keys_values(key: Tensor, value: Tensor, context_parallel: ContextParallel) -> tuple[Tensor, Tensor]:
    """Keys and values [b, heads, s / CP, d] of every CP rank -> [b, heads, s, d], rank after rank (the order of
    the layout's `keys`). Backward: each rank receives the sum over the group of its tokens' gradients."""
    return gather_keys(key, context_parallel), gather_keys(value, context_parallel)


def gather_keys(tensor: Tensor, context_parallel: ContextParallel) -> Tensor:
    """One [b, heads, s / CP, d] tensor of every CP rank -> [b, heads, s, d], as `gather_keys_values`."""
    return _GatherSequence.apply(tensor, context_parallel.group, context_parallel.size, 2)


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` forward, reduce-scatter along it backward (Megatron's sequence-parallel gather,
    `gather_from_sequence_parallel_region`, for tensors that are not sequence-first)."""

    @staticmethod
    def forward(ctx, tensor, group, size, dim):
        ctx.group, ctx.size, ctx.dim = group, size, dim
        return _all_gather(tensor, dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        chunks = grad.movedim(ctx.dim, 0).contiguous()
        mine = chunks.new_empty(chunks.shape[0] // ctx.size, *chunks.shape[1:])
        dist.reduce_scatter_tensor(mine, chunks, group=ctx.group)
        return mine.movedim(0, ctx.dim), None, None, None


def _all_gather(tensor: Tensor, dim: int, group, size: int) -> Tensor:
    first = tensor.movedim(dim, 0).contiguous()
    gathered = first.new_empty(first.shape[0] * size, *first.shape[1:])
    dist.all_gather_into_tensor(gathered, first, group=group)
    return gathered.movedim(0, dim)
