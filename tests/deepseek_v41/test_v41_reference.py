"""Our DeepSeek-V4.1 reference on deepseek-v41-tiny: causal, every mechanism moves the log-probs, gradients reach
exactly the trainable parameters, padding and image tokens behave, fake quantisation rounds as DeepSeek's kernels.

Tolerances: 1e-5 on fp32 logits of identical computations in differently shaped batches (float summation order;
logits are O(1)); DRAFT_TOLERANCE (1e-4) on the DSpark draft logits, as in the Megatron parity tests: values up to 5
after three more layers and a second head (measured 1.2e-5 between a 13-token prefix and the whole row on a 2-core
CPU, 3.5e-6 on the backbone's logits of the same run); 1e-3 on log-probs for "a mechanism matters", the bar the
Megatron parity tests must clear."""

import numpy as np
import pytest
import torch
from dsv41_helpers import DRAFT_TOLERANCE, MECHANISMS, load_tiny, log_probs, random_rows, switch_off

from modelzoo.deepseek_v41.hf_model import (
    DeepseekV41Attention,
    _round_to_e2m1,
    fake_quant_fp4,
    fake_quant_fp8,
)

SAME = 1e-5
MATTERS = 1e-3


@pytest.fixture(scope="module")
def model():
    return load_tiny()


@pytest.mark.parametrize("fake_quant", [False, True])
def test_prefix_logits_do_not_change_when_the_row_grows(model, fake_quant):
    """Rows of 64 tokens: beyond the sliding window (8), the index top-k (8) and the candidate budget (3 blocks of
    4 latents at ratio 1); prefixes of 13 (just past the budget) and 40 tokens."""
    rows = random_rows(2, 64)
    with torch.no_grad():
        full = model(rows, fake_quant=fake_quant, draft_anchor_ids=rows.roll(-1, 1))
        for length in (13, 40):
            prefix = model(rows[:, :length], fake_quant=fake_quant, draft_anchor_ids=rows[:, :length].roll(-1, 1))
            torch.testing.assert_close(prefix.logits, full.logits[:, :length], rtol=0, atol=SAME)
            # the last anchor of the prefix wraps around, so its draft differs; the others see the same inputs
            torch.testing.assert_close(prefix.draft_logits[:, : length - 1], full.draft_logits[:, : length - 1],
                                       rtol=0, atol=DRAFT_TOLERANCE)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_each_mechanism_moves_the_log_probs(model, mechanism, monkeypatch):
    rows = random_rows(2, 64, seed=1)
    with torch.no_grad():
        reference = log_probs(model(rows).logits)
    changed = switch_off(load_tiny(), mechanism, monkeypatch)
    with torch.no_grad():
        moved = (log_probs(changed(rows).logits) - reference).abs().max().item()
    assert moved > MATTERS, f"switching off {mechanism} moved the log-probs by only {moved:.2e}"


def test_each_kv_source_replaces_the_compressed_kv_of_the_previous_one(model, monkeypatch):
    """Layer 5 reuses layer 4's latents only (transformers main's cacheless path would append them to layer 2's)."""
    widths = {}
    original = DeepseekV41Attention.compressed_keys

    def record(self, *args):
        latents = original(self, *args)
        widths[self.layer_idx] = None if latents is None else latents.shape[1]
        return latents

    monkeypatch.setattr(DeepseekV41Attention, "compressed_keys", record)
    with torch.no_grad():
        model(random_rows(1, 64))
    assert widths == {2: 32, 3: 32, 4: 32, 5: 32, 6: 64, 7: 64, 8: 64, 9: 64}


