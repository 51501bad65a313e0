"""GPU only: attention="fast" vs "exact" on a 4096-token sequence at release attention ratios.

Window 128, compress ratios 4 (CSA) and 128 (HCA), index top-k 512, as in the release configs; a
small width so it runs in seconds. fp32: FP32_TOLERANCE = 1e-4, as the CPU parity tests. bf16: bounded by
bf16 itself, |fast - exact| <= BF16_MARGIN = 1.25 x |exact(bf16) - exact(fp32)| on the same input and the same
decisions (the paths round at different places; a fast path 25% noisier than the exact path's own bf16
rounding fails).

The fast path replays the exact path's discrete decisions (indexer picks, routed experts): with
top-512 of 1024 compressed entries and top-k routing, the rounding difference of any two kernels
swaps near-tied candidates somewhere in 4096 tokens, and one swapped expert moves that token by a
whole expert's share: a comparison of kernels, not of tie-breaking. The free-running difference is
printed too (docs/deepseek_v4.md records both).
"""

import pytest
import torch
from dsv4_helpers import max_diff, provider_for, write_tiny

from modelzoo import runtime
from modelzoo.deepseek_v4.model.decisions import recording_decisions, replaying_decisions

pytestmark = pytest.mark.gpu

RELEASE_RATIOS = dict(
    hidden_size=512, num_attention_heads=8, head_dim=128, partial_rotary_factor=0.5, q_lora_rank=256,
    o_groups=4, o_lora_rank=128, sliding_window=128, index_n_heads=8, index_head_dim=64, index_topk=512,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                     "beta_fast": 32, "beta_slow": 1},
)


FP32_TOLERANCE = 1e-4
BF16_MARGIN = 1.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fast_matches_exact_at_release_ratios_4k(tmp_path, dtype):
    folder = write_tiny(tmp_path / "release-ratios", **RELEASE_RATIOS)
    ids = torch.randint(0, 250, (1, 4096), generator=torch.Generator().manual_seed(0)).cuda()
    logprobs = {}
    with runtime.parallel(), torch.no_grad():
        runs = {}
        for name, attention, run_dtype in (("fp32 exact", "exact", torch.float32), ("exact", "exact", dtype),
                                           ("fast", "fast", dtype)):
            provider = provider_for(folder, attention=attention, params_dtype=run_dtype)
            runs[name] = provider, provider.provide()
            provider.load_hf_weights(runs[name][1], progress=False)
        provider, model = runs["exact"]
        with recording_decisions(model) as decisions:
            logprobs["exact"] = provider.token_logprobs(model, ids).float().cpu()
        provider, model = runs["fast"]
        logprobs["fast, free-running"] = provider.token_logprobs(model, ids).float().cpu()
        with replaying_decisions(model, decisions):
            logprobs["fast"] = provider.token_logprobs(model, ids).float().cpu()
        provider, model = runs["fp32 exact"]
        with replaying_decisions(model, decisions):
            logprobs["fp32 exact"] = provider.token_logprobs(model, ids).float().cpu()
    free_running = max_diff(logprobs["fast, free-running"], logprobs["exact"])
    difference = max_diff(logprobs["fast"], logprobs["exact"])
    to_fp32 = {path: max_diff(logprobs[path], logprobs["fp32 exact"]) for path in ("exact", "fast")}
    print(f"deepseek_v4 release ratios, {dtype}, 1 x 4096: fast vs exact max |logprob diff| = {difference:.3e} "
          f"(same decisions), {free_running:.3e} (free-running); exact vs fp32 {to_fp32['exact']:.3e}, "
          f"fast vs fp32 {to_fp32['fast']:.3e} (same decisions)")
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_MARGIN * to_fp32["exact"]
    assert difference <= tolerance
