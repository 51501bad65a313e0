"""Shared helpers of the DeepSeek-V4 tests (a plain module, not a conftest, so it cannot shadow tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.masking_utils import create_sliding_window_causal_mask

from modelzoo.conversion import megatron_ckpt
from modelzoo import runtime
from modelzoo.deepseek_v4.provider import DeepseekV4Provider
from tiny_checkpoints.deepseek_v4_tiny import DEEPSEEK_V4_TINY, write_deepseek_v4_tiny

VOCAB = DEEPSEEK_V4_TINY["vocab_size"]
BATCH, SEQ = 2, 64


def write_tiny(folder: Path, **changes) -> Path:
    write_deepseek_v4_tiny(folder, {**DEEPSEEK_V4_TINY, **changes})
    return folder


def provider_for(folder: Path, **overrides) -> DeepseekV4Provider:
    config = DeepseekV4Config.from_dict(json.loads((Path(folder) / "config.json").read_text()))
    return DeepseekV4Provider(config, hf_dir=folder, **overrides)


def assert_reloads_in_one_process(folder: Path, checkpoint: Path) -> None:
    """The Megatron checkpoint `checkpoint` (saved at any layout) loaded into one process exports the HF weights
    of `folder` bit-exactly."""
    source = load_file(Path(folder) / "model.safetensors")
    with runtime.parallel():
        provider = provider_for(folder)
        model = provider.provide()
        megatron_ckpt.load(model, checkpoint)
        exported = dict(provider.export_hf_weights(model))
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name


def hf_model(folder: Path) -> DeepseekV4ForCausalLM:
    return DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def random_tokens(batch: int = BATCH, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_token_logprobs(model, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids, use_cache=False).logits.to(torch.float64 if model.dtype == torch.float64 else torch.float32)
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]


def hf_layer_inputs(model, x: torch.Tensor):
    """What DeepseekV4Model.forward hands its attention layers: position ids, {main, compress} cos/sin, mask."""
    position_ids = torch.arange(x.shape[1]).unsqueeze(0)
    rotary = model.model.rotary_emb
    embeddings = {kind: rotary(x, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None, cache=None,
                                             position_ids=position_ids)
    return position_ids, embeddings, mask


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


BUFFERS = ("ffn.gate.tid2eid", "ffn.gate.bias")  # checkpoint tensors that are buffers, not parameters


def hf_logprobs_and_grads(folder: Path, input_ids: torch.Tensor, scratch: Path):
    """transformers' token log-probs and the gradients of -mean(log-probs), by checkpoint name.

    save_pretrained of the model with every parameter replaced by its gradient names the gradients
    exactly as the checkpoint names the weights (experts split per expert, native leaf names).
    """
    model = hf_model(folder)
    logprobs = hf_token_logprobs(model, input_ids)
    (-logprobs.mean()).backward()
    return logprobs.detach(), hf_grads_by_name(model, scratch)


def hf_grads_by_name(model, scratch: Path) -> dict[str, torch.Tensor]:
    """The HF model's gradients by checkpoint name (save_pretrained of the model with every parameter replaced by
    its gradient); the parameters are restored and their gradients cleared."""
    from safetensors.torch import load_file

    weights = {param: param.data for param in model.parameters()}
    for param in model.parameters():
        param.data = param.grad if param.grad is not None else torch.zeros_like(param)
    model.save_pretrained(scratch)
    for param, data in weights.items():
        param.data, param.grad = data, None
    return {name: g for name, g in load_file(scratch / "model.safetensors").items() if not name.endswith(BUFFERS)}


def megatron_grads_as_hf(provider, model) -> dict[str, torch.Tensor]:
    """Replace every parameter by its gradient and export: gradients by checkpoint name (collective)."""
    for param in model.parameters():
        param.data = param.grad if param.grad is not None else torch.zeros_like(param)
    return {name: g for name, g in provider.export_hf_weights(model) if not name.endswith(BUFFERS)}


def relative_grad_errors(ours: dict, reference: dict) -> dict[str, float]:
    """Per tensor max|ours - ref| / max|ref|; tensors without a gradient path must be exactly zero."""
    errors = {}
    for name, ref in reference.items():
        scale = ref.abs().max().item()
        if scale == 0:  # no gradient path in transformers (the indexer: a top-k of indices)
            assert ".indexer." in name and ours[name].abs().max().item() == 0, name
            continue
        errors[name] = max_diff(ours[name], ref) / scale
    return errors


def worst_relative_grad_error(ours: dict, reference: dict) -> tuple[float, str]:
    errors = relative_grad_errors(ours, reference)
    name = max(errors, key=errors.get)
    return errors[name], name


def hf_float64_grads(folder: Path, input_ids: torch.Tensor, scratch: Path) -> dict[str, torch.Tensor]:
    """Gradients of transformers' model run in float64 (eager experts loop): the 'true' gradient."""
    from safetensors.torch import load_file

    model = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager").eval()
    (-hf_token_logprobs(model, input_ids).mean()).backward()
    for param in model.parameters():
        param.data = param.grad if param.grad is not None else torch.zeros_like(param)
    model.save_pretrained(scratch)
    return {name: g for name, g in load_file(scratch / "model.safetensors").items() if not name.endswith(BUFFERS)}


