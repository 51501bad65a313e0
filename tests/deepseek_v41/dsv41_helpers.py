"""Shared helpers of the DeepSeek-V4.1 tests (a plain module, not a conftest, so it cannot shadow tests/conftest.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

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
    """The gradients by checkpoint name (zeros for a parameter without one; collective over the ranks), exported as
    the weights are, which are put back afterwards; buffers left out."""
    params = list(model.parameters())
    weights = [param.data for param in params]
    for param in params:
        param.data = param.grad if param.grad is not None else torch.zeros_like(param)
    try:
        return {name: grad.clone() for name, grad in provider.export_hf_weights(model) if not name.endswith(BUFFERS)}
    finally:
        for param, weight in zip(params, weights):
            param.data = weight


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


# The Megatron model against our reference (every test of it uses these bars).
# LOGPROB_TOLERANCE = 1e-5: the bar; the two sides run the same fp32 math in a different summation order
# (measured ~5e-6 at most). Gradients are compared with the reference's gradient computed in float64 (the true
# gradient of the same weights, up to the fp32 steps the reference keeps), per tensor as max |diff| / max |reference|:
# GRAD_TOLERANCE = 1e-5 (HC_SCALE_TOLERANCE = 1e-4 for the hyper-connection scales hc_*_scale, three numbers each
# summing the gradient of every token and stream, as in V4's tests), or CONDITIONING_FACTOR = 4 times the error the
# fp32 reference's own gradient of that tensor has, where that is larger. The fp32 reference is itself up to ~7e-5
# from its float64 gradient on tensors whose gradient is a sum with heavy cancellation (the Engram's q_weight /
# k_weight: one number per stream and channel, summed over every token; the first layers' hyper-connection maps): a
# 1e-5 bar against another fp32 run would measure summation order, not correctness (measured: ours 1.1e-4, the fp32
# reference 6.9e-5 from float64 on layer 1's engram q_weight; 1e-5 or less on most tensors).
# The fast attention (`attention="fast"`, V4's window attention: blocks of GEMMs, a softmax through the saved
# log-sum-exp) sums in another order than the reference, so its fp32 gradient error is a draw independent of the
# reference's, where the exact path's follows it (the same ops in the same order): on tensors with heavy
# cancellation it lands a few times above the conditioning bar (measured 1.1e-5 at TP 1 and 1.5e-5 at TP 2 x CP 2
# on layer 2's expert 2 w3, whose fp32 reference is 2.7e-6 off; keeping the log-sum-exp in float64 moves it to
# 1.5e-5, so it is summation order, not the softmax's precision). Its gradients get FAST_GRAD_TOLERANCE = 1e-4,
# DeepSeek-V4's fast-path bar (tests/deepseek_v4/test_fast_attention_gpu.py), or their conditioning bar where
# larger; a wrong key or pick moves a gradient by far more (the layer outputs agree to ~3e-7, see
# test_v41_fast_attention.py).
LOGPROB_TOLERANCE = 1e-5
FAST_GRAD_TOLERANCE = 1e-4
DRAFT_TOLERANCE = 1e-4  # draft logits (not log-probs): O(1) values after three more layers and a second head
GRAD_TOLERANCE = 1e-5
HC_SCALE_TOLERANCE = 1e-4
CONDITIONING_FACTOR = 4
HC_SCALES = ("hc_attn_scale", "hc_ffn_scale")


def grad_tolerances(fp32_grads: dict, float64_grads: dict) -> dict[str, float]:
    """The bar of each tensor: GRAD_TOLERANCE (HC_SCALE_TOLERANCE for hc_*_scale), or CONDITIONING_FACTOR times the
    fp32 reference's own error against its float64 gradient, where that is larger."""
    conditioning = relative_errors(fp32_grads, float64_grads)
    return {name: max(HC_SCALE_TOLERANCE if name.endswith(HC_SCALES) else GRAD_TOLERANCE, CONDITIONING_FACTOR * error)
            for name, error in conditioning.items()}


def gradients_too_far(grads: dict, float64_grads: dict, tolerances: dict) -> dict[str, tuple[float, float]]:
    """name -> (error, bar) of the gradients outside their bar (empty when all pass)."""
    errors = relative_errors(grads, float64_grads)
    return {name: (error, tolerances[name]) for name, error in errors.items() if not error <= tolerances[name]}


def trainable_reference(folder, dtype: torch.dtype = torch.float32):
    """Our reference (eval) with its Engram tables made trainable, as the Megatron side's
    (`train_engram_tables=True`), so that their backward is compared too."""
    from modelzoo.deepseek_v41 import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    for name, param in model.named_parameters():
        if ".engram.embed.weight" in name:
            param.requires_grad_(True)
    return model


