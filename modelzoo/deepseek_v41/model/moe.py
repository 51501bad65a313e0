"""DeepSeek-V4.1's MoE: DeepSeek-V4's routed and shared experts behind a router without hash routing.

    s       = score(x W_gate^T / gate_temp)                          sqrtsoftplus in the release
    experts = top-k(s + bias)       (bias_vl at image tokens)         the biases steer the choice only
    weights = s[experts] / sum * routed_scaling_factor
    y       = sum_k weights_k * expert_k(x) + shared_expert(x)

The router, `RoutedExperts` (expert parallel, all-to-all or all-gather dispatch) and `SharedExpert` (tensor
parallel) are V4's; the router only gains the temperature and the image-token bias.
"""

from __future__ import annotations

import torch
from torch import nn

from modelzoo.deepseek_v4.model.moe import SCORE_FUNCTIONS, MegatronOrder, RoutedExperts, Router, SharedExpert
from modelzoo.deepseek_v41.config import DeepseekV41Args


class TemperedScore:
    """score(logits / temperature), the router's `score_fn` (a class, not a closure: models are deep-copied)."""

    def __init__(self, scoring_func: str, temperature: float):
        self.score, self.temperature = SCORE_FUNCTIONS[scoring_func], temperature

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.score(logits / self.temperature)


class DeepseekV41Router(Router):
    """V4's learned router with `gate_temp` and a second selection bias, `expert_bias_vl`, for image tokens."""

    def __init__(self, config, args: DeepseekV41Args, sequence_parallel: bool = False):
        super().__init__(config, args, hash_routed=False, sequence_parallel=sequence_parallel)
        self.score_fn = TemperedScore(args.scoring_func, args.gate_temp)
        self.register_buffer("expert_bias_vl", torch.zeros(args.num_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor, image_mask: torch.Tensor | None = None,
                padding: torch.Tensor | None = None, order: MegatronOrder | None = None):
        # V4's router hands its second argument (hash routing's token ids there) to `choose`: here the image mask
        return super().forward(hidden_states, image_mask, padding, order)

    def choose(self, scores: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
        bias = self.expert_bias
        if image_mask is not None:
            bias = torch.where(image_mask.reshape(-1, 1), self.expert_bias_vl, self.expert_bias)
        return torch.topk(scores + bias, self.top_k, dim=-1, sorted=False).indices


class DeepseekV41MoE(nn.Module):
    def __init__(self, config, args: DeepseekV41Args, sequence_parallel: bool = False):
        super().__init__()
        self.router = DeepseekV41Router(config, args, sequence_parallel)
        self.experts = RoutedExperts(config, args)
        self.shared_experts = SharedExpert(config, args)

    def forward(self, hidden_states: torch.Tensor, image_mask: torch.Tensor | None = None,
                padding: torch.Tensor | None = None, order: MegatronOrder | None = None) -> torch.Tensor:
        """`order`: where the rows' tokens sit in the micro-batch, in Megatron's order (routing replay)."""
        batch, seq_len, hidden = hidden_states.shape
        _, weights, indices = self.router(hidden_states, image_mask, padding, order)
        routed = self.experts(hidden_states.view(-1, hidden), indices, weights).view(batch, seq_len, hidden)
        return routed + self.shared_experts(hidden_states)
