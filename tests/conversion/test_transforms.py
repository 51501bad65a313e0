"""Transforms and name tables: exact inverses, the documented Megatron layouts, clear coverage errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modelzoo.conversion.mapping import MappingError, MappingTable, Rule
from modelzoo.conversion.transforms import Direct, FusedGateUp, FusedQKV, PadVocab, RowBlocks, Stack


@settings(max_examples=30, deadline=None)
@given(kv_heads=st.integers(1, 4), per_group=st.integers(1, 4), head_dim=st.integers(1, 8), hidden=st.integers(1, 8))
def test_fused_qkv_round_trip_and_layout(kv_heads, per_group, head_dim, hidden):
    heads = kv_heads * per_group
    q = torch.randn(heads * head_dim, hidden)
    k = torch.randn(kv_heads * head_dim, hidden)
    v = torch.randn(kv_heads * head_dim, hidden)
    transform = FusedQKV(heads, kv_heads, head_dim)
    fused = transform.to_megatron([q, k, v], torch.Size([(heads + 2 * kv_heads) * head_dim, hidden]), tp=1)
    # independent statement of Megatron's layout: per group, its query heads, then k, then v
    rows = []
    for g in range(kv_heads):
        rows += [q[(g * per_group + h) * head_dim:(g * per_group + h + 1) * head_dim] for h in range(per_group)]
        rows += [k[g * head_dim:(g + 1) * head_dim], v[g * head_dim:(g + 1) * head_dim]]
    assert torch.equal(fused, torch.cat(rows))
    assert all(torch.equal(a, b) for a, b in zip(transform.to_hf(fused, tp=1), [q, k, v]))
    # as rows: each of q, k and v one block per group, each a view of the fused tensor (nothing copied)
    as_rows = transform.to_hf_rows(RowBlocks([fused]), tp=1)
    assert all(torch.equal(a.tensor(), b) for a, b in zip(as_rows, [q, k, v]))
    assert all(len(part.blocks) == kv_heads and all(block.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
                                                    for block in part.blocks) for part in as_rows)


@settings(max_examples=30, deadline=None)
@given(kv_heads=st.integers(1, 3), copies=st.integers(2, 4), heads_per_copy=st.integers(1, 3),
       head_dim=st.integers(1, 4), hidden=st.integers(1, 4))
def test_fused_qkv_with_kv_heads_copied_over_more_groups(kv_heads, copies, heads_per_copy, head_dim, hidden):
    """Fewer KV heads than TP ranks: a linear_qkv of kv_heads * copies groups (one per rank)."""
    groups, heads = kv_heads * copies, kv_heads * copies * heads_per_copy
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    transform = FusedQKV(heads, kv_heads, head_dim)
    fused = transform.to_megatron([q, k, v], torch.Size([(heads + 2 * groups) * head_dim, hidden]), tp=groups)
    # independent statement: group j holds query heads j*heads_per_copy.., then KV head j // copies
    rows = []
    for j in range(groups):
        rows += [q[j * heads_per_copy * head_dim:(j + 1) * heads_per_copy * head_dim]]
        rows += [k[j // copies * head_dim:(j // copies + 1) * head_dim], v[j // copies * head_dim:(j // copies + 1) * head_dim]]
    assert torch.equal(fused, torch.cat(rows))
    assert all(torch.equal(a, b) for a, b in zip(transform.to_hf(fused, tp=groups), [q, k, v]))
    # back to HF, each KV head comes from its first copy: a changed later copy does not show
    later_copies = fused.clone().view(groups, -1, hidden)
    later_copies[1::copies, heads_per_copy * head_dim:] += 1
    assert all(torch.equal(a, b) for a, b in zip(transform.to_hf(later_copies.view_as(fused), tp=groups), [q, k, v]))


def test_fused_qkv_refuses_rows_that_are_not_whole_groups():
    with pytest.raises(ValueError, match="a linear_qkv of 10 rows is not whole query groups of 2 key/value heads"):
        FusedQKV(4, 2, 1).to_hf(torch.zeros(10, 3), tp=1)


@settings(max_examples=50, deadline=None)
@given(rows=st.lists(st.integers(1, 5), min_size=1, max_size=4), chunks=st.integers(1, 4), data=st.data())
def test_row_blocks_narrow_and_chunk_like_the_concatenated_tensor(rows, chunks, data):
    blocks = [torch.randn(n, 6) for n in rows]
    whole, lazy = torch.cat(blocks), RowBlocks(blocks)
    start = data.draw(st.integers(0, whole.shape[0] - 1))
    length = data.draw(st.integers(1, whole.shape[0] - start))
    assert lazy.shape == whole.shape and torch.equal(lazy.narrow(0, start, length).tensor(), whole.narrow(0, start, length))
    assert torch.equal(lazy.narrow(1, 2, 3).tensor(), whole.narrow(1, 2, 3))
    for dim in (0, 1):
        pieces = lazy.chunk(chunks, dim)
        assert len(pieces) == len(whole.chunk(chunks, dim))
        assert all(torch.equal(piece.tensor(), part) for piece, part in zip(pieces, whole.chunk(chunks, dim)))


def test_rows_within_one_block_are_that_block_not_a_copy():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    rows = FusedGateUp().to_megatron_rows([gate, up], None, tp=1)
    assert rows.narrow(0, 0, 8).tensor().data_ptr() == gate.data_ptr()
    assert rows.narrow(0, 8, 8).tensor().data_ptr() == up.data_ptr()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_gate_up_puts_each_ranks_halves_together(tp):
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    full = FusedGateUp().to_megatron([gate, up], None, tp)
    for rank, shard in enumerate(full.chunk(tp)):
        rank_gate, rank_up = shard.chunk(2)
        assert torch.equal(rank_gate, gate.chunk(tp)[rank]) and torch.equal(rank_up, up.chunk(tp)[rank])
    back = FusedGateUp().to_hf(full, tp)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_pad_vocab_zero_rows_and_exact_inverse():
    embedding = torch.randn(10, 4, dtype=torch.bfloat16)
    padded = PadVocab(10).to_megatron([embedding], torch.Size([16, 4]), tp=2)
    assert padded.shape == (16, 4) and padded.dtype == torch.bfloat16
    assert torch.equal(padded[10:], torch.zeros(6, 4, dtype=torch.bfloat16))
    assert torch.equal(PadVocab(10).to_hf(padded, tp=2)[0], embedding)


def test_stack_round_trip():
    experts = [torch.randn(3, 2) for _ in range(4)]
    stacked = Stack().to_megatron(experts, None, tp=1)
    assert stacked.shape == (4, 3, 2)
    assert all(torch.equal(a, b) for a, b in zip(Stack().to_hf(stacked, tp=1), experts))


TABLE = MappingTable([
    Rule("decoder.layers.*.norm.weight", "model.layers.*.norm.weight"),
    Rule("decoder.layers.*.mlp.experts.*.weight", "model.layers.*.experts.*.w1.weight", Direct()),
    Rule("output.weight", "lm_head.weight"),
])


def test_wildcards_carry_indices_both_ways():
    rule, indices = TABLE.for_megatron("decoder.layers.12.mlp.experts.3.weight")
    assert rule.hf_names(indices) == ["model.layers.12.experts.3.w1.weight"]
    rule, indices = TABLE.for_hf("model.layers.7.norm.weight")
    assert rule.megatron_name(indices) == "decoder.layers.7.norm.weight"
    assert TABLE.for_megatron("decoder.layers.x.norm.weight") is None


def test_coverage_names_missing_and_unexpected():
    megatron = ["decoder.layers.0.norm.weight", "output.weight"]
    TABLE.check_coverage(megatron, ["model.layers.0.norm.weight", "lm_head.weight"], where="ckpt")
    with pytest.raises(MappingError, match=r"ckpt: missing tensors lm_head.weight; unexpected tensors extra.bias"):
        TABLE.check_coverage(megatron, ["model.layers.0.norm.weight", "extra.bias"], where="ckpt")
    with pytest.raises(MappingError, match="no mapping rule for Megatron tensors: decoder.final.weight"):
        TABLE.check_coverage(["decoder.final.weight"], [], where="ckpt")


def test_a_checkpoint_tensor_claimed_twice_is_refused():
    table = MappingTable([Rule("a.weight", "x.weight"), Rule("b.weight", "x.weight")])
    with pytest.raises(MappingError, match="x.weight is claimed by both a.weight and b.weight"):
        table.check_coverage(["a.weight", "b.weight"], ["x.weight"], where="ckpt")
