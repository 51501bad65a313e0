"""The routed experts' grouped dispatch: the row plan and the grouped linear, against direct indexing.

The model-level parity (test_components.py::test_moe_block, test_model.py, test_parallel.py at EP 2)
checks the experts against transformers' per-expert loop; these tests pin the plan's own invariants,
including cases the tiny model does not reach (empty experts, every slot on another EP rank).
"""

import pytest
import torch
import torch.nn.functional as F

from modelzoo.deepseek_v4.model.moe import GROUP_ALIGNMENT, _dispatch_plan, combine_slots, gather_rows, grouped_linear


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
    rows, slot_rows, row_slots, group_ends = _dispatch_plan(experts, num_experts, exact_capacity)

    local = experts < num_experts
    slots = experts.numel() if not exact_capacity else int(local.sum())
    assert rows.shape == (slots + num_experts * GROUP_ALIGNMENT,)
    assert group_ends.dtype == torch.int32 and int(group_ends[-1]) == rows.numel()
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), group_ends[:-1]])
    assert bool((starts % GROUP_ALIGNMENT == 0).all()) and bool((group_ends - starts >= GROUP_ALIGNMENT).all())

    token_of_slot = torch.arange(num_tokens).unsqueeze(1).expand(-1, top_k)
    # each local slot's row reads its own token and lies in its expert's group; no row is shared
    assert torch.equal(rows[slot_rows[local]], token_of_slot[local])
    row_expert = torch.bucketize(slot_rows[local], group_ends.long(), right=True)
    assert torch.equal(row_expert, experts[local])
    assert slot_rows[local].unique().numel() == int(local.sum())
    assert bool((slot_rows[~local] == rows.numel()).all())
    # row_slots inverts slot_rows: each local slot's row names that slot, every other row names no slot
    flat_slots = torch.arange(experts.numel()).view(num_tokens, top_k)
    assert torch.equal(row_slots[slot_rows[local]], flat_slots[local])
    # every other row reads the zero padding row; within an expert, slots keep token order
    unused = torch.ones(rows.numel(), dtype=torch.bool)
    unused[slot_rows[local]] = False
    assert bool((rows[unused] == num_tokens).all()) and bool((row_slots[unused] == experts.numel()).all())
    for expert in range(num_experts):
        expert_rows = slot_rows[experts == expert]
        assert torch.equal(rows[expert_rows.sort().values], token_of_slot[experts == expert])


def _combine_case(num_tokens, top_k, num_experts, hidden, foreign_fraction, seed):
    """A dispatch plan with fp64 expert outputs, slot weights (0 on foreign slots) and an upstream gradient."""
    experts = _random_assignment(num_tokens, top_k, num_experts, foreign_fraction, seed=seed)
    rows, slot_rows, row_slots, _ = _dispatch_plan(experts, num_experts, exact_capacity=foreign_fraction > 0)
    generator = torch.Generator().manual_seed(seed + 1)
    expert_output = torch.randn(rows.numel(), hidden, dtype=torch.float64, generator=generator)
    local = experts < num_experts
    weights = torch.rand(num_tokens, top_k, dtype=torch.float64, generator=generator) * local
    upstream = torch.randn(num_tokens, hidden, dtype=torch.float64, generator=generator)
    return expert_output, weights, slot_rows.clamp(max=rows.numel() - 1), row_slots, upstream, local


def _combine_by_token_loop(expert_output, weights, slot_rows, upstream, local):
    """(output, expert_output grad, weights grad): autograd through a loop over tokens and their local slots."""
    expert_output, weights = expert_output.clone().requires_grad_(), weights.clone().requires_grad_()
    zero = torch.zeros(expert_output.shape[1], dtype=expert_output.dtype)
    out = torch.stack([sum((weights[t, k] * expert_output[slot_rows[t, k]] for k in range(weights.shape[1])
                            if local[t, k]), zero) for t in range(weights.shape[0])])
    out.backward(upstream)
    return out.detach(), expert_output.grad, weights.grad


def _combine_by_combine_slots(expert_output, weights, slot_rows, row_slots, upstream):
    expert_output, weights = expert_output.clone().requires_grad_(), weights.clone().requires_grad_()
    out = combine_slots(expert_output, weights, slot_rows, row_slots)
    out.backward(upstream)
    return out.detach(), expert_output.grad, weights.grad


@pytest.mark.parametrize("foreign_fraction", [0.0, 0.5])
def test_combine_slots_forward_and_backward_against_a_per_token_loop(foreign_fraction):
    """combine_slots (a fused gather-multiply-sum whose backward is gathers) against autograd through a
    loop over tokens and their local slots, in fp64: sums of at most k terms, compared at 1e-12."""
    expert_output, weights, slot_rows, row_slots, upstream, local = _combine_case(29, 3, 4, 8, foreign_fraction, 3)
    ours = _combine_by_combine_slots(expert_output, weights, slot_rows, row_slots, upstream)
    reference = _combine_by_token_loop(expert_output, weights, slot_rows, upstream, local)
    assert (ours[0] - reference[0]).abs().max() <= 1e-12
    assert (ours[1] - reference[1]).abs().max() <= 1e-12
    # foreign slots' weights are 0 and come from torch.where in the model (no gradient reaches them):
    # compare the local slots
    assert (ours[2] - reference[2])[local].abs().max() <= 1e-12