def reference_mtp_logits(folder: Path, scratch: Path, ids: torch.Tensor) -> torch.Tensor:
    """MTP depth 1 by its published formulation (DeepSeek-V3 §2.2, V4's reference `MTPBlock`) on transformers'
    modules: the main model's final hyper-connection streams h, then
        logits_i = head(norm(hc_head(Block(e_proj(enorm(Emb(t_{i+1}))) + h_proj(hnorm(h_i))))))
    with `Block` transformers' DeepseekV4DecoderLayer (sliding attention, learned router) holding the mtp.0.* weights
    (a 1-layer model saved to `scratch`); t_{i+1} past the end is token 0."""
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    block = {name.replace("mtp.0.", "model.layers.0.").replace(".attn.kv_norm.", ".attn.norm."): tensor
             for name, tensor in weights.items()
             if name.startswith("mtp.0.") and name.split(".")[2] not in ("enorm", "hnorm", "norm", "e_proj", "h_proj")
             and not name.startswith("mtp.0.hc_head")}
    block |= {"model.embed_tokens.weight": weights["model.embed_tokens.weight"], "head.weight": weights["head.weight"],
              "model.norm.weight": weights["mtp.0.norm.weight"],
              **{f"model.hc_head.hc_{p}": weights[f"mtp.0.hc_head_{p}"] for p in ("fn", "base", "scale")}}
    scratch.mkdir(exist_ok=True)
    save_file(block, scratch / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    DeepseekV4Config.from_dict({
        **config, "num_hidden_layers": 1, "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"],
        "num_nextn_predict_layers": 0}).save_pretrained(scratch)
    one_layer, info = DeepseekV4ForCausalLM.from_pretrained(scratch, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    one_layer.eval()

    main = hf_model(folder)
    captured = {}
    main.model.hc_head.register_forward_pre_hook(lambda module, args: captured.update(streams=args[0]))
    main(ids, use_cache=False)
    streams = captured["streams"]                                          # [B, S, hc, hidden]

    def rms(x, weight, eps=config["rms_norm_eps"]):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    next_tokens = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)   # t_{i+1}
    e = rms(main.model.embed_tokens(next_tokens), weights["mtp.0.enorm.weight"])
    h = rms(streams, weights["mtp.0.hnorm.weight"])
    x = F.linear(e, weights["mtp.0.e_proj.weight"]).unsqueeze(2) + F.linear(h, weights["mtp.0.h_proj.weight"])
    position_ids, embeddings, mask = hf_layer_inputs(one_layer, x[:, :, 0])
    x = one_layer.model.layers[0](x, position_embeddings=embeddings, position_ids=position_ids, attention_mask=mask,
                                  input_ids=next_tokens)
    return one_layer.lm_head(one_layer.model.norm(one_layer.model.hc_head(x)))
