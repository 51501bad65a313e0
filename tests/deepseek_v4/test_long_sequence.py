"""Log-prob parity with transformers past the RoPE's original context (fp32, CPU): 4608 tokens at the release's
attention ratios (window 128, compress ratios 4 and 128, index top-k 512 of 1152 entries, YaRN factor 16 over
4096 original positions), where the other parity tests run 64 tokens.

At this length the indexer's top-k meets near-ties: in a run at 8192 tokens, 4 of 8192 query rows picked a
different set than transformers (fp32 scores equal up to the order of their sums), which moved the
log-probs by up to 0.066. So transformers' own choices (its indexer's top-k and its routers' experts,
taken with forward hooks) are replayed into ours (`replaying_decisions`), and the rest is compared at
LONG_TOLERANCE = 1e-5: fp32 sums in another order, as in the other parity tests (with the choices replayed
the 8192-token run agreed to 8.6e-6).
"""

import pytest
import torch
from dsv4_helpers import hf_model, hf_token_logprobs, provider_for, random_tokens, write_tiny

from modelzoo import runtime
from modelzoo.deepseek_v4.model.decisions import replaying_decisions

pytestmark = pytest.mark.slow

LONG_TOLERANCE = 1e-5
SEQ = 4608
RELEASE_RATIOS = dict(
    sliding_window=128, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    index_topk=512, max_position_embeddings=65536,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1},
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"], num_hidden_layers=3, num_nextn_predict_layers=0)


def _transformers_decisions_and_logprobs(folder, ids):
    """transformers' log-probs and its discrete choices, named as our deciders are."""
    model, decisions, hooks = hf_model(folder), {}, []

    def keep(name, pick):
        def hook(module, args, output):
            decisions[name] = pick(output).clone()
        return hook
    for index, layer in enumerate(model.model.layers):
        indexer = getattr(getattr(layer.self_attn, "compressor", None), "indexer", None)
        if indexer is not None:
            hooks.append(indexer.register_forward_hook(
                keep(f"decoder.layers.{index}.self_attention.compressor.indexer", lambda output: output)))
        hooks.append(layer.mlp.gate.register_forward_hook(
            keep(f"decoder.layers.{index}.mlp.router", lambda output: output[2])))  # (logits, weights, experts)
    with torch.no_grad():
        logprobs = hf_token_logprobs(model, ids)
    return decisions, logprobs


@pytest.mark.parametrize("attention", ["exact", "fast"])
def test_logprobs_match_transformers_past_the_original_context(tmp_path, attention):
    folder = write_tiny(tmp_path / "long", **RELEASE_RATIOS)
    ids = random_tokens(1, SEQ)
    decisions, reference = _transformers_decisions_and_logprobs(folder, ids)
    assert set(decisions) == {"decoder.layers.0.mlp.router", "decoder.layers.1.mlp.router",
                              "decoder.layers.2.mlp.router", "decoder.layers.1.self_attention.compressor.indexer"}
    assert decisions["decoder.layers.1.self_attention.compressor.indexer"].shape == (1, SEQ, 512)
    with runtime.parallel():
        provider = provider_for(folder, attention=attention)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        with torch.no_grad(), replaying_decisions(model, decisions):
            ours = provider.token_logprobs(model, ids)
    assert (ours - reference).abs().max().item() <= LONG_TOLERANCE