@pytest.mark.gpu
def test_combine_slots_compiled_on_gpu_against_the_loop_in_fp64():
    """The compiled bf16 kernels (forward and both gradients) against the fp64 loop, relative error at
    bf16 rounding of the results (2^-7 of the largest magnitude: inputs rounded to bf16 once, sums of
    <= 4 products, or of 256 for the weight gradient, accumulated in fp32)."""
    expert_output, weights, slot_rows, row_slots, upstream, local = _combine_case(512, 4, 8, 256, 0.0, 5)
    rounded = [t.to(torch.bfloat16).double() for t in (expert_output, weights, upstream)]
    reference = _combine_by_token_loop(rounded[0], rounded[1], slot_rows, rounded[2], local)
    ours = _combine_by_combine_slots(*(t.to("cuda", torch.bfloat16) for t in rounded[:2]), slot_rows.cuda(),
                                     row_slots.cuda(), rounded[2].to("cuda", torch.bfloat16))
    for got, expected in zip(ours, reference, strict=True):
        assert ((got.double().cpu() - expected).abs().max() / expected.abs().max()) <= 2**-7


@pytest.mark.parametrize("foreign_fraction", [0.0, 0.5])
def test_gather_rows_backward_equals_index_select_backward(foreign_fraction):
    """The dispatch (tokens -> rows) and combine (rows -> slots) gathers with the plan's readers, against
    index_select's own backward (an index_add). Sums of at most k fp64 terms: compared at 1e-12."""
    num_tokens, top_k, num_experts, hidden = 29, 3, 4, 8
    experts = _random_assignment(num_tokens, top_k, num_experts, foreign_fraction, seed=1)
    rows, slot_rows, row_slots, _ = _dispatch_plan(experts, num_experts, exact_capacity=foreign_fraction > 0)
    capacity = rows.numel()
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randn(num_tokens + 1, hidden, dtype=torch.float64, generator=generator)
    expert_output = torch.randn(capacity, hidden, dtype=torch.float64, generator=generator)
    local = (experts < num_experts).unsqueeze(-1)
    cases = [  # (source, index, readers, weight of each output row: foreign slots and padding rows weigh 0)
        (tokens, rows, F.pad(slot_rows, (0, 0, 0, 1), value=capacity), (rows < num_tokens).unsqueeze(-1)),
        (expert_output, slot_rows.clamp(max=capacity - 1).reshape(-1), row_slots.unsqueeze(1), local.reshape(-1, 1)),
    ]
    for source, index, readers, weight in cases:
        upstream = torch.randn(index.numel(), hidden, dtype=torch.float64, generator=generator) * weight
        ours = source.clone().requires_grad_()
        gather_rows(ours, index, readers).backward(upstream)
        reference = source.clone().requires_grad_()
        reference.index_select(0, index).backward(upstream)
        assert torch.equal(gather_rows(source, index, readers), source.index_select(0, index))
        assert (ours.grad - reference.grad).abs().max() <= 1e-12


def test_grouped_linear_multiplies_each_group_by_its_own_expert():
    generator = torch.Generator().manual_seed(0)
    group_ends = torch.tensor([16, 16, 48, 64], dtype=torch.int32)   # expert 1 empty
    x = torch.randn(64, 24, generator=generator)
    weight = torch.randn(4, 40, 24, generator=generator)
    expert_of_row = torch.bucketize(torch.arange(64), group_ends.long(), right=True)
    expected = torch.stack([F.linear(x[row], weight[expert_of_row[row]]) for row in range(64)])
    # max |diff| <= 1e-5: the same fp32 dot products, blocked differently (one row vs a group)
    assert (grouped_linear(x, weight, group_ends) - expected).abs().max() <= 1e-5


@pytest.mark.gpu
def test_grouped_linear_on_gpu_matches_one_linear_per_group_forward_and_backward():
    """The bf16 grouped GEMM (torch._grouped_mm, private) against the per-group path, gradients included."""
    generator = torch.Generator().manual_seed(0)
    experts = _random_assignment(512, 4, 8, 0.0, seed=1)
    *_, group_ends = _dispatch_plan(experts, 8, exact_capacity=False)
    rows = int(group_ends[-1])
    x = torch.randn(rows, 256, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(8, 384, 256, generator=generator) * 0.05).to(torch.bfloat16)
    grad = torch.randn(rows, 384, generator=generator).to(torch.bfloat16)
    results = []
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):  # cpu fp32: the per-group oracle
        x_d = x.to(device, dtype).requires_grad_()
        weight_d = weight.to(device, dtype).requires_grad_()
        out = grouped_linear(x_d, weight_d, group_ends.to(device))
        out.backward(grad.to(device, dtype))
        results.append([t.float().cpu() for t in (out, x_d.grad, weight_d.grad)])
    # bf16 outputs of fp32-accumulated sums of 256 (or, for the weight gradient, ~rows/8) products:
    # relative error at bf16's 2^-8 rounding of the result
    for grouped, oracle in zip(*results, strict=True):
        assert ((grouped - oracle).abs().max() / oracle.abs().max()) <= 2**-7
