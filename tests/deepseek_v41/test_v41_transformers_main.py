"""Our reference against transformers' own DeepseekV41ForCausalLM, when the installed transformers has one (5.25
has none; its main branch does). The known differences are switched to agree: transformers' cache path (its
cacheless path appends the compressed K/V of successive KV sources), our opt-in fake quantisation (transformers
always quantises), and top-k ties broken to the lower index in transformers too (exact ties are common on the
tiny checkpoint, where every indexer head's relu is often 0, and torch.topk leaves their order open).
Tolerance 1e-4 on log-probs: fp32 with a different order of the same operations (the hc normalisation before vs
after its projection) over 10 layers; an ad hoc run on transcribed sources measured 3e-6."""

import pytest
import torch
from dsv41_helpers import V41_TINY, load_tiny, log_probs, random_rows

from modelzoo.deepseek_v41.config import TRANSFORMERS_HAS_DEEPSEEK_V41

pytestmark = pytest.mark.skipif(not TRANSFORMERS_HAS_DEEPSEEK_V41,
                                reason="the installed transformers has no deepseek_v41")


def _stable_topk(tensor, k, dim=-1, largest=True, sorted=True):
    order = tensor.sort(dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))


def test_log_probs_match_transformers_where_it_follows_the_release(monkeypatch):
    from transformers import PreTrainedTokenizerFast
    from transformers.models.deepseek_v41 import DeepseekV41ForCausalLM as TransformersDeepseekV41

    theirs = TransformersDeepseekV41.from_pretrained(V41_TINY, dtype=torch.float32).eval()
    theirs.model.bind_tokenizer(PreTrainedTokenizerFast(tokenizer_file=str(V41_TINY / "tokenizer.json")))
    ours = load_tiny()
    rows = random_rows(2, 64)
    monkeypatch.setattr(torch.Tensor, "topk", _stable_topk)
    with torch.no_grad():
        reference = log_probs(theirs(rows, use_cache=True).logits)
        mine = log_probs(ours(rows, fake_quant=True).logits)
    assert (reference - mine).abs().max().item() <= 1e-4
