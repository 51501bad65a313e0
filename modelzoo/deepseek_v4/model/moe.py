"""DeepSeek-V4 MoE block (transformers' DeepseekV4SparseMoeBlock): router, routed experts, shared expert.

    scores  = sqrtsoftplus(x W_gate^T)                              [N, E]
    experts = top-k(scores + correction_bias)    ("moe" layers)
            | tid2eid[input_ids]                 ("hash_moe" layers: a frozen token -> experts table)
    weights = scores[experts] / sum * routed_scaling_factor
    y       = sum_k weights_k * expert_k(x) + shared_expert(x)
    expert(x) = w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))    (no clamp when limit <= 0)

Parallelism. Router and tid2eid: replicated. Shared expert: Megatron column/row-parallel over TP.
Routed experts (`RoutedExperts`, our own grouped module): expert parallelism over Megatron's
expert-model-parallel group (each EP rank holds num_experts/ep experts) and expert tensor
parallelism over the expert-tensor-parallel group (each expert's intermediate dim split).
Dispatch is correctness-first, an all-gather dispatcher: the EP ranks (which may hold different
data) all-gather their tokens, routing ids and weights, each rank runs its local experts over
every gathered token, and a reduce-scatter sums the partial outputs and hands each rank back its
own tokens. Communication is O(ep x tokens x hidden) per layer, not the top-k all-to-all of a
production dispatcher. On each rank the (token, slot) pairs are sorted by expert into padded row
groups and every expert weight is one grouped GEMM over all of them, planned on the device with no
host synchronisation (one per layer under expert parallelism, to size the groups).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from modelzoo.deepseek_v4.config import HASH_MOE, DeepseekV4Args
from modelzoo.deepseek_v4.model.decisions import Decider
from modelzoo.deepseek_v4.model.layers import init_sharded
from modelzoo.layers.fused import fused

SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
}


@dataclasses.dataclass(frozen=True)
class MegatronOrder:
    """Where each token a router sees (its flat [N] order) sits in Megatron's token order, the order of the expert
    ids a RouterReplay records and replays: `places` [N] long (-1: a slot holding no token of the micro-batch, such
    as a row's padding when a model runs packed sequences as rows of their own), `tokens`: the micro-batch's tokens
    in Megatron's order (this CP rank's; the whole sequence's under sequence parallelism)."""

    places: torch.Tensor
    tokens: int

    @classmethod
    def of_batch_first(cls, index: torch.Tensor, batch: int, seq: int) -> MegatronOrder:
        """Slots holding the tokens at `index` (-1: none) of a micro-batch [B, S] read batch-first (b * S + s):
        Megatron's order is sequence-major (s * B + b)."""
        places = (index % seq * batch + index // seq).masked_fill(index < 0, -1)
        return cls(places.flatten(), batch * seq)


class Router(Decider):
    """Learned top-k router with a correction bias, or hash router reading `tid2eid[input_ids]`.

    Rollout routing replay, in the trainers' form: with `moe_enable_routing_replay=True` in the config, each
    router (decoder layers in order, then MTP) registers a Megatron-Core `RouterReplay`, and Megatron's API
    records or replays the expert ids of every token, as SkyRL and miles drive it for Megatron's own MoE:
    `RouterReplay.set_replay_data([ids of layer 0 [tokens, k], ...])` with the ids an inference engine chose,
    then `RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)`. Tokens are in
    Megatron's order (sequence-major for [s, b]; a packed row's tokens as they are; `MegatronOrder` places the
    router's tokens in it where a model lays them out otherwise). Hash layers replay too.
    Under context parallelism a router sees its rank's tokens, as Megatron's own router does: each rank is handed
    its share of the ids, cut like its input ids (`context_parallel.split_for_rank`). Under sequence parallelism
    (`sequence_parallel`) the router runs on the whole sequence, but its RouterReplay records and replays this TP
    rank's s / tp tokens, as Megatron's router sees them and as SkyRL and miles cut the ids; the ranks' replayed ids
    are all-gathered.
    """

    def __init__(self, config, args: DeepseekV4Args, hash_routed: bool, sequence_parallel: bool = False):
        super().__init__()
        self.hash_routed, self.top_k, self.sequence_parallel = hash_routed, args.num_experts_per_tok, sequence_parallel
        self.score_fn = SCORE_FUNCTIONS[args.scoring_func]
        self.routed_scaling_factor = args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size, dtype=config.params_dtype))
        with torch.no_grad():
            config.init_method(self.weight)
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        self.router_replay = None
        if config.moe_enable_routing_replay:
            from megatron.core.transformer.moe.router_replay import RouterReplay

            self.router_replay = RouterReplay()

    def set_layer_number(self, layer_number: int) -> None:
        """As Megatron's TopKRouter: the layer's 1-based number, also on its RouterReplay (SkyRL maps an engine's
        per-layer expert ids to the routers by it)."""
        self.layer_number = layer_number
        if self.router_replay is not None:
            self.router_replay.layer_number = layer_number

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
                padding: torch.Tensor | None = None, order: MegatronOrder | None = None):
        """-> (logits [N, E], weights [N, k], expert ids [N, k]) for the N = B*S tokens.

        `padding` [B, S] bool marks tokens of no sequence: routed to no expert (id -1, weight 0). `order`: where
        the tokens sit in Megatron's order, for routing replay (default: the rows [B, S] are the micro-batch's)."""
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = F.linear(flat, self.weight)
        scores = self.score_fn(logits)
        if self.router_replay is None:
            indices = self.choose(scores, input_ids)
        else:
            batch, seq = hidden_states.shape[:2]
            order = order or MegatronOrder.of_batch_first(torch.arange(batch * seq, device=scores.device), batch, seq)
            indices = self.replayable_choice(scores, input_ids, order)
        if padding is not None:
            indices = indices.masked_fill(padding.reshape(-1, 1), -1)
        indices = self.decide(indices)
        weights = scores.gather(1, indices.clamp(min=0))
        if padding is not None:
            weights = weights.masked_fill(padding.reshape(-1, 1), 0.0)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, indices

    def choose(self, scores: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """The experts of each token [N, k]: the frozen table's for hash layers, else the top-k of the biased scores."""
        if self.hash_routed:
            if input_ids is None:
                raise ValueError("DeepSeek-V4 hash-routed MoE layers need the input_ids (tid2eid[input_ids])")
            return self.tid2eid[input_ids.reshape(-1)].long()
        return torch.topk(scores + self.expert_bias, self.top_k, dim=-1, sorted=False).indices

    def replayable_choice(self, scores: torch.Tensor, input_ids: torch.Tensor | None,
                          order: MegatronOrder) -> torch.Tensor:
        """`choose` through Megatron's RouterReplay, in Megatron's token order (`order`). A token of Megatron's
        order that no slot holds (padding between packed sequences) has scores 0 and, when recorded, experts 0 to
        k - 1; a slot that holds no token gets token 0's ids, which its padding mask then drops."""
        ours = self.choose(scores, input_ids)
        held = order.places >= 0
        places = order.places[held]
        megatron_scores = scores.new_zeros(order.tokens, scores.shape[1]).index_copy(0, places, scores[held])
        megatron_ids = torch.arange(self.top_k, device=ours.device).repeat(order.tokens, 1).index_copy(
            0, places, ours[held])
        tokens, rows = order.tokens, slice(None)
        if self.sequence_parallel:  # this TP rank's tokens: Megatron's sequence dim is the leading one
            group = parallel_state.get_tensor_model_parallel_group()
            share = tokens // dist.get_world_size(group)
            rows = slice(dist.get_rank(group) * share, (dist.get_rank(group) + 1) * share)
            tokens = share

        def choose_in_megatron_order(megatron_scores, top_k, num_groups=None, group_topk=None):
            return None, megatron_ids[rows]

        # positional, as Megatron's TopKRouter calls it: trainers (slime, miles) replace get_replay_topk with
        # functions of their own whose last parameter has another name
        _, indices = self.router_replay.get_replay_topk(megatron_scores[rows], self.top_k, None, None,
                                                        choose_in_megatron_order)
        if indices.shape != (tokens, self.top_k):
            raise ValueError(f"routing replay: {tuple(indices.shape)} expert ids for a layer of {tokens} tokens "
                             f"and top-{self.top_k} routing (want [{tokens}, {self.top_k}])")
        indices = indices.long()
        if self.sequence_parallel:
            every = indices.new_empty((order.tokens, self.top_k))
            dist.all_gather_into_tensor(every, indices.contiguous(), group=group)
            indices = every
        return indices[order.places.clamp(min=0)]


# --- token exchange between ranks -------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits along dim 0; the backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, output_splits: list[int], input_splits: list[int]):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Rows input_splits[r] of x go to rank r; rows output_splits[r] of the result come from rank r."""
    return _AllToAll.apply(x, group, output_splits, input_splits)


def all_gather_rows(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """The ranks' x (sizes[r] rows on rank r) concatenated in rank order; the backward sums every rank's
    gradient of this rank's rows (a reduce-scatter). Through all_to_all_single, which gloo has for any sizes."""
    world = len(sizes)
    return all_to_all(x.repeat(world, *(1,) * (x.dim() - 1)), group, sizes, [x.shape[0]] * world)


def reduce_scatter_rows(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """x [sum(sizes), ...] on every rank -> this rank's rows (sizes[rank] of them) summed over the ranks."""
    world, rank = len(sizes), dist.get_rank(group)
    return all_to_all(x, group, [sizes[rank]] * world, sizes).view(world, sizes[rank], *x.shape[1:]).sum(dim=0)


def _all_gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Plain all-gather of equal-sized tensors (no autograd): counts."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _mark_expert_param(param: nn.Parameter, tp_dim: int) -> nn.Parameter:
    # Megatron conventions: `allreduce=False` keeps expert grads out of the dense data-parallel
    # all-reduce; `tensor_model_parallel`/`partition_dim` describe the expert-tensor-parallel split.
    # `expert_parallel=True` (modelzoo's): dim 0 stacks this EP rank's experts.
    param.allreduce = False
    param.expert_parallel = True
    param.tensor_model_parallel = parallel_state.get_expert_tensor_parallel_world_size() > 1
    param.partition_dim = tp_dim
    param.partition_stride = 1
    return param


DISPATCHERS = ("alltoall", "allgather")


class RoutedExperts(nn.Module):
    """This rank's experts, stacked: w1/w3 [E_local, I_local, hidden], w2 [E_local, hidden, I_local]."""

    def __init__(self, config, args: DeepseekV4Args):
        super().__init__()
        ep = parallel_state.get_expert_model_parallel_world_size()
        etp = parallel_state.get_expert_tensor_parallel_world_size()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if args.num_experts % ep or args.moe_intermediate_size % etp:
            raise ValueError(f"DeepSeek-V4: expert parallel size {ep} must divide n_routed_experts "
                             f"({args.num_experts}) and expert tensor parallel size {etp} must divide "
                             f"moe_intermediate_size ({args.moe_intermediate_size})")
        if tp > 1 and etp != tp:
            raise ValueError(f"DeepSeek-V4: expert tensor parallel size {etp} must equal the tensor parallel size "
                             f"({tp}) when that is above 1 (any size with tensor parallel size 1): the tensor-parallel "
                             f"ranks hold the same tokens, which expert ranks outside their group would count twice")
        if config.moe_token_dispatcher_type not in DISPATCHERS:
            raise ValueError(f"DeepSeek-V4: moe_token_dispatcher_type {config.moe_token_dispatcher_type!r} is not "
                             f"one of {DISPATCHERS}")
        self.dispatcher = config.moe_token_dispatcher_type
        self.num_experts, self.limit = args.num_experts, args.swiglu_limit
        self.num_local = args.num_experts // ep
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.first_expert = self.ep_rank * self.num_local
        # Expert-TP ranks inside the TP group hold the same tokens: each computes its slice of every expert
        # for them and an all-reduce sums the slices. Otherwise (tensor parallel size 1) they hold different
        # tokens, which travel between them as between EP ranks (Megatron's layout).
        self.etp_holds_same_tokens = etp == tp
        self.exchanges_tokens = ep > 1 or not self.etp_holds_same_tokens
        inter, hidden, dtype = args.moe_intermediate_size // etp, args.hidden_size, config.params_dtype
        self.weight1 = _mark_expert_param(nn.Parameter(torch.empty(self.num_local, inter, hidden, dtype=dtype)), 1)
        self.weight3 = _mark_expert_param(nn.Parameter(torch.empty(self.num_local, inter, hidden, dtype=dtype)), 1)
        self.weight2 = _mark_expert_param(nn.Parameter(torch.empty(self.num_local, hidden, inter, dtype=dtype)), 2)
        for weight in (self.weight1, self.weight3, self.weight2):
            init_sharded(weight, config.init_method, "expert-parallel-rng")

    def forward(self, tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """tokens [N, hidden], indices/weights [N, k] of this rank (id -1: routed nowhere) -> routed output [N, hidden]."""
        etp_group = parallel_state.get_expert_tensor_parallel_group()
        if self.etp_holds_same_tokens:  # each expert-TP rank computes a slice of every expert: sum the input gradients
            tokens = tensor_parallel.copy_to_tensor_model_parallel_region(tokens, group=etp_group)
            weights = tensor_parallel.copy_to_tensor_model_parallel_region(weights, group=etp_group)
        if not self.exchanges_tokens:  # EP 1: the expert ids are this rank's
            out = self.weighted_experts(tokens, indices, weights, exact_capacity=False)
        elif self.dispatcher == "alltoall":
            out = self.all_to_all_dispatch(tokens, indices, weights)
        else:
            out = self.all_gather_dispatch(tokens, indices, weights)
        if self.etp_holds_same_tokens:
            out = tensor_parallel.reduce_from_tensor_model_parallel_region(out, group=etp_group)
        return out

    def all_gather_dispatch(self, tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Megatron's "allgather": every rank gathers all the tokens of the ranks that hold different ones, runs its
        experts (its slice of them) over those routed to them, and a reduce-scatter sums the outputs of all ranks and
        hands each its own tokens. Communication: (ranks x tokens) rows each way."""
        group = self.token_group()
        sizes = _all_gather_first_dim(torch.tensor([tokens.shape[0]], device=tokens.device), group).tolist()
        all_tokens = all_gather_rows(tokens, group, sizes)
        all_weights = all_gather_rows(weights, group, sizes)
        all_indices = all_gather_rows(indices, group, sizes)
        out = self.weighted_experts(all_tokens, all_indices - self.first_expert, all_weights, exact_capacity=True)
        return reduce_scatter_rows(out, group, sizes)

    def all_to_all_dispatch(self, tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Megatron's "alltoall": each (token, slot) travels only to the EP rank holding its expert (padding slots
        nowhere), then, with expert tensor parallelism over ranks holding different tokens, is all-gathered over the
        expert-TP group; the outputs return the reverse way (reduce-scatter, all-to-all) and are combined here with
        the routing weights, which never travel. Communication: (top-k x tokens) rows each way."""
        num_tokens, top_k = indices.shape
        ep_group = parallel_state.get_expert_model_parallel_group()
        ep = dist.get_world_size(ep_group)
        # slots sorted by expert, hence by EP rank; padding (id -1) sorts last and is not sent
        experts = indices.reshape(-1)
        order = torch.argsort(torch.where(experts >= 0, experts, self.num_experts), stable=True)
        sorted_experts = experts[order]
        ends = torch.searchsorted(torch.where(sorted_experts >= 0, sorted_experts, self.num_experts),
                                  torch.arange(1, self.num_experts + 1, device=experts.device))
        slots_per_expert = torch.diff(ends, prepend=ends.new_zeros(1))
        # [source EP rank, source expert-TP rank, expert]: how many slots each rank sends to each expert (the one
        # host synchronisation; Megatron's group order is EP-major, expert-TP-minor)
        etp_senders = 1 if self.etp_holds_same_tokens else parallel_state.get_expert_tensor_parallel_world_size()
        etp_rank = 0 if self.etp_holds_same_tokens else parallel_state.get_expert_tensor_parallel_rank()
        table = _all_gather_first_dim(slots_per_expert.unsqueeze(0), self.token_group()).view(
            ep, etp_senders, self.num_experts).cpu()
        send_splits = table[self.ep_rank, etp_rank].view(ep, self.num_local).sum(dim=1).tolist()
        to_me = table[:, :, self.first_expert:self.first_expert + self.num_local]   # [ep, etp_senders, local]
        receive_splits = to_me[:, etp_rank].sum(dim=1).tolist()

        sent = sum(send_splits)
        send_slots = order[:sent]
        # the send-buffer row of each slot (`sent` for padding): the rows that read each token, for the backward
        slot_rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        slot_rows = slot_rows.clamp(max=sent).view(num_tokens, top_k)
        received = all_to_all(gather_rows(tokens, send_slots // top_k, slot_rows), ep_group, receive_splits,
                              send_splits)
        if not self.etp_holds_same_tokens:
            etp_sizes = to_me.sum(dim=(0, 2)).tolist()
            received = all_gather_rows(received, parallel_state.get_expert_tensor_parallel_group(), etp_sizes)
        # rows arrive by (expert-TP rank, EP rank, local expert): their local expert ids follow from the table
        local_experts = torch.arange(self.num_local, device=tokens.device).repeat(ep * etp_senders)
        local_experts = local_experts.repeat_interleave(to_me.transpose(0, 1).reshape(-1).to(tokens.device),
                                                        output_size=received.shape[0])
        expert_output, row_of, slot_of_row = self.grouped_experts(received, local_experts.unsqueeze(1),
                                                                  exact_capacity=False)
        out = gather_rows(expert_output, row_of.view(-1), slot_of_row.unsqueeze(1))   # back to arrival order
        if not self.etp_holds_same_tokens:
            out = reduce_scatter_rows(out, parallel_state.get_expert_tensor_parallel_group(), etp_sizes)
        returned = all_to_all(out, ep_group, send_splits, receive_splits)
        # row `sent`: a zero row for the padding slots (weight 0), which hold no row
        return combine_slots(F.pad(returned, (0, 0, 0, 1)), weights.to(returned.dtype), slot_rows,
                             F.pad(send_slots, (0, 1), value=experts.numel()))

    def token_group(self):
        """The ranks whose tokens differ and are exchanged: the EP group, times the expert-TP group when that holds
        different tokens too."""
        if self.etp_holds_same_tokens:
            return parallel_state.get_expert_model_parallel_group()
        return parallel_state.get_expert_tensor_and_model_parallel_group()

    def weighted_experts(self, tokens: torch.Tensor, local_experts: torch.Tensor, weights: torch.Tensor,
                         exact_capacity: bool) -> torch.Tensor:
        """sum_k weights * expert(tokens) over the slots whose local expert id [T, k] is one of this rank's; other
        slots (another rank's experts, padding) weigh 0."""
        mine = (local_experts >= 0) & (local_experts < self.num_local)
        expert_output, slot_rows, row_slots = self.grouped_experts(
            tokens, torch.where(mine, local_experts, self.num_local), exact_capacity)
        # a foreign slot reads any row (its weight is 0, so it takes no gradient either)
        slot_weights = torch.where(mine, weights, 0).to(expert_output.dtype)
        return combine_slots(expert_output, slot_weights, slot_rows.clamp(max=expert_output.shape[0] - 1), row_slots)

    def grouped_experts(self, tokens: torch.Tensor, local_experts: torch.Tensor, exact_capacity: bool):
        """Each slot's expert applied to its token, one grouped GEMM per weight.

        local_experts [T, k]: this rank's expert of each slot, `num_local` for none. Returns expert_output [R, hidden],
        slot_rows [T, k] (the output row of each slot, R for none) and row_slots [R] (the slot each row holds, T*k
        for the padding rows of the groups); see `_dispatch_plan`.
        """
        rows, slot_rows, row_slots, group_ends = _dispatch_plan(local_experts, self.num_local, exact_capacity)
        # row `len(tokens)`: the zero padding row, read by no slot
        token_readers = F.pad(slot_rows, (0, 0, 0, 1), value=rows.numel())
        expert_input = gather_rows(F.pad(tokens, (0, 0, 0, 1)), rows, token_readers)
        gate = grouped_linear(expert_input, self.weight1, group_ends)
        up = grouped_linear(expert_input, self.weight3, group_ends)
        return grouped_linear(clamped_swiglu(gate, up, self.limit), self.weight2, group_ends), slot_rows, row_slots
# Rows of each expert's group are padded to a multiple of this: the bf16 grouped GEMM's weight
# gradient contracts over the rows of a group and needs each group's offset 16-byte aligned (a
# multiple of 8 bf16 rows); 16 rows covers that with room.
GROUP_ALIGNMENT = 16


def _dispatch_plan(experts: torch.Tensor, num_experts: int, exact_capacity: bool):
    """Where each (token, slot) goes in the grouped expert input, computed on the device without host syncs.

    experts [T, k]: local expert id per slot, `num_experts` for a slot another rank serves. Returns
    rows [R] (the token each grouped row reads; T = the zero row), slot_rows [T, k] (the row holding each
    slot's output; R for foreign slots), row_slots [R] (the flat slot each row holds; T*k for padding rows)
    and group_ends [E] int32 (exclusive end row of each expert's group, none empty; the last group also
    takes the unused tail, zero rows). R is static (T*k plus the padding bound) unless `exact_capacity`
    (expert parallelism, where most slots are foreign).
    """
    num_tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    slots = flat.numel()
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))[:num_experts]
    # at least one aligned block per expert, so that no group is empty (fits: ceil(c/16)*16 <= c + 16)
    padded = ((counts + GROUP_ALIGNMENT - 1) // GROUP_ALIGNMENT).clamp(min=1) * GROUP_ALIGNMENT
    padded_ends = padded.cumsum(0)
    local_slots = int(counts.sum()) if exact_capacity else slots
    capacity = local_slots + num_experts * GROUP_ALIGNMENT
    # stable sort: within an expert, slots keep token order (like transformers' per-expert loop)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # per expert: its first position in sorted order and its first row (the foreign bucket's 0s only
    # keep the lookup in range: its slots all go to the junk row `capacity`, dropped below)
    first_sorted = F.pad(counts.cumsum(0) - counts, (0, 1))
    first_row = F.pad(padded_ends - padded, (0, 1))
    row_of_sorted = torch.where(sorted_experts == num_experts, capacity, first_row[sorted_experts]
                                + torch.arange(slots, device=flat.device) - first_sorted[sorted_experts])
    slot_rows = torch.empty_like(flat).scatter_(0, order, row_of_sorted)
    slot_ids = torch.arange(slots, device=flat.device)
    rows = torch.full((capacity + 1,), num_tokens, dtype=torch.long, device=flat.device)
    rows = rows.scatter_(0, slot_rows, slot_ids // top_k)[:capacity]
    row_slots = torch.full((capacity + 1,), slots, dtype=torch.long, device=flat.device)
    row_slots = row_slots.scatter_(0, slot_rows, slot_ids)[:capacity]
    # the last group ends at `capacity` (a fill, not an item assignment: no host-to-device copy under CUDA graphs)
    group_ends = F.pad(padded_ends[:-1], (0, 1), value=capacity).to(torch.int32)
    return rows, slot_rows.view(num_tokens, top_k), row_slots, group_ends


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, source: torch.Tensor, index: torch.Tensor, readers: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(readers)
        return source.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (readers,) = ctx.saved_tensors
        return _sum_of_readers(grad, readers), None, None


@fused
def _sum_of_readers(grad: torch.Tensor, readers: torch.Tensor) -> torch.Tensor:
    rows = F.pad(grad, (0, 0, 0, 1)).index_select(0, readers.reshape(-1))  # row len(grad): zeros
    return rows.view(*readers.shape, -1).sum(dim=1)


def gather_rows(source: torch.Tensor, index: torch.Tensor, readers: torch.Tensor) -> torch.Tensor:
    """source[index], with the backward a gather as well: readers [len(source), m] lists the output rows
    that read each source row (len(index) for none).

    index_select's own backward is an index_add, atomic adds of bf16 rows that took ~0.5 ms per use at
    4k tokens x top-6 on a GPU; knowing each row's readers turns it into a gather and a sum over m (and
    makes it deterministic).
    """
    return _GatherRows.apply(source, index, readers)


class _CombineSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_output, slot_weights, slot_rows, row_slots):
        ctx.save_for_backward(expert_output, slot_weights, slot_rows, row_slots)
        return _weighted_slot_sum(expert_output, slot_weights, slot_rows)

    @staticmethod
    def backward(ctx, grad):
        expert_output, slot_weights, slot_rows, row_slots = ctx.saved_tensors
        return (_row_gradients(grad, slot_weights, row_slots), _slot_weight_gradients(grad, expert_output, slot_rows),
                None, None)


@fused
def _weighted_slot_sum(expert_output, slot_weights, slot_rows):
    return (expert_output[slot_rows] * slot_weights.unsqueeze(-1)).sum(dim=1)


@fused
def _row_gradients(grad, slot_weights, row_slots):
    """Row r holds slot row_slots[r] (token row_slots[r] // k); padding rows (slot T*k) read the zero row."""
    top_k = slot_weights.shape[1]
    token_grads = F.pad(grad, (0, 0, 0, 1))[row_slots // top_k]
    return token_grads * F.pad(slot_weights.reshape(-1), (0, 1))[row_slots].unsqueeze(-1)


@fused
def _slot_weight_gradients(grad, expert_output, slot_rows):
    return (grad.unsqueeze(1) * expert_output[slot_rows]).sum(dim=-1)


def combine_slots(expert_output: torch.Tensor, slot_weights: torch.Tensor, slot_rows: torch.Tensor,
                  row_slots: torch.Tensor) -> torch.Tensor:
    """sum_k slot_weights[t, k] * expert_output[slot_rows[t, k]] -> [T, hidden], one fused kernel each way.

    expert_output [R, hidden]; slot_weights, slot_rows [T, k]; row_slots [R] the slot each row holds
    (T*k for padding rows), so the backward is gathers too: a row's gradient is its one slot's token
    gradient times the slot's weight (autograd's would be unfused broadcast products, sums and an index_add).
    """
    return _CombineSlots.apply(expert_output, slot_weights, slot_rows, row_slots)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """Row group e of x [R, in] (rows group_ends[e-1]..group_ends[e]) times weight[e]^T ([E, out, in]) -> [R, out].

    One grouped GEMM on a GPU in bf16 (`torch._grouped_mm`); elsewhere one linear per group (the
    CPU parity path: the same products, no alignment rules).
    """
    if x.is_cuda and x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=group_ends)
    starts = [0, *group_ends.tolist()[:-1]]
    # unbind: one backward that stacks the E gradients (indexing weight[e] would write a zero-filled [E, out, in]
    # gradient per expert: E^2 the weights' size, most of a CPU step at 16 experts)
    return torch.cat([F.linear(x[start:end], expert_weight) for expert_weight, start, end in
                      zip(weight.unbind(0), starts, group_ends.tolist(), strict=True)])


class SharedExpert(nn.Module):
    """The always-on expert: gate/up column-parallel, down row-parallel, same clamps as the routed ones."""

    def __init__(self, config, args: DeepseekV4Args):
        super().__init__()
        hidden, inter = args.hidden_size, args.moe_intermediate_size
        self.limit = args.swiglu_limit
        column = dict(config=config, init_method=config.init_method, bias=False, gather_output=False)
        self.linear_fc1_gate = ColumnParallelLinear(hidden, inter, **column)
        self.linear_fc1_up = ColumnParallelLinear(hidden, inter, **column)
        self.linear_fc2 = RowParallelLinear(inter, hidden, config=config, init_method=config.output_layer_init_method,
                                            bias=False, input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(clamped_swiglu(self.linear_fc1_gate(x)[0], self.linear_fc1_up(x)[0], self.limit))[0]


@fused
def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit). A limit <= 0 means no clamp, as in DeepSeek's own
    inference code (`if self.swiglu_limit > 0`); transformers clamps at it anyway, so at 0 every expert is zero."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class DeepseekV4MoE(nn.Module):
    def __init__(self, config, args: DeepseekV4Args, mlp_type: str, sequence_parallel: bool = False):
        """`config`: for the whole sequence (the experts run on it); `sequence_parallel`: whether the model's."""
        super().__init__()
        self.router = Router(config, args, hash_routed=mlp_type == HASH_MOE, sequence_parallel=sequence_parallel)
        self.experts = RoutedExperts(config, args)
        self.shared_experts = SharedExpert(config, args)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
                padding: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq_len, hidden = hidden_states.shape
        _, weights, indices = self.router(hidden_states, input_ids, padding)
        routed = self.experts(hidden_states.view(-1, hidden), indices, weights).view(batch, seq_len, hidden)
        return routed + self.shared_experts(hidden_states)
