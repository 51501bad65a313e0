"""DeepSeek-V4 blocks, one at a time, against transformers' modules holding the same weights (TP=1, fp32, CPU).

Weights reach both sides from the same tiny checkpoint: transformers by `from_pretrained`, Megatron
through the bridge. Inputs are random, [2, 64, hidden], longer than the sliding window (16) and
than the compressors' windows (4 and 16), with more compressed entries (16) than the indexer keeps (4).

COMPONENT_TOLERANCE = 1e-5 (max |diff|): both sides run the same fp32 formulas, so differences come
only from summation order and the order of two products (measured: bit-identical for attention,
compressors, indexer, routers and MoE; hyper-connections and head up to 1.1e-6, where our RMS scale is
applied to the map's output and transformers' to its input; decoder layers up to 2.4e-6, where our
residual also sums the 4 streams as a broadcast sum, transformers as a matmul); a wrong weight, layout,
mask, rope slice or op order moves these outputs by > 1e-3. Integer outputs (expert ids,
indexer picks, masks) must be identical.
"""

import pytest
import torch
from dsv4_helpers import hf_layer_inputs, hf_model, max_diff, provider_for, random_tokens, write_tiny

from modelzoo import runtime
from modelzoo.deepseek_v4.config import rope_inv_freq
from modelzoo.layers.sequences import plain_layout

COMPONENT_TOLERANCE = 1e-5
SLIDING, CSA, HCA, CSA_MOE = 0, 1, 2, 3  # the tiny model's layers: attention type (+ hash MoE on 0, 1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = write_tiny(tmp_path_factory.mktemp("dsv4") / "deepseek-v4-tiny")
    hf = hf_model(folder)
    with runtime.parallel():
        provider = provider_for(folder)
        mg = provider.provide()
        provider.load_hf_weights(mg, progress=False)
        mg.eval()
        with torch.no_grad():
            yield hf, mg


def _hidden(seed: int = 0, *shape: int) -> torch.Tensor:
    return torch.randn(*(shape or (2, 64, 64)), generator=torch.Generator().manual_seed(seed))


def _q_residual(hf, layer: int, x: torch.Tensor) -> torch.Tensor:
    attn = hf.model.layers[layer].self_attn
    return attn.q_a_norm(attn.q_a_proj(x))


def test_tiny_model_covers_every_layer_kind(models):
    hf, mg = models
    kinds = [(layer.layer_type, layer.mlp_type) for layer in mg.decoder.layers]
    assert kinds == [("sliding_attention", "hash_moe"), ("compressed_sparse_attention", "hash_moe"),
                     ("heavily_compressed_attention", "moe"), ("compressed_sparse_attention", "moe")]
    assert list(hf.config.layer_types) == [kind for kind, _ in kinds]


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_rope_tables(models, kind):
    hf, mg = models
    ours, scaling = rope_inv_freq(mg.args.rope_parameters[kind], mg.args.head_dim)
    reference = getattr(hf.model.rotary_emb, f"{kind}_inv_freq")
    assert scaling == getattr(hf.model.rotary_emb, f"{kind}_attention_scaling")
    assert max_diff(ours, reference) <= 1e-7 * reference.abs().max().item()  # fp32 rounding of the same formula
    if kind == "compress":  # the tiny config's YaRN really rescales some frequencies
        plain, _ = rope_inv_freq({**mg.args.rope_parameters[kind], "rope_type": "default"}, mg.args.head_dim)
        assert not torch.allclose(ours, plain)


@pytest.mark.parametrize("layer", [SLIDING, CSA, HCA])
def test_attention(models, layer):
    hf, mg = models
    x = _hidden(layer)
    position_ids, embeddings, mask = hf_layer_inputs(hf, x)
    reference, _ = hf.model.layers[layer].self_attn(x, position_embeddings=embeddings, position_ids=position_ids,
                                                    attention_mask=mask)
    ours = mg.decoder.layers[layer].self_attention(x, position_ids)
    assert max_diff(ours, reference) <= COMPONENT_TOLERANCE


@pytest.mark.parametrize("layer", [CSA, HCA])
def test_compressor(models, layer):
    hf, mg = models
    x = _hidden(10 + layer)
    position_ids = torch.arange(64).unsqueeze(0)
    q_residual = _q_residual(hf, layer, x)
    ref_kv, ref_bias = hf.model.layers[layer].self_attn.compressor(x, q_residual, position_ids, None, layer)
    kv, visibility = mg.decoder.layers[layer].self_attention.compressor(x, q_residual, position_ids)
    visible = visibility.dense(plain_layout(2, 64, "cpu"))
    assert kv.shape == (2, 1, 16 if layer == CSA else 4, 32)
    assert max_diff(kv, ref_kv) <= COMPONENT_TOLERANCE
    bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).unsqueeze(1)   # transformers' additive form
    assert torch.equal(bias, ref_bias)
    assert torch.isinf(bias).any() and (bias == 0).any()


