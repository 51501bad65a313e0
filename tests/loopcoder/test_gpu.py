"""GPU only (run on the accelerator, not in CI): the fast attention path agrees with the exact one.

One 4096-token sequence, a LoopCoder with release-like attention shapes (head_dim 128, GQA 4:1,
loop_window_size 64), random weights and non-zero gates.
- fp32: the kernels themselves (SDPA / flex vs eager); FP32_TOLERANCE = 1e-4 as for the CPU parity tests.
- bf16: bounded by bf16 itself. bf16 keeps 8 bits of mantissa and the paths round at different places
  (flash/flex round the probabilities to bf16 before P.V), so no fixed bound fits every model and length:
  |fast - exact| must stay within BF16_MARGIN = 1.25 x the exact path's own bf16 error |exact(bf16) -
  exact(fp32)| on the same input (a fast path 25% noisier than bf16 rounding of the exact path fails).
  The figures are printed (docs/loopcoder.md records them).
"""

import pytest
import torch

from modelzoo import build_provider, runtime

pytestmark = pytest.mark.gpu

CONFIG = {
    "model_type": "iquestloopcoder", "architectures": ["IQuestLoopCoderForCausalLM"],
    "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "loop_num": 2, "loop_window_size": 64,
    "tie_word_embeddings": False,
}


FP32_TOLERANCE = 1e-4
BF16_MARGIN = 1.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fast_path_matches_exact_path_4k(dtype):
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 4096), generator=torch.Generator().manual_seed(0)).cuda()
    logprobs = {}
    with runtime.parallel(tp=1, seed=0), torch.no_grad():
        reference_provider = build_provider(CONFIG, params_dtype=torch.float32, attention="exact")
        reference = reference_provider.provide()
        for name, param in reference.named_parameters():
            if "loop_gate" in name:  # non-zero gates, so both attention branches matter
                torch.nn.init.normal_(param, std=0.5)
        logprobs["fp32 exact"] = reference_provider.token_logprobs(reference, ids)
        weights = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                   for k, v in reference.state_dict().items()}
        del reference
        for attention in ("exact", "fast"):
            provider = build_provider(CONFIG, params_dtype=dtype, attention=attention)
            model = provider.provide()
            model.load_state_dict(weights)
            logprobs[attention] = provider.token_logprobs(model, ids).float()
            del model
    difference = (logprobs["exact"] - logprobs["fast"]).abs().max().item()
    to_fp32 = {path: (logprobs[path] - logprobs["fp32 exact"]).abs().max().item() for path in ("exact", "fast")}
    print(f"loopcoder fast vs exact, {dtype}, 1 x 4096: max |logprob diff| = {difference:.3e} "
          f"(exact vs fp32 {to_fp32['exact']:.3e}, fast vs fp32 {to_fp32['fast']:.3e})")
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_MARGIN * to_fp32["exact"]
    assert difference <= tolerance
