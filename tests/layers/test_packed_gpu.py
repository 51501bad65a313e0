"""GPU: the fast path on packed rows against the exact path (fp32), for Llama, LoopCoder and DeepSeek-V4.

The fast path on a GPU is flex_attention with a block mask built from the sequence ids (Llama, LoopCoder: no
[tokens, tokens] mask) and DeepSeek-V4's blocked window kernel run per sequence; the exact path is the eager math
that the CPU tests prove against the Hugging Face models. FAST_TOLERANCE = 1e-4 on fp32 log-probabilities: the
same math in another order (flash-style online softmax) moves them by ~1e-6.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

from modelzoo import build_provider, runtime
from modelzoo.layers.sequences import pack_sequences

pytestmark = pytest.mark.gpu

FAST_TOLERANCE = 1e-4


def _packed_logprobs(folder, attention: str, batch):
    provider = build_provider(folder, attention=attention)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    model.eval()
    with torch.no_grad():
        return provider.token_logprobs(model, batch.input_ids.cuda(), packed_seq_params=batch.packed_seq_params)


@pytest.mark.parametrize("name", ["llama-tiny", "loopcoder-tiny", "deepseek-v4-tiny"])
def test_fast_packed_path_equals_the_exact_path_in_fp32(name):
    folder = TINY / name
    longest = build_provider(folder).hf_config.max_position_embeddings
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 17, 40, 5, 70, longest, longest // 2 + 3]
    batch = pack_sequences([torch.randint(0, 250, (n,), generator=generator).tolist() for n in lengths], divisor=128,
                           device="cuda")
    with runtime.parallel():
        exact = _packed_logprobs(folder, "exact", batch)
        fast = _packed_logprobs(folder, "fast", batch)
    worst = max((a - b).abs().max().item() for a, b in zip(exact, fast) if a.numel())
    print(f"{name}: max |fast - exact| = {worst:.2e}")
    assert worst <= FAST_TOLERANCE