@pytest.mark.parametrize("fake_quant", [False, True])
def test_gradients_reach_every_trainable_parameter_and_no_frozen_one(fake_quant):
    model = load_tiny().train()
    rows = random_rows(2, 64, seed=2)
    model(rows, labels=rows, fake_quant=fake_quant).loss.backward()
    no_gradient = [name for name, p in model.named_parameters()
                   if p.requires_grad and (p.grad is None or not p.grad.abs().max() > 0)]
    assert not no_gradient, f"trainable parameters without a gradient: {no_gradient}"
    frozen_with_gradient = [name for name, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen_with_gradient


def test_frozen_by_default_are_dspark_engram_tables_router_biases_and_indexers(model):
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    for name in frozen:
        assert (name.startswith("mtp.") or ".engram.embed." in name or name.endswith((".gate.bias", ".bias_vl"))
                or ".attn.indexer." in name), name
    assert "mtp.0.main_proj.weight" in frozen and "model.layers.4.engram.embed.weight" in frozen
    assert "model.layers.8.attn.indexer.wq_b.weight" in frozen and "model.layers.0.ffn.gate.bias_vl" in frozen
    assert "model.layers.4.engram.wkv.weight" not in frozen
    assert "model.layers.6.attn.compressor.wkv.weight" not in frozen


def test_right_padded_rows_give_the_unpadded_logits_and_left_padding_is_refused(model):
    rows = random_rows(2, 40, seed=3)
    mask = torch.ones_like(rows)
    mask[1, 30:] = 0
    with torch.no_grad():
        padded = model(rows, attention_mask=mask).logits
        alone = model(rows[1:, :30]).logits
    torch.testing.assert_close(padded[1, :30], alone[0], rtol=0, atol=SAME)
    with pytest.raises(ValueError, match="right-padded"):
        model(rows, attention_mask=mask.flip(-1))


def test_image_tokens_route_with_bias_vl_and_stop_the_ngram_look_back(model):
    rows = random_rows(1, 24, seed=4)
    image = torch.zeros_like(rows, dtype=torch.bool)
    image[0, 8:12] = True
    with torch.no_grad():
        text_logits = model(rows).logits
        image_logits = model(rows, image_mask=image).logits
    assert (image_logits[0, 8:12] - text_logits[0, 8:12]).abs().max() > MATTERS
    torch.testing.assert_close(image_logits[0, :8], text_logits[0, :8], rtol=0, atol=SAME)  # causal
    # after the image span the n-grams restart, as at the row start
    hasher = model.model.engram_hasher
    after_image = hasher(rows, image)[0, 12]
    restarted = hasher(rows[:, 12:], None)[0, 0]
    assert torch.equal(after_image, restarted)


def test_engram_hashes_by_hand_and_over_the_normalised_vocabulary(model):
    from tokenizers import Tokenizer

    from dsv41_helpers import V41_TINY

    tokenizer = Tokenizer.from_file(str(V41_TINY / "tokenizer.json"))
    config, hasher = model.config, model.model.engram_hasher
    ids = torch.tensor([[tokenizer.token_to_id(t) for t in ("river", "the", "stone", "code")]])
    hashes = hasher(ids, None)  # [1, 4, layers, (max_ngram - 1) * heads]
    classes = hasher.token_map[ids[0]].tolist()
    pad = int(hasher.token_map[config.engram_pad_id])
    for layer_index, layer in enumerate(config.engram_layer_ids):
        bound = (np.iinfo(np.int64).max // config.engram_compressed_vocab_size) // 2
        multipliers = [int(m) * 2 + 1 for m in np.random.default_rng(10007 * layer).integers(0, bound, size=3)]
        primes = hasher.primes[layer_index]  # [[2-gram heads], [3-gram heads]]
        offsets = np.cumsum([0, *[p for heads in primes for p in heads]])
        for position in (0, 3):
            window = [classes[position - k] if position - k >= 0 else pad for k in range(3)]
            bigram = (window[0] * multipliers[0]) ^ (window[1] * multipliers[1])
            trigram = bigram ^ (window[2] * multipliers[2])
            expected = [bigram % p for p in primes[0]] + [trigram % p for p in primes[1]]
            expected = [value + int(offset) for value, offset in zip(expected, offsets)]
            assert hashes[0, position, layer_index].tolist() == expected
    # "THE" and "the" share a class, so the n-grams through them hash alike
    variant = ids.clone()
    variant[0, 1] = tokenizer.token_to_id("THE")
    assert torch.equal(hasher(variant, None), hashes)
    other = ids.clone()
    other[0, 1] = tokenizer.token_to_id("of")
    assert not torch.equal(hasher(other, None)[0, 1:], hashes[0, 1:])


def test_engram_without_the_token_map_is_refused():
    from modelzoo.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM

    from dsv41_helpers import V41_TINY

    model = DeepseekV41ForCausalLM(DeepseekV41Config.from_pretrained(V41_TINY))
    with pytest.raises(ValueError, match="normalised vocabulary"):
        model(random_rows(1, 4))
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        model.set_engram_token_map(list(range(250)))


def test_draft_markov_bias_follows_the_given_draft_tokens(model):
    rows = random_rows(1, 16, seed=5)
    anchors = rows.roll(-1, 1)
    with torch.no_grad():
        greedy = model(rows, draft_anchor_ids=anchors)
        forced = model(rows, draft_anchor_ids=anchors, draft_ids=(greedy.draft_ids[..., :-1] + 1) % 250)
    assert greedy.draft_logits.shape == (1, 16, 3, 250) and greedy.draft_confidence.shape == (1, 16, 3)
    torch.testing.assert_close(forced.draft_logits[:, :, 0], greedy.draft_logits[:, :, 0], rtol=0, atol=0)
    assert (forced.draft_logits[:, :, 1:] - greedy.draft_logits[:, :, 1:]).abs().max() > MATTERS
    # slot i + 1's Markov bias comes from the token chosen at slot i
    torch.testing.assert_close(greedy.draft_ids[..., 0], greedy.draft_logits[:, :, 0].argmax(-1))


def test_fp4_rounds_to_nearest_even_on_the_e2m1_grid():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -2.5])
    assert _round_to_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -2.0]
    assert _round_to_e2m1(torch.tensor([0.26, 1.3, 5.9, -6.0])).tolist() == [0.5, 1.5, 6.0, -6.0]


def test_fake_quantisation_values_and_straight_through_gradients():
    x = (torch.randn(4, 64, generator=torch.Generator().manual_seed(6)) * 3).requires_grad_()
    fp8 = fake_quant_fp8(x)
    blocks = x.detach().unflatten(-1, (-1, 32))
    scale = fp8.detach().unflatten(-1, (-1, 32)).abs().amax(-1) / blocks.abs().amax(-1)  # ~1: max kept within e4m3
    assert torch.allclose(scale, torch.ones_like(scale), atol=2**-3)
    power_scale = 2.0 ** torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 448))
    on_grid = fp8.detach().unflatten(-1, (-1, 32)) / power_scale
    assert torch.equal(on_grid.to(torch.float8_e4m3fn).float(), on_grid)
    fp4 = fake_quant_fp4(x, 16, True, "a test tensor")
    e4m3_scale = (x.detach().unflatten(-1, (-1, 16)).abs().amax(-1, keepdim=True) / 6).to(torch.float8_e4m3fn).float()
    grid = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    assert set((fp4.detach().unflatten(-1, (-1, 16)) / e4m3_scale).abs().flatten().tolist()) <= grid
    assert not torch.equal(fp4, x) and not torch.equal(fp8, x)
    (fp8 * 2 + fp4).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0), rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        fake_quant_fp8(torch.zeros(2, 48))