@pytest.mark.parametrize("layer", [CSA, CSA_MOE])
def test_indexer_top_k(models, layer):
    hf, mg = models
    x = _hidden(20 + layer)
    position_ids = torch.arange(64).unsqueeze(0)
    q_residual = _q_residual(hf, layer, x)
    reference = hf.model.layers[layer].self_attn.compressor.indexer(x, q_residual, position_ids, None, layer)
    ours = mg.decoder.layers[layer].self_attention.compressor.indexer(x, q_residual, position_ids)
    assert ours.shape == (2, 64, 4)
    assert torch.equal(ours, reference)
    # late queries see all 16 entries and keep 4: the choice is a real top-k, not "everything visible"
    assert (ours[:, -1] >= 0).all() and len({tuple(row.tolist()) for row in ours[:, -8:].reshape(-1, 4)}) > 1


def test_hyper_connection_and_head(models):
    hf, mg = models
    streams = _hidden(30, 2, 64, 4, 64)
    for ours_hc, ref_hc in ((mg.decoder.layers[1].attn_hc, hf.model.layers[1].attn_hc),
                            (mg.decoder.layers[2].ffn_hc, hf.model.layers[2].ffn_hc)):
        (post, comb, collapsed, _), (ref_post, ref_comb, ref_collapsed) = ours_hc(streams), ref_hc(streams)
        assert max_diff(post, ref_post) <= COMPONENT_TOLERANCE
        assert max_diff(comb, ref_comb) <= COMPONENT_TOLERANCE
        assert max_diff(collapsed, ref_collapsed) <= COMPONENT_TOLERANCE
        assert (comb - comb.transpose(-1, -2)).abs().max() > 1e-3  # non-symmetric: a transposed mixer would show
    assert max_diff(mg.decoder.hc_head(streams), hf.model.hc_head(streams)) <= COMPONENT_TOLERANCE


@pytest.mark.parametrize("layer", [SLIDING, HCA])  # hash router, learned top-k router
def test_router(models, layer):
    hf, mg = models
    x, ids = _hidden(40 + layer), random_tokens(seed=layer)
    gate = hf.model.layers[layer].mlp.gate
    ref_logits, ref_weights, ref_ids = gate(x, ids) if layer == SLIDING else gate(x)
    logits, weights, expert_ids = mg.decoder.layers[layer].mlp.router(x, ids)
    assert torch.equal(expert_ids, ref_ids)
    assert max_diff(weights, ref_weights) <= COMPONENT_TOLERANCE
    assert max_diff(logits, ref_logits) <= COMPONENT_TOLERANCE
    assert len(torch.unique(expert_ids)) == 8  # every expert is used


@pytest.mark.parametrize("layer", [SLIDING, HCA])
def test_moe_block(models, layer):
    hf, mg = models
    x, ids = _hidden(50 + layer), random_tokens(seed=layer)
    reference = hf.model.layers[layer].mlp(x, input_ids=ids)
    ours = mg.decoder.layers[layer].mlp(x, ids)
    assert max_diff(ours, reference) <= COMPONENT_TOLERANCE
    shared = hf.model.layers[layer].mlp.shared_experts
    assert (shared.up_proj(x).abs() > hf.config.swiglu_limit).any()  # the swiglu clamp is exercised


@pytest.mark.parametrize("layer", [CSA, HCA])
def test_decoder_layer(models, layer):
    hf, mg = models
    streams, ids = _hidden(60 + layer, 2, 64, 4, 64), random_tokens(seed=layer)
    position_ids, embeddings, mask = hf_layer_inputs(hf, streams[:, :, 0])
    reference = hf.model.layers[layer](streams, position_embeddings=embeddings, position_ids=position_ids,
                                       attention_mask=mask, input_ids=ids)
    ours = mg.decoder.layers[layer](streams, position_ids, ids)
    assert max_diff(ours, reference) <= COMPONENT_TOLERANCE


def test_grouped_output_projection_forward_and_backward_float64():
    """wo_a's grouped GEMM writes tokens-first results into strided views (`bmm(out=)`): against a loop over
    the groups with autograd, float64, from a non-contiguous input (an exact match up to summation order)."""
    from modelzoo.deepseek_v4.model.attention import _GroupedMatmul

    with torch.enable_grad():  # the module's fixture holds no_grad
        generator = torch.Generator().manual_seed(5)
        groups, inputs, outputs = 3, 8, 5
        x = torch.randn(inputs, 10, groups, dtype=torch.float64, generator=generator).permute(1, 2, 0).requires_grad_()
        weight = torch.randn(groups * outputs, inputs, dtype=torch.float64, generator=generator).requires_grad_()
        upstream = torch.randn(10, groups, outputs, dtype=torch.float64, generator=generator)
        out = _GroupedMatmul.apply(x, weight, groups)
        reference = torch.stack([x[:, g] @ weight[g * outputs:(g + 1) * outputs].T for g in range(groups)], dim=1)
        assert out.shape == (10, groups, outputs) and max_diff(out, reference) <= 1e-12
        grads = torch.autograd.grad(out, (x, weight), upstream)
        reference_grads = torch.autograd.grad(reference, (x, weight), upstream)
        for grad, reference_grad in zip(grads, reference_grads, strict=True):
            assert max_diff(grad, reference_grad) <= 1e-12
