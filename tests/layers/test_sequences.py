"""`modelzoo.layers.sequences`: the batch forms of the trainer's call, read as one TokenLayout, and every bad one refused.

The layouts are checked against what they must mean, written out by hand; the models' parity on packed
and padded batches is in test_packed_sequences.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY
from megatron.core.packed_seq_params import PackedSeqParams

from modelzoo import build_provider, runtime
from modelzoo.layers.sequences import BatchLayoutError, pack_sequences, token_layout


def thd(cu_seqlens, cu_padded=None, qkv_format="thd") -> PackedSeqParams:
    as_tensor = lambda values: None if values is None else torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return PackedSeqParams(qkv_format=qkv_format, cu_seqlens_q=as_tensor(cu_seqlens), cu_seqlens_kv=as_tensor(cu_seqlens),
                           cu_seqlens_q_padded=as_tensor(cu_padded), cu_seqlens_kv_padded=as_tensor(cu_padded))


def test_packed_row_with_padded_slots():
    # sequences of 3 and 2 tokens in slots of 4: [a a a pad | b b pad pad]
    layout = token_layout(torch.zeros(1, 8, dtype=torch.long), packed_seq_params=thd([0, 3, 5], [0, 4, 8]))
    assert layout.segment_ids.tolist() == [[0, 0, 0, -1, 1, 1, -1, -1]]
    assert layout.positions.tolist() == [[0, 1, 2, 0, 0, 1, 0, 0]]
    assert layout.sequences == [(0, 0, 3), (0, 4, 2)]
    assert not layout.plain and layout.longest == 3 and layout.contiguous()
    visible = layout.visible()[0]
    assert visible[2].tolist() == [True, True, True, False, False, False, False, False]
    assert visible[5].tolist() == [False, False, False, False, True, True, False, False]  # not the first sequence
    assert not visible[4, :4].any()
    # a window of 2 positions
    assert layout.visible(window=2)[0, 2].tolist() == [False, True, True, False, False, False, False, False]


def test_padding_masks_and_position_ids():
    # row 0 right-padded, row 1 left-padded (Megatron's convention: True = masked)
    mask = torch.tensor([[False, False, False, True], [True, True, False, False]]).view(2, 1, 1, 4)
    layout = token_layout(torch.zeros(2, 4, dtype=torch.long), attention_mask=mask)
    assert layout.segment_ids.tolist() == [[0, 0, 0, -1], [-1, -1, 0, 0]]
    assert layout.positions.tolist() == [[0, 1, 2, 0], [0, 0, 0, 1]]
    assert layout.contiguous() and layout.sequences == [(0, 0, 3), (1, 2, 2)]
    assert layout.visible()[1, 3].tolist() == [False, False, True, True]
    # the same padding as a full [b, 1, s, s] mask (causal over the real tokens; padding rows as they come)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    full = ~(causal & ~mask.view(2, 1, 4))
    full[1, 0] = True
    from_full = token_layout(torch.zeros(2, 4, dtype=torch.long), attention_mask=full.unsqueeze(1))
    assert from_full.attention_mask is None and torch.equal(from_full.segment_ids, layout.segment_ids)
    with_positions = token_layout(torch.zeros(2, 4, dtype=torch.long), torch.tensor([[0, 1, 2, 3], [5, 5, 0, 1]]), mask)
    assert with_positions.rope_positions.tolist() == [[0, 1, 2, 3], [5, 5, 0, 1]] and with_positions.rope_length == 6
    # a general [b, 1, s, s] mask is read as given (and a row that sees nothing sees itself)
    general = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    for query, key in ((0, 0), (1, 1), (2, 0), (2, 2)):   # token 2 skips token 1; token 3 sees nothing
        general[0, 0, query, key] = False
    layout = token_layout(torch.zeros(1, 4, dtype=torch.long), attention_mask=general)
    assert layout.attention_mask is not None and layout.segment_ids.tolist() == [[0, 0, 0, -1]]
    assert layout.visible()[0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]]
    assert not layout.contiguous()


def test_plain_rows_and_pack_sequences():
    layout = token_layout(torch.zeros(2, 5, dtype=torch.long))
    assert layout.plain and layout.positions.tolist() == [list(range(5))] * 2
    batch = pack_sequences([[7, 8, 9], [4], [5, 6]], divisor=4)
    assert batch.input_ids.tolist() == [[7, 8, 9, 0, 4, 0, 0, 0, 5, 6, 0, 0]]
    assert batch.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert batch.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 4, 8, 12]
    labels, loss_mask = batch.labels()
    assert labels.tolist() == [[8, 9, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0]]
    assert loss_mask.tolist() == [[1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]]
    assert [t.tolist() for t in batch.split(torch.arange(12).view(1, 12), shift=1)] == [[0, 1], [], [8]]


@pytest.mark.parametrize("params, tokens, message", [
    (thd([1, 3, 5]), 5, "cu_seqlens_q must start at 0, starts at 1"),
    (thd([0, 3, 3, 5]), 5, "cu_seqlens_q must increase: entries 1 and 2 are 3 and 3"),
    (thd([0, 4, 2]), 5, "cu_seqlens_q must increase: entries 1 and 2 are 4 and 2"),
    (thd([0, 3, 5]), 6, "cu_seqlens_q ends at 5, but the packed row has 6 tokens"),
    (thd([0, 3, 5], [0, 4, 8]), 9, "cu_seqlens_q_padded ends at 8, but the packed row has 9 tokens"),
    (thd([0, 3, 5], [0, 2, 8]), 8, "cu_seqlens_q_padded gives sequence 0 a slot of 2 tokens, shorter than its 3"),
    (thd([0, 3, 5], qkv_format="sbhd"), 5, "qkv_format='sbhd': only 'thd' (packed sequences) is supported"),
    (thd([0, 3, 5], qkv_format="bshd"), 5, "qkv_format='bshd': only 'thd'"),
])
def test_bad_packed_seq_params_are_refused_in_one_sentence(params, tokens, message):
    with pytest.raises(BatchLayoutError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        token_layout(torch.zeros(1, tokens, dtype=torch.long), packed_seq_params=params)
    assert "\n" not in str(error.value)


def test_other_bad_batches_are_refused():
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(BatchLayoutError, match="must be boolean"):
        token_layout(ids, attention_mask=torch.zeros(2, 1, 1, 4))
    with pytest.raises(BatchLayoutError, match=r"must be \[batch, 1, 1, seq\] \(padding keys\) or"):
        token_layout(ids, attention_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(BatchLayoutError, match="packed sequences \\(THD\\) come as one row"):
        token_layout(ids, packed_seq_params=thd([0, 4]))
    with pytest.raises(BatchLayoutError, match="attention_mask and packed_seq_params together"):
        token_layout(ids[:1], attention_mask=torch.zeros(1, 1, 1, 4, dtype=torch.bool), packed_seq_params=thd([0, 4]))
    with pytest.raises(BatchLayoutError, match=r"position_ids must be \[batch, seq\] = \[2, 4\]"):
        token_layout(ids, position_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(BatchLayoutError, match="a sequence reaches position 9, past the model's 8 positions"):
        token_layout(ids, position_ids=torch.tensor([[0, 1, 2, 9]] * 2), max_positions=8)
    with pytest.raises(BatchLayoutError, match="a sequence reaches position 9, past the model's 8 positions"):
        token_layout(torch.zeros(1, 12, dtype=torch.long), packed_seq_params=thd([0, 10, 12]), max_positions=8)


def test_the_last_sequence_of_a_packed_row_may_run_past_the_trained_positions():
    """slime / miles pad a packed row with one more cu_seqlens entry, whose positions run on: it is computed, and the
    sequences before it are refused past the trained range as any sequence is."""
    layout = token_layout(torch.zeros(1, 12, dtype=torch.long), packed_seq_params=thd([0, 2, 12]), max_positions=8)
    assert layout.rope_length == 10 and layout.positions[0, -1] == 9
    with pytest.raises(BatchLayoutError, match="a sequence reaches position 8, past the model's 8 positions"):
        token_layout(torch.zeros(1, 12, dtype=torch.long), packed_seq_params=thd([0, 9, 12]), max_positions=8)
    with pytest.raises(BatchLayoutError, match="a sequence reaches position 9, past the model's 8 positions"):
        token_layout(torch.zeros(1, 12, dtype=torch.long), position_ids=torch.tensor([[9] + [0] * 11]),
                     packed_seq_params=thd([0, 2, 12]), max_positions=8)


@pytest.mark.parametrize("name", ["llama-tiny", "loopcoder-tiny", "deepseek-v4-tiny"])
def test_models_refuse_what_they_cannot_honour(name):
    with runtime.parallel():
        provider = build_provider(TINY / name)
        model = provider.provide()
        ids = torch.zeros(1, 8, dtype=torch.long)
        with pytest.raises(ValueError, match="inference_context / inference_params \\(KV-cache decoding\\) are not"):
            model(ids, None, None, inference_context=object())
        with pytest.raises(ValueError, match=r"extra_block_kwargs \['foo'\]"):
            model(ids, None, None, extra_block_kwargs={"foo": 1})
        with pytest.raises(ValueError, match="past the model's"):
            model(torch.zeros(1, provider.hf_config.max_position_embeddings + 1, dtype=torch.long))
        with pytest.raises(ValueError, match="cu_seqlens_q ends at 7, but the packed row has 8 tokens"):
            model(ids, packed_seq_params=thd([0, 3, 7]))
        with pytest.raises(ValueError, match=r"labels must be \[batch, seq\] = \[1, 8\]"):
            model(ids, labels=torch.zeros(1, 7, dtype=torch.long))


def test_deepseek_v4_refuses_a_mask_that_hides_where_sequences_start():
    with runtime.parallel():
        provider = build_provider(TINY / "deepseek-v4-tiny")
        model = provider.provide()
        general = ~torch.ones(8, 8, dtype=torch.bool).tril()
        general[5, 2] = True  # a hole inside the causal mask: not a padding mask
        with pytest.raises(ValueError, match="this attention_mask is not causal over runs of consecutive tokens"):
            model(torch.zeros(1, 8, dtype=torch.long), None, general.view(1, 1, 8, 8))
