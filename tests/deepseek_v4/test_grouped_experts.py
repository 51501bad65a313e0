"""The routed experts' grouped dispatch: the row plan and the grouped linear, against direct indexing.

The model-level parity (test_components.py::test_moe_block, test_model.py, test_parallel.py at EP 2)
checks the experts against transformers' per-expert loop; these tests pin the plan's own invariants,
including cases the tiny model does not reach (empty experts, every slot on another EP rank).
"""

import pytest
import torch
import torch.nn.functional as F

from modelzoo.deepseek_v4.model.moe import GROUP_ALIGNMENT, _dispatch_plan, grouped_linear


def _random_assignment(num_tokens: int, top_k: int, num_experts: int, foreign_fraction: float, seed: int):
    generator = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, num_experts, (num_tokens, top_k), generator=generator)
    foreign = torch.rand(num_tokens, top_k, generator=generator) < foreign_fraction
    return torch.where(foreign, num_experts, experts)


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "foreign_fraction", "exact_capacity"), [
    (37, 4, 5, 0.0, False),     # one rank: every slot local, static capacity
    (64, 2, 8, 0.5, True),      # expert parallel: half the slots served by another rank
    (3, 2, 16, 0.0, False),     # more experts than slots: most groups empty
    (10, 3, 4, 1.0, True),      # every slot foreign: only padding rows
])
def test_dispatch_plan_places_every_local_slot_in_its_expert_group(num_tokens, top_k, num_experts, foreign_fraction,
                                                                     exact_capacity):
    experts = _random_assignment(num_tokens, top_k, num_experts, foreign_fraction, seed=num_tokens)
    rows, slot_rows, group_ends = _dispatch_plan(experts, num_experts, exact_capacity)

    local = experts < num_experts
    slots = experts.numel() if not exact_capacity else int(local.sum())
    assert rows.shape == (slots + num_experts * GROUP_ALIGNMENT,)
    assert group_ends.dtype == torch.int32 and int(group_ends[-1]) == rows.numel()
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), group_ends[:-1]])
    assert bool((starts % GROUP_ALIGNMENT == 0).all()) and bool((group_ends >= starts).all())

    token_of_slot = torch.arange(num_tokens).unsqueeze(1).expand(-1, top_k)
    # each local slot's row reads its own token and lies in its expert's group; no row is shared
    assert torch.equal(rows[slot_rows[local]], token_of_slot[local])
    row_expert = torch.bucketize(slot_rows[local], group_ends.long(), right=True)
    assert torch.equal(row_expert, experts[local])
    assert slot_rows[local].unique().numel() == int(local.sum())
    # every other row reads the zero padding row; within an expert, slots keep token order
    unused = torch.ones(rows.numel(), dtype=torch.bool)
    unused[slot_rows[local]] = False
    assert bool((rows[unused] == num_tokens).all())
    for expert in range(num_experts):
        expert_rows = slot_rows[experts == expert]
        assert torch.equal(rows[expert_rows.sort().values], token_of_slot[experts == expert])


def test_grouped_linear_multiplies_each_group_by_its_own_expert():
    generator = torch.Generator().manual_seed(0)
    group_ends = torch.tensor([16, 16, 48, 64], dtype=torch.int32)   # expert 1 empty
    x = torch.randn(64, 24, generator=generator)
    weight = torch.randn(4, 40, 24, generator=generator)
    expert_of_row = torch.bucketize(torch.arange(64), group_ends.long(), right=True)
    expected = torch.stack([F.linear(x[row], weight[expert_of_row[row]]) for row in range(64)])
    # max |diff| <= 1e-5: the same fp32 dot products, blocked differently (one row vs a group)
    assert (grouped_linear(x, weight, group_ends) - expected).abs().max() <= 1e-5