def reference_by_form(batches: dict[str, list[torch.Tensor]], dtype: torch.dtype, divisor) -> dict:
    """Per form (name -> the batches our reference runs, each whole sequences): the log-probs of each batch and the
    gradients of minus their sum divided by `divisor(form, logprobs)` (the loss a parallel run reduces to)."""
    results = {}
    for form, form_batches in batches.items():
        model = trainable_reference(V41_TINY, dtype)
        logprobs = [next_token_logprobs(model(batch).logits, batch) for batch in form_batches]
        (-sum(values.sum() for values in logprobs) / divisor(form, logprobs)).backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        results[form] = dict(logprobs=[values.detach() for values in logprobs], grads=grads)
    return results


def reference_run(folder, rows: torch.Tensor, dtype: torch.dtype = torch.float32, fake_quant: bool = False):
    """Our reference: token log-probs, draft output, and the gradients of -mean(log-probs) by name (Engram tables
    made trainable)."""
    model = trainable_reference(folder, dtype)
    output = model(rows, draft_anchor_ids=rows.roll(-1, 1), fake_quant=fake_quant)
    logprobs = next_token_logprobs(output.logits, rows)
    (-logprobs.mean()).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    draft = (output.draft_logits.detach(), output.draft_confidence.detach(), output.draft_ids)
    return logprobs.detach(), draft, grads


def megatron_run(folder, rows: torch.Tensor, tp: int, ep: int, rank: int, checkpoint=None, fake_quant: bool = False):
    """The Megatron model of `folder` (Engram tables trainable) on tp x ep ranks, as `rank` sees it: (token
    log-probs, (draft logits, confidence, ids), gradients of the reference's loss by checkpoint name, the names of the
    trainable parameters, its HF export: the tensors on rank 0, their names elsewhere). EP ranks are data-parallel
    replicas with one row each; the dense gradients are summed over them. `checkpoint`: a folder to save it to."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from modelzoo import build_provider, runtime
    from modelzoo.conversion import megatron_ckpt

    with runtime.parallel(tp=tp, ep=ep):
        provider = build_provider(folder, train_engram_tables=True, fake_quant=fake_quant)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        model.eval()
        exported = dict(provider.export_hf_weights(model))
        if checkpoint is not None:
            megatron_ckpt.save(model, checkpoint, metadata={"architecture": "deepseek_v41", "tp": tp, "ep": ep})
        mine = rows if ep == 1 else rows[rank:rank + 1]  # EP ranks are data-parallel replicas: different rows
        logits, draft = model(mine, draft_anchor_ids=mine.roll(-1, 1), runtime_gather_output=True)
        logprobs = next_token_logprobs(logits[..., :provider.vocab_size], mine)
        (-logprobs.sum() / rows[:, 1:].numel()).backward()  # = the reference's -mean over the whole batch
        if ep > 1:
            for param in model.parameters():  # the data-parallel sum of the dense (non-expert) gradients
                if getattr(param, "allreduce", True) and param.grad is not None:
                    dist.all_reduce(param.grad, group=parallel_state.get_data_parallel_group())
        trainable = megatron_trainable_names(provider, model)
        grads = megatron_grads_as_hf(provider, model)
        return (logprobs.detach(), (draft.logits.detach(), draft.confidence.detach(), draft.ids),
                grads, trainable, exported if rank == 0 else sorted(exported))


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


# The rows and checkpoint of the parity tests, as module-scoped fixtures (import them by name into a test module)
GROWN_TABLE = "model.layers.1.engram.embed"


@pytest.fixture(scope="module")
def rows():
    return random_rows(2, 64, seed=0)


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """deepseek-v41-tiny with layer 1's Engram table grown by one row (241: TP 2 pads it)."""
    folder = tmp_path_factory.mktemp("v41") / "deepseek-v41-tiny-grown"
    shutil.copytree(V41_TINY, folder)
    tensors = load_file(folder / "model.safetensors")
    for leaf in ("weight", "scale"):
        table = tensors[f"{GROWN_TABLE}.{leaf}"]
        tensors[f"{GROWN_TABLE}.{leaf}"] = torch.cat([table, torch.full_like(table[:1], 0.5)])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["engram_num_embeddings"][0] += 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def reference(grown, rows):
    return reference_run(grown, rows)


@pytest.fixture(scope="module")
def float64_grads(grown, rows):
    return reference_run(grown, rows, torch.float64)[2]


@pytest.fixture(scope="module")
def tolerances(reference, float64_grads):
    """Each tensor's gradient bar for the rows above (grad_tolerances)."""
    return grad_tolerances(reference[2], float64_grads)
