"""DeepSeek-V4 MoE block (transformers' DeepseekV4SparseMoeBlock): router, routed experts, shared expert.

    scores  = sqrtsoftplus(x W_gate^T)                              [N, E]
    experts = top-k(scores + correction_bias)    ("moe" layers)
            | tid2eid[input_ids]                 ("hash_moe" layers: a frozen token -> experts table)
    weights = scores[experts] / sum * routed_scaling_factor
    y       = sum_k weights_k * expert_k(x) + shared_expert(x)
    expert(x) = w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))

Parallelism. Router and tid2eid: replicated. Shared expert: Megatron column/row-parallel over TP.
Routed experts (`RoutedExperts`, our own grouped module): expert parallelism over Megatron's
expert-model-parallel group (each EP rank holds num_experts/ep experts) and expert tensor
parallelism over the expert-tensor-parallel group (each expert's intermediate dim split).
Dispatch is correctness-first, an all-gather dispatcher: the EP ranks (which may hold different
data) all-gather their tokens, routing ids and weights, each rank runs its local experts over
every gathered token, and a reduce-scatter sums the partial outputs and hands each rank back its
own tokens. Communication is O(ep x tokens x hidden) per layer, not the top-k all-to-all of a
production dispatcher.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from modelzoo.deepseek_v4.config import HASH_MOE, DeepseekV4Args
from modelzoo.deepseek_v4.model.decisions import Decider
from modelzoo.deepseek_v4.model.layers import init_sharded

SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
}


class Router(Decider):
    """Learned top-k router with a correction bias, or hash router reading `tid2eid[input_ids]`."""

    def __init__(self, config, args: DeepseekV4Args, hash_routed: bool):
        super().__init__()
        self.hash_routed, self.top_k = hash_routed, args.num_experts_per_tok
        self.score_fn = SCORE_FUNCTIONS[args.scoring_func]
        self.routed_scaling_factor = args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size, dtype=config.params_dtype))
        with torch.no_grad():
            config.init_method(self.weight)
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None):
        """-> (logits [N, E], weights [N, k], expert ids [N, k]) for the N = B*S tokens."""
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = F.linear(flat, self.weight)
        scores = self.score_fn(logits)
        if self.hash_routed:
            if input_ids is None:
                raise ValueError("DeepSeek-V4 hash-routed MoE layers need the input_ids (tid2eid[input_ids])")
            indices = self.tid2eid[input_ids.reshape(-1)].long()
        else:
            indices = torch.topk(scores + self.expert_bias, self.top_k, dim=-1, sorted=False).indices
        indices = self.decide(indices)
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, indices


# --- expert-parallel collectives (CPU/gloo-safe: gloo has no reduce-scatter) ----------------------
def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if dist.get_backend(group) == "nccl":
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out
    total = x.clone().contiguous()
    dist.all_reduce(total, group=group)
    return total.chunk(world)[dist.get_rank(group)].contiguous()


def _all_gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


class _GatherTokens(torch.autograd.Function):
    """forward: all-gather along dim 0 over `group`; backward: reduce-scatter (sum of every rank's use)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first_dim(grad, ctx.group), None


class _ScatterTokens(torch.autograd.Function):
    """forward: reduce-scatter along dim 0 over `group`; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_first_dim(grad, ctx.group), None


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


class RoutedExperts(nn.Module):
    """This rank's experts, stacked: w1/w3 [E_local, I_local, hidden], w2 [E_local, hidden, I_local]."""

    def __init__(self, config, args: DeepseekV4Args):
        super().__init__()
        ep = parallel_state.get_expert_model_parallel_world_size()
        etp = parallel_state.get_expert_tensor_parallel_world_size()
        if args.num_experts % ep or args.moe_intermediate_size % etp:
            raise ValueError(f"DeepSeek-V4: expert parallel size {ep} must divide n_routed_experts "
                             f"({args.num_experts}) and expert tensor parallel size {etp} must divide "
                             f"moe_intermediate_size ({args.moe_intermediate_size})")
        self.num_experts, self.limit = args.num_experts, args.swiglu_limit
        self.num_local = args.num_experts // ep
        self.first_expert = parallel_state.get_expert_model_parallel_rank() * self.num_local
        inter, hidden, dtype = args.moe_intermediate_size // etp, args.hidden_size, config.params_dtype
        self.weight1 = _mark_expert_param(nn.Parameter(torch.empty(self.num_local, inter, hidden, dtype=dtype)), 1)
        self.weight3 = _mark_expert_param(nn.Parameter(torch.empty(self.num_local, inter, hidden, dtype=dtype)), 1)
        self.weight2 = _mark_expert_param(nn.Parameter(torch.empty(self.num_local, hidden, inter, dtype=dtype)), 2)
        for weight in (self.weight1, self.weight3, self.weight2):
            init_sharded(weight, config.init_method, "expert-parallel-rng")

    def forward(self, tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """tokens [N, hidden], indices/weights [N, k] of this rank -> routed output [N, hidden]."""
        ep_group = parallel_state.get_expert_model_parallel_group()
        etp_group = parallel_state.get_expert_tensor_parallel_group()
        # each expert-TP rank computes a slice of every expert: sum the input gradients over them
        tokens = tensor_parallel.copy_to_tensor_model_parallel_region(tokens, group=etp_group)
        weights = tensor_parallel.copy_to_tensor_model_parallel_region(weights, group=etp_group)

        count = tokens.shape[0]
        counts = _all_gather_first_dim(torch.tensor([count], device=tokens.device), ep_group)
        padding = int(counts.max()) - count
        if padding:  # uneven token counts across EP ranks: pad with tokens routed nowhere
            tokens = F.pad(tokens, (0, 0, 0, padding))
            weights = F.pad(weights, (0, 0, 0, padding))
            indices = F.pad(indices, (0, 0, 0, padding), value=-1)
        all_tokens = _GatherTokens.apply(tokens, ep_group)
        all_weights = _GatherTokens.apply(weights, ep_group)
        all_indices = _all_gather_first_dim(indices, ep_group)

        out = torch.zeros_like(all_tokens)
        with torch.no_grad():
            local = all_indices - self.first_expert
            hit = ((local >= 0) & (local < self.num_local))
            experts = torch.unique(local[hit]).tolist()
        for expert in experts:  # ascending, like transformers' loop over hit experts
            top_k_pos, token_idx = torch.where((local == expert).transpose(0, 1))
            gate = F.linear(all_tokens[token_idx], self.weight1[expert]).clamp(max=self.limit)
            up = F.linear(all_tokens[token_idx], self.weight3[expert]).clamp(min=-self.limit, max=self.limit)
            current = F.linear(F.silu(gate) * up, self.weight2[expert])
            current = current * all_weights[token_idx, top_k_pos, None]
            out = out.index_add(0, token_idx, current.to(out.dtype))

        out = _ScatterTokens.apply(out, ep_group)[:count]
        return tensor_parallel.reduce_from_tensor_model_parallel_region(out, group=etp_group)


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
        gate = self.linear_fc1_gate(x)[0].clamp(max=self.limit)
        up = self.linear_fc1_up(x)[0].clamp(min=-self.limit, max=self.limit)
        return self.linear_fc2(F.silu(gate) * up)[0]


class DeepseekV4MoE(nn.Module):
    def __init__(self, config, args: DeepseekV4Args, mlp_type: str):
        super().__init__()
        self.router = Router(config, args, hash_routed=mlp_type == HASH_MOE)
        self.experts = RoutedExperts(config, args)
        self.shared_experts = SharedExpert(config, args)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq_len, hidden = hidden_states.shape
        _, weights, indices = self.router(hidden_states, input_ids)
        routed = self.experts(hidden_states.view(-1, hidden), indices, weights).view(batch, seq_len, hidden)
        return routed + self.shared_experts(hidden_states)
