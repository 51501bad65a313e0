"""Shared helpers of the DeepSeek-V4.1 tests (a plain module, not a conftest, so it cannot shadow tests/conftest.py)."""

from __future__ import annotations


import torch

from conftest import TINY

V41_TINY = TINY / "deepseek-v41-tiny"


def load_tiny():
    """Our reference model from the shipped tiny checkpoint (fp32, eval)."""
    from modelzoo.deepseek_v41 import DeepseekV41ForCausalLM

    return DeepseekV41ForCausalLM.from_pretrained(V41_TINY, dtype=torch.float32).eval()


def tiny_generator():
    """tiny_checkpoints/deepseek_v41_tiny.py (the tiny generators are a package of their own, not modelzoo's)."""
    from tiny_checkpoints import deepseek_v41_tiny

    return deepseek_v41_tiny


def random_rows(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token ids of ordinary tokens (ids 0-5 are the special tokens)."""
    return torch.randint(6, 250, (batch, length), generator=torch.Generator().manual_seed(seed))


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def next_token_logprobs(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """log p(rows[:, t + 1] | rows[:, :t + 1]) [B, S - 1] (fp32), from logits over the real vocabulary."""
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, rows[:, 1:, None])[..., 0]


# checkpoint tensors the Megatron model holds as buffers (exported as values, never trained)
BUFFERS = (".gate.bias", ".gate.bias_vl", "image_start", "image_end", "image_newline")


def megatron_grads_as_hf(provider, model) -> dict[str, torch.Tensor]:
    """Each parameter replaced by its gradient (zeros without one), exported: gradients by checkpoint name
    (collective over the ranks); buffers left out."""
    for param in model.parameters():
        param.data = param.grad if param.grad is not None else torch.zeros_like(param)
    return {name: grad for name, grad in provider.export_hf_weights(model) if not name.endswith(BUFFERS)}


def megatron_trainable_names(provider, model) -> set[str]:
    """The checkpoint names of the Megatron model's trainable parameters."""
    from modelzoo.conversion.engine import megatron_tensors

    table = provider.mapping()
    names = set()
    for name, tensor in megatron_tensors(model).items():
        if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
            rule, indices = table.for_megatron(name)
            names.update(rule.hf_names(indices))
    return names


def relative_errors(ours: dict, reference: dict) -> dict[str, float]:
    """max|ours - reference| / max|reference| per tensor of `reference`."""
    return {name: ((ours[name].double() - ref.double()).abs().max() / ref.double().abs().max()).item()
            for name, ref in reference.items()}


# The Megatron model's gradients against the reference's (see test_v41_megatron_parity.py for the measurements):
# per tensor, max |diff| / max |float64 reference| within GRAD_TOLERANCE (HC_SCALE_TOLERANCE for the hyper-connection
# scales, three numbers each summing the gradient of every token and stream), or CONDITIONING_FACTOR times the
# error of the fp32 reference's own gradient of that tensor where that is larger (sums with heavy cancellation).
LOGPROB_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5
HC_SCALE_TOLERANCE = 1e-4
CONDITIONING_FACTOR = 4
HC_SCALES = ("hc_attn_scale", "hc_ffn_scale")


def trainable_reference(folder, dtype: torch.dtype = torch.float32):
    """Our reference (eval) with its Engram tables made trainable, as the Megatron side's
    (`train_engram_tables=True`), so that their backward is compared too."""
    from modelzoo.deepseek_v41 import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    for name, param in model.named_parameters():
        if ".engram.embed.weight" in name:
            param.requires_grad_(True)
    return model


def grad_tolerances(reference_grads: dict, float64_grads: dict) -> dict[str, float]:
    """Each tensor's bar for `relative_errors(ours, float64_grads)` (the scheme above)."""
    conditioning = relative_errors(reference_grads, float64_grads)
    return {name: max(HC_SCALE_TOLERANCE if name.endswith(HC_SCALES) else GRAD_TOLERANCE, CONDITIONING_FACTOR * error)
            for name, error in conditioning.items()}


def gradients_too_far(grads: dict, float64_grads: dict, tolerances: dict) -> dict[str, tuple[float, float]]:
    """name -> (error, bar) of the gradients outside their bar (empty when all pass)."""
    errors = relative_errors(grads, float64_grads)
    return {name: (error, tolerances[name]) for name, error in errors.items() if not error <= tolerances[name]}


MECHANISMS = ("engram", "candidate restriction", "reuse", "single-pass pre")


def switch_off(model, mechanism: str, monkeypatch):
    """Our reference `model` without one of V4.1's mechanisms (a test's `monkeypatch` undoes the last one)."""
    from modelzoo.deepseek_v41.hf_model import DeepseekV41DecoderLayer

    for layer in model.model.layers:
        attn = layer.attn
        if mechanism == "engram":
            layer.engram = None
        elif mechanism == "candidate restriction":
            attn.uses_candidates = False
        elif mechanism == "reuse" and attn.ratio and not attn.is_index_source:  # a reuse layer: window only
            attn.reads_compressed = False
    if mechanism == "single-pass pre":
        monkeypatch.setattr(DeepseekV41DecoderLayer, "forward", _own_pre_forward)
    return model


def _own_pre_forward(self, streams, previous_pre, *, attention, ffn_kwargs):
    """DeepSeek-V4's order: each site collapses its input with its own pre."""
    attn_pre, attn_post, attn_comb = self.hc_mixes(streams, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
    streams = self.hc_expand(attention(self.attn_norm(self.hc_collapse(streams, attn_pre))), streams, attn_post,
                             attn_comb)
    ffn_pre, ffn_post, ffn_comb = self.hc_mixes(streams, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
    output = self.ffn(self.ffn_norm(self.hc_collapse(streams, ffn_pre)), **ffn_kwargs)
    return self.hc_expand(output, streams, ffn_post, ffn_comb), ffn_pre
