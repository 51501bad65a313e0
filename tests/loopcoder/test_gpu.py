"""GPU only (run on the accelerator, not in CI): the fast attention path agrees with the exact one.

bf16 on both paths, one 4096-token sequence, a LoopCoder with release-like attention shapes
(head_dim 128, GQA 4:1, loop_window_size 64). Tolerance 2e-2 on token log-probabilities: bf16 keeps
8 bits of mantissa, and the two paths round at different places (flash/flex kernels accumulate in
fp32 and never materialise the probabilities; the exact path rounds scores and probabilities to bf16).
"""

import pytest
import torch

from modelzoo import build_provider, runtime

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = {
    "model_type": "iquestloopcoder", "architectures": ["IQuestLoopCoderForCausalLM"],
    "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "loop_num": 2, "loop_window_size": 64,
    "tie_word_embeddings": False,
}


def test_fast_path_matches_exact_path_bf16_4k():
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 4096), generator=torch.Generator().manual_seed(0)).cuda()
    with runtime.parallel(tp=1):
        exact_provider = build_provider(CONFIG, params_dtype=torch.bfloat16, attention="exact")
        exact = exact_provider.provide()
        # non-zero gates, so both attention branches matter
        for name, param in exact.named_parameters():
            if "loop_gate" in name:
                torch.nn.init.normal_(param, std=0.5)
        fast_provider = build_provider(CONFIG, params_dtype=torch.bfloat16, attention="fast")
        fast = fast_provider.provide()
        fast.load_state_dict(exact.state_dict())
        with torch.no_grad():
            exact_logprobs = exact_provider.token_logprobs(exact, ids)
            fast_logprobs = fast_provider.token_logprobs(fast, ids)
    difference = (exact_logprobs - fast_logprobs).abs().max().item()
    print(f"loopcoder fast vs exact, bf16, 1 x 4096: max |logprob diff| = {difference:.3e}")
    assert difference <= 2e-2
