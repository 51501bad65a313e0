"""Llama baseline: Megatron vs transformers' LlamaForCausalLM, and bit-exact weight round trips.

Tolerance 1e-4 on token log-probabilities in fp32: the two models do the same math in a different
order (fused QKV, Megatron's RoPE and norm kernels), which moves results by ~1e-6; 1e-4 is far below
what a wrong weight or layout produces (> 1e-2 on these random weights).
"""

import pytest
import torch
from conftest import write_llama_variant

from modelzoo import build_provider, runtime
from modelzoo.parity import hf_outputs, megatron_outputs

LOGPROB_TOLERANCE = 1e-4


def random_tokens(vocab: int, batch: int = 2, seq: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tp", [1, 2])
def test_logprob_parity(llama_tiny, tp):
    ids = random_tokens(256)
    [(ours, _)] = megatron_outputs(llama_tiny, [ids], tp=tp, with_logits=False)
    [(reference, _)] = hf_outputs(llama_tiny, [ids])
    assert ours.shape == (2, 31)
    assert (ours - reference).abs().max().item() <= LOGPROB_TOLERANCE


def test_logprob_parity_head_dim_not_hidden_over_heads(tmp_path, make_tiny):
    folder = write_llama_variant(tmp_path / "llama-hd24", make_tiny, head_dim=24)
    ids = random_tokens(256, seed=1)
    [(ours, _)] = megatron_outputs(folder, [ids], tp=2, with_logits=False)
    [(reference, _)] = hf_outputs(folder, [ids])
    assert (ours - reference).abs().max().item() <= LOGPROB_TOLERANCE


def test_padded_vocabulary_gets_no_probability(tmp_path, make_tiny):
    # vocab 200 is padded to 256 rows in Megatron; padded logits must not take softmax mass
    folder = write_llama_variant(tmp_path / "llama-v200", make_tiny, vocab_size=200)
    ids = random_tokens(200, seed=2)
    [(ours, logits)] = megatron_outputs(folder, [ids], tp=2)
    [(reference, reference_logits)] = hf_outputs(folder, [ids])
    assert logits.shape[-1] == 200
    assert (ours - reference).abs().max().item() <= LOGPROB_TOLERANCE


def _round_trip(rank, folder, tp):
    with runtime.parallel(tp=tp):
        provider = build_provider(folder)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        return dict(provider.export_hf_weights(model))


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_hf_round_trip_is_bit_exact(llama_tiny, tp):
    from safetensors.torch import load_file

    original = load_file(llama_tiny / "model.safetensors")
    for exported in runtime.run(_round_trip, tp, llama_tiny, tp):
        assert exported.keys() == original.keys()
        for name, tensor in original.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_bf16_checkpoint_keeps_its_dtype_through_the_round_trip(tmp_path, make_tiny):
    from safetensors.torch import load_file, save_file

    folder = write_llama_variant(tmp_path / "bf16", make_tiny)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(folder / "model.safetensors").items()}
    save_file(weights, folder / "model.safetensors")

    def provider_bf16_round_trip(rank):
        with runtime.parallel(tp=1):
            provider = build_provider(folder, params_dtype=torch.bfloat16)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            return dict(provider.export_hf_weights(model))

    exported = runtime.run(provider_bf16_round_trip, 1)[0]
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], v) for k, v in weights.items())
