"""DeepSeek-V4 multi-token prediction (transformers does not build it): checked against a reference
assembled here from the published formulation (DeepSeek-V3 §2.2 / the V4 reference `MTPBlock`)

    h'_i = e_proj(enorm(Emb(t_{i+1}))) + h_proj(hnorm(h_i))      (h: the main model's final HC streams)
    logits_i = head(norm(hc_head(Block(h'))))                      predicts t_{i+2}

with transformers' own DeepseekV4DecoderLayer (a sliding-attention, learned-router layer, loaded
with the mtp.0.* weights) as `Block`, and plain torch for the rest (dsv4_helpers.reference_mtp_logits).

MTP_TOLERANCE = 1e-4 (max |diff| of MTP logits): the chain is the main model (4 layers) plus one
block in fp32, the same order of ops (measured: bit-identical). A wrong shift, norm or projection is O(1).
"""

import math

import pytest
import torch
from dsv4_helpers import VOCAB, max_diff, provider_for, random_tokens, reference_mtp_logits, write_tiny

from modelzoo import runtime
from modelzoo.deepseek_v4.model.mtp import mtp_loss, shift_left, shifted_cross_entropy

MTP_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("dsv4") / "deepseek-v4-tiny")


def test_shift_and_uniform_loss_by_hand():
    assert shift_left(torch.tensor([[5, 6, 7, 8]]), 1).tolist() == [[6, 7, 8, 0]]
    assert shift_left(torch.tensor([[5, 6, 7, 8]]), 2).tolist() == [[7, 8, 0, 0]]
    with runtime.parallel():
        # all-zero logits over a 256-row padded vocabulary: the 250 real tokens are uniform -> CE = log 250
        logits = torch.zeros(2, 6, 256)
        ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
        assert abs(mtp_loss([logits], ids, VOCAB).item() - math.log(VOCAB)) < 1e-6
        # a logit of 3 on the target t[i+2], 0 elsewhere: CE = log(1 + 249 e^-3) per position
        peaked = torch.zeros(2, 6, 256)
        for b in range(2):
            for i in range(4):
                peaked[b, i, ids[b, i + 2]] = 3.0
        expected = math.log1p(249 * math.exp(-3.0))
        assert abs(mtp_loss([peaked], ids, VOCAB).item() - expected) < 1e-6 * expected
        per_token, has_target = shifted_cross_entropy(peaked, ids, 2, VOCAB)
        assert per_token.shape == (2, 6) and has_target.tolist() == [[True] * 4 + [False] * 2] * 2


def test_mtp_logits_match_the_published_formulation(tiny, tmp_path):
    ids = random_tokens()
    with torch.no_grad():
        reference = reference_mtp_logits(tiny, tmp_path / "mtp-block", ids)
        with runtime.parallel():
            provider = provider_for(tiny)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            model.eval()
            logits, (mtp_logits,) = model(ids, return_mtp=True)
    assert mtp_logits.shape == logits.shape == (2, 64, 256)
    assert max_diff(mtp_logits[..., :VOCAB], reference) <= MTP_TOLERANCE
    assert max_diff(mtp_logits, logits) > 0.1  # a different head than the main one


def test_mtp_loss_switch_and_gradient_flow(tiny):
    ids = random_tokens(seed=3)
    with runtime.parallel():
        grads = {}
        for scale in (0.0, 0.3):
            provider = provider_for(tiny, mtp_loss_scale=scale)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            loss = provider.loss(model, ids)
            loss.backward()
            grads[scale] = {name: p.grad for name, p in model.named_parameters()}
            if scale:
                logits, mtp_logits = model(ids, return_mtp=True)
                main = -provider.token_logprobs(model, ids).mean()
                assert abs(loss.item() - (main + scale * mtp_loss(mtp_logits, ids, VOCAB)).item()) < 1e-5
    mtp_names = [name for name in grads[0.3] if name.startswith("mtp.")]
    assert len(mtp_names) > 30
    assert all(grads[0.0][name] is None for name in mtp_names)         # switched off: no MTP gradient
    for name in mtp_names:                                              # switched on: every MTP weight learns
        if ".indexer." not in name:
            assert grads[0.3][name] is not None and grads[0.3][name].abs().max() > 0, name
    # the MTP loss reaches the trunk (it reads the main model's streams and the shared embedding/head)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.0.attn_hc.fn"):
        assert max_diff(grads[0.3][name], grads[0.0][name]) > 1e-6, name
