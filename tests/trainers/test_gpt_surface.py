"""What trainers read of a model besides its log-probs: GPTModel's attributes, the padded vocabulary columns, the mask
forms of Megatron's batches, and the calls a model refuses by name (mtp_kwargs without MTP, build_schedule_plan).

Mask forms: for each architecture, a left-padded and a right-padded row give the same real-token log-probs with a
[b, 1, 1, s] padding mask and with each [b, 1, s, s] form that is causal over the row's real tokens (padding keys
masked; padding queries masked too; padding tokens seeing themselves), as Megatron-based trainers build them, and
those equal transformers' on each sample alone: 1e-5, fp32 (the same math in another order).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, tiny_with_vocab

from modelzoo import build_provider, runtime
from modelzoo.layers import gpt_call
from modelzoo.parity import load_hf_model

ARCHITECTURES = ("llama", "loopcoder", "deepseek_v4")
VOCAB = 250  # Megatron pads it to 256: the padded columns are real here
TOLERANCE = 1e-5
LENGTHS, WIDTH = (7, 13), 16   # row 0 left-padded, row 1 right-padded; 13 tokens pass DeepSeek-V4's window of 8


@pytest.fixture(scope="module", params=ARCHITECTURES)
def built(request, tmp_path_factory):
    checkpoint = tiny_with_vocab(request.param, tmp_path_factory.mktemp("vocab250"), VOCAB)
    with runtime.parallel():
        provider = build_provider(checkpoint)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        yield request.param, checkpoint, provider, model


def padded_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """(ids [2, WIDTH], real [2, WIDTH] bool, each row's tokens): row 0 left-padded, row 1 right-padded."""
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (length,), generator=generator).tolist() for length in LENGTHS]
    ids, real = torch.zeros(2, WIDTH, dtype=torch.long), torch.zeros(2, WIDTH, dtype=torch.bool)
    ids[0, WIDTH - LENGTHS[0]:], real[0, WIDTH - LENGTHS[0]:] = torch.tensor(tokens[0]), True
    ids[1, :LENGTHS[1]], real[1, :LENGTHS[1]] = torch.tensor(tokens[1]), True
    return ids, real, tokens


def mask_forms(real: torch.Tensor) -> dict[str, torch.Tensor]:
    causal = torch.ones(WIDTH, WIDTH, dtype=torch.bool).tril()
    keys, queries = real[:, None, :], real[:, :, None]
    itself = torch.eye(WIDTH, dtype=torch.bool)
    return {
        "padding keys [b,1,1,s]": ~real[:, None, None, :],
        "causal, padding keys masked": ~(causal & keys)[:, None],
        "causal, padding keys and queries masked": ~(causal & keys & queries)[:, None],
        "causal, padding tokens see themselves": ~((causal & keys & queries) | itself)[:, None],
    }


def real_token_logprobs(logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor, vocab: int) -> list[torch.Tensor]:
    from modelzoo.logprobs import next_token_logprobs

    logprobs = next_token_logprobs(logits, ids, vocab)
    return [logprobs[row][real[row, :-1] & real[row, 1:]] for row in range(ids.shape[0])]


def test_every_mask_form_gives_each_row_its_own_log_probs(built):
    architecture, checkpoint, provider, model = built
    ids, real, tokens = padded_rows(provider.vocab_size)
    hf = load_hf_model(checkpoint)
    with torch.no_grad():
        expected = [torch.log_softmax(hf(torch.tensor([t]), use_cache=False).logits[0, :-1].float(), -1)
                    .gather(-1, torch.tensor(t)[1:, None])[:, 0] for t in tokens]
        positions = (real.long().cumsum(1) - 1).clamp(min=0)
        for name, mask in mask_forms(real).items():
            ours = real_token_logprobs(model(ids, positions, mask), ids, real, provider.vocab_size)
            for row in range(2):
                error = (ours[row] - expected[row]).abs().max().item()
                assert error <= TOLERANCE, (architecture, name, row, error)


def test_padded_vocabulary_columns_take_no_probability_and_no_gradient(built):
    architecture, _, provider, model = built
    assert provider.padded_vocab_size() == 256 and provider.vocab_size == VOCAB
    ids = torch.randint(0, provider.vocab_size, (1, 12))
    logits = model(ids)
    assert (logits[..., provider.vocab_size:] == gpt_call.PADDED_VOCAB_LOGIT).all()
    assert torch.softmax(logits.float(), -1)[..., provider.vocab_size:].sum() == 0
    torch.log_softmax(logits, -1).mean().backward()
    weight = model.embedding.word_embeddings.weight if provider.hf_config.tie_word_embeddings \
        else model.output_layer.weight
    assert weight.grad[provider.vocab_size:].abs().max() == 0 and weight.grad[:provider.vocab_size].abs().max() > 0
    model.zero_grad(set_to_none=True)
    gathered = model(ids, runtime_gather_output=True)
    assert (gathered[..., provider.vocab_size:] == gpt_call.PADDED_VOCAB_LOGIT).all()
    if architecture == "deepseek_v4":
        _, mtp_logits = model(ids, return_mtp=True)
        assert all((logits_k[..., provider.vocab_size:] == gpt_call.PADDED_VOCAB_LOGIT).all()
                   for logits_k in mtp_logits)


def test_gpt_model_attributes_trainers_read(built):
    architecture, _, provider, model = built
    assert model.pre_process and model.post_process
    assert model.vocab_size == provider.vocab_size
    assert model.max_sequence_length == provider.hf_config.max_position_embeddings
    assert model.share_embeddings_and_output_weights == bool(provider.hf_config.tie_word_embeddings)
    assert model.shared_embedding_or_output_weight() is model.embedding.word_embeddings.weight
    expected_mtp_layers = provider.hf_config.num_nextn_predict_layers if architecture == "deepseek_v4" else None
    assert model.config.mtp_num_layers == expected_mtp_layers
    if architecture == "deepseek_v4":
        assert len(model.mtp.layers) == expected_mtp_layers


def test_what_a_model_cannot_do_is_refused_by_name(built):
    architecture, _, provider, model = built
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="build_schedule_plan: Megatron's combined 1F1B schedule"):
        model.build_schedule_plan(ids, None, None)
    model(ids, mtp_kwargs=None)  # what slime passes with MTP training off
    expected = {"llama": "Llama has no MTP layers", "loopcoder": "LoopCoder has no MTP layers",
                "deepseek_v4": "mtp_loss_scale is 0, so the MTP layers are frozen"}[architecture]
    with pytest.raises(ValueError, match=expected):
        model(ids, mtp_kwargs={"mtp_labels": ids})


def test_deepseek_v4_refuses_mtp_labels_of_another_shape(built):
    if built[0] != "deepseek_v4":
        pytest.skip("MTP: DeepSeek-V4 only")
    provider = build_provider(TINY / "deepseek-v4-tiny", mtp_loss_scale=0.1)
    model = provider.provide()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"mtp_labels must be the input ids' shape \[1, 8\]"):
        model(ids, mtp_kwargs={"mtp_labels": ids[:, :7]})
    without_mtp = build_provider(TINY / "deepseek-v4-tiny", build_mtp=False).provide()
    assert without_mtp.config.mtp_num_layers is None
    with pytest.raises(ValueError, match="this model has no MTP layers"):
        without_mtp(ids, mtp_kwargs={"mtp_labels": ids})
