"""The merged export on a base whose weights lie on the FP8 E4M3 grid (bf16 copies of FP8 values): exactly the
adapted projections change, no other byte does, and the base stays untouched.

Adapted here: q_proj and v_proj (so k_proj shares the fused linear_qkv but must come out byte for byte) and
down_proj. The merged values are checked exactly against W + (alpha/r) B A computed here in fp32 and rounded once
to bf16, from the factors of the PEFT export (which test_adapters.py checks against PEFT itself).
"""

import json

import torch
from lora_helpers import CHECKPOINTS, set_nonzero_B
from safetensors.torch import load_file, save_file

from modelzoo import build_provider, runtime
from modelzoo.lora import LoRAConfig, adapter_hf_weights, adapter_parameters, apply_lora, export_merged_hf_weights

ADAPTED = ("q_proj", "v_proj", "down_proj")
CONFIG = LoRAConfig(targets=ADAPTED, rank=4, alpha=8.0)


def fp8_grid_checkpoint(folder):
    """loopcoder-tiny with every tensor rounded to FP8 E4M3 and stored as bf16."""
    source = CHECKPOINTS["loopcoder"]
    folder.mkdir()
    tensors = load_file(source / "model.safetensors")
    save_file({name: t.to(torch.float8_e4m3fn).to(torch.bfloat16) for name, t in tensors.items()},
              str(folder / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return folder


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_merged_export_on_an_fp8_grid_base_changes_exactly_the_adapted_projections(tmp_path):
    folder = fp8_grid_checkpoint(tmp_path / "fp8-grid")
    with runtime.parallel(tp=1):
        provider = build_provider(folder, params_dtype=torch.bfloat16)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        base = {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)}
        assert all(same_bytes(t, t.to(torch.float8_e4m3fn).to(torch.bfloat16)) for t in base.values())
        apply_lora(model, provider, CONFIG)
        set_nonzero_B(model, provider)
        adapters = adapter_parameters(model)
        base_parameters = {n: p.detach().clone() for n, p in model.named_parameters() if n not in adapters}
        merged = dict(export_merged_hf_weights(model, provider))
        factors = dict(adapter_hf_weights(model, provider))
        assert all(same_bytes(p, base_parameters[n]) for n, p in model.named_parameters() if n not in adapters)

    assert merged.keys() == base.keys()
    adapted = [name for name in base if name.removesuffix(".weight").rsplit(".", 1)[-1] in ADAPTED]
    assert len(adapted) == 3 * 2  # three projections in each of the two layers
    for name in base:
        if name not in adapted:
            assert same_bytes(merged[name], base[name]), f"{name} is not adapted but changed"
            continue
        module = "base_model.model." + name.removesuffix(".weight")
        a, b = factors[f"{module}.lora_A.weight"].float(), factors[f"{module}.lora_B.weight"].float()
        expected = (base[name].float() + CONFIG.alpha / CONFIG.rank * (b @ a)).to(torch.bfloat16)
        assert not same_bytes(merged[name], base[name]), f"{name} is adapted but unchanged"
        assert same_bytes(merged[name], expected), f"{name} is not W + (alpha/r) B A rounded once"


def test_base_weight_export_of_an_adapted_model_is_the_base_checkpoint(tmp_path):
    # the weight engine moves base weights only: adapters (is_lora_adapter) have their own exports
    folder = fp8_grid_checkpoint(tmp_path / "fp8-grid")
    original = load_file(folder / "model.safetensors")
    with runtime.parallel(tp=1):
        provider = build_provider(folder, params_dtype=torch.bfloat16)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        apply_lora(model, provider, CONFIG)
        set_nonzero_B(model, provider)
        exported = dict(provider.export_hf_weights(model))
    assert exported.keys() == original.keys()
    assert all(same_bytes(exported[name], tensor) for name, tensor in original.items())
