"""attention="fast" (window_sink_attention: blocks of GEMMs, fp32 scores) against "exact" on a GPU.

Run on the accelerator: `pytest -m gpu tests/deepseek_v4/test_fast_attention_gpu.py -s`.
FAST_TOLERANCE = 1e-4 (fp32 log-probabilities), FAST_GRAD_TOLERANCE = 1e-4 (relative max-norm per
parameter): the same fp32 scores, a blocked softmax and a hand-written backward (~1e-6).
BF16_TOLERANCE = 0.1 on the bf16 head_dim-512 layer's outputs relative to their max: two bf16
attention implementations differ by a few bf16 ulps (2^-8); a wrong mask or sink is O(1).
"""

import time

import pytest
import torch
from dsv4_helpers import max_diff, provider_for, random_tokens, write_tiny

from modelzoo import runtime

pytestmark = pytest.mark.gpu

FAST_TOLERANCE = 1e-4
FAST_GRAD_TOLERANCE = 1e-4
BF16_TOLERANCE = 0.1


def test_fast_matches_exact_forward_and_backward(tmp_path):
    folder = write_tiny(tmp_path / "tiny")
    ids = random_tokens().cuda()
    results = {}
    with runtime.parallel():
        for attention in ("exact", "fast"):
            provider = provider_for(folder, attention=attention)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            logprobs = provider.token_logprobs(model, ids)
            (-logprobs.mean()).backward()
            grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).cpu() for n, p in model.named_parameters()}
            results[attention] = logprobs.detach().cpu(), grads
    assert max_diff(results["fast"][0], results["exact"][0]) <= FAST_TOLERANCE
    for name, reference in results["exact"][1].items():
        scale = reference.abs().max().item()
        assert max_diff(results["fast"][1][name], reference) <= FAST_GRAD_TOLERANCE * max(scale, 1e-30), name


@pytest.mark.parametrize("layer_type", ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
def test_fast_attention_at_release_head_dim(tmp_path, layer_type):
    """One bf16 attention layer with V4's head_dim 512 and rope dim 64, 2 x 4096 tokens: runs, agrees, and is timed."""
    from modelzoo.deepseek_v4.config import DeepseekV4Args
    from modelzoo.deepseek_v4.model.attention import DeepseekV4Attention

    folder = write_tiny(tmp_path / "wide", hidden_size=1024, num_attention_heads=16, head_dim=512, q_lora_rank=256,
                        o_groups=4, o_lora_rank=256, partial_rotary_factor=0.125, sliding_window=128,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                        index_n_heads=8, index_head_dim=128, index_topk=512, num_hidden_layers=1,
                        layer_types=[layer_type], mlp_layer_types=["moe"], num_nextn_predict_layers=0)
    x = torch.randn(2, 4096, 1024, device="cuda", dtype=torch.bfloat16)
    position_ids = torch.arange(4096, device="cuda").unsqueeze(0)
    outputs, timings = {}, {}
    with runtime.parallel():
        provider = provider_for(folder, params_dtype=torch.bfloat16)
        config = provider.transformer_config()
        args = DeepseekV4Args.from_hf(provider.hf_config)
        torch.manual_seed(0)
        exact = DeepseekV4Attention(config, args, layer_type, "exact").cuda()
        fast = DeepseekV4Attention(config, args, layer_type, "fast").cuda()
        fast.load_state_dict(exact.state_dict())
        with torch.no_grad():
            for p in exact.parameters():
                if p.dim() == 1 and p.dtype == torch.float32:  # sinks: give them weight
                    p.normal_()
            fast.load_state_dict(exact.state_dict())
        for name, module in (("exact", exact), ("fast", fast)):
            for _ in range(2):  # compile / warm up
                module(x, position_ids).float().sum().backward()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(3):
                out = module(x, position_ids)
                out.float().sum().backward()
            torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - start) / 3
            outputs[name] = out.detach().float()
    print(f"\n{layer_type}: fwd+bwd exact {timings['exact'] * 1e3:.1f} ms, fast {timings['fast'] * 1e3:.1f} ms, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    scale = outputs["exact"].abs().max().item()
    assert max_diff(outputs["fast"], outputs["exact"]) <= BF16_TOLERANCE * scale
