"""What leaves the trainer: merged weights (for an engine without LoRA) and the adapter in Hugging Face PEFT layout.

Both stream full tensors under Hugging Face names, gathered over tensor parallelism on every rank (every TP rank
must iterate), and go through the architecture's weight mapping, so a fused layer's B is split per projection by
the same transform that splits its weight. A fused layer's projections share A: PEFT gets a copy per projection.

    merged W_p = W_p + (alpha / r) B_p A        in fp32 from the frozen base, cast to the base dtype once
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from megatron.core import parallel_state

from conversion import engine, megatron_ckpt
from conversion.safetensors_io import staged_folder
from modelzoo.lora.layers import LoRAConfig, LoRALayer, lora_layers
from modelzoo.lora.targets import projections, target_table

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _factors(layer: LoRALayer, rule) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Full A and B per projection (HF order) of one adapted layer."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    a = engine.ShardLayout(layer.lora.A).gather(layer.lora.A)
    b = engine.ShardLayout(layer.lora.B).gather(layer.lora.effective_B())
    return a, rule.transform.to_hf(b, tp)


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def export_merged_hf_weights(model: torch.nn.Module, provider) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(hf_name, full tensor)` of the merged model: what `provider.export_hf_weights` yields for the base,
    with every adapted projection replaced by W + (alpha/r) B A. Collective over TP; the model is not modified."""
    layers = {f"{name}.weight": layer for name, layer in lora_layers(model)}

    def merge(name: str, rule, hf_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        layer = layers.get(name)
        if layer is not None:
            a, b_parts = _factors(layer, rule)
            for index in layer.lora.projections:
                hf_tensors[index] = merged_weight(hf_tensors[index], a, b_parts[index], layer.lora.scale)
        return hf_tensors

    return engine.export_hf_weights(model, provider.mapping(), edit=merge)


def adapter_hf_weights(model: torch.nn.Module, provider) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(peft_name, full tensor)`: `base_model.model.<hf module>.lora_{A,B}.weight` for every adapted
    projection, in PEFT's layout (A [r, in], B [out, r]; scaling alpha/r is applied by the loader)."""
    mapping = provider.mapping()
    for name, layer in lora_layers(model):
        rule, indices = mapping.for_megatron(f"{name}.weight")
        a, b_parts = _factors(layer, rule)
        hf_names = rule.hf_names(indices)
        for index in layer.lora.projections:
            module = PEFT_PREFIX + _module(hf_names[index])
            yield f"{module}.lora_A.weight", a.contiguous()
            yield f"{module}.lora_B.weight", b_parts[index].contiguous()


def lora_config(model: torch.nn.Module) -> LoRAConfig:
    configs = {layer.lora.config for _, layer in lora_layers(model)}
    if len(configs) != 1:
        raise ValueError(f"expected one LoRA config on the model, found {len(configs)}")
    return configs.pop()


def peft_config(model: torch.nn.Module, provider) -> dict:
    """adapter_config.json of the model's adapters (HF PEFT `LoraConfig` fields).

    `target_modules` are leaf names (`q_proj`) where every HF module with that leaf is adapted, else the full
    module names, so PEFT adapts exactly what the file holds. `packed_modules_mapping` documents the serving
    engine's fused modules (vLLM): PEFT ignores it with a warning, vLLM reads only the fields it knows.
    """
    config = lora_config(model)
    mapping = provider.mapping()
    base_names = engine.megatron_tensors(model)  # adapters are not among them
    hf_modules = {_module(hf) for names in mapping.hf_names_for(base_names).values() for hf in names
                  if hf.endswith(".weight")}
    adapted = set()
    for name, layer in lora_layers(model):
        rule, indices = mapping.for_megatron(f"{name}.weight")
        adapted.update(_module(rule.hf_names(indices)[i]) for i in layer.lora.projections)
    targets = set()
    for leaf in {_leaf(module) for module in adapted}:
        same_leaf = {module for module in hf_modules if _leaf(module) == leaf}
        targets.update({leaf} if same_leaf <= adapted else same_leaf & adapted)
    packed = {}
    for target in target_table(provider.name).targets:
        leaves = [_leaf(module) for module in projections(mapping, target.module)]
        if target.packed_as and {_leaf(module) for module in adapted} & set(leaves):
            packed[target.packed_as] = leaves
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(provider.hf_dir) if provider.hf_dir is not None else None,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "packed_modules_mapping": packed,
    }


def _module(hf_tensor: str) -> str:
    return hf_tensor.removesuffix(".weight")


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def save_adapter(model: torch.nn.Module, provider, out_dir: str | Path) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (PEFT layout) atomically. Collective: every rank
    calls it, rank 0 writes; an existing `out_dir` is refused."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = adapter_hf_weights(model, provider)
    if megatron_ckpt.rank() != 0:
        for _ in tensors:  # take part in the gathers
            pass
        return out_dir
    collected = {name: tensor.clone() for name, tensor in tensors}  # a fused layer's projections share one A
    with staged_folder(out_dir) as staging:
        save_file(collected, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (staging / ADAPTER_CONFIG).write_text(json.dumps(peft_config(model, provider), indent=2, sort_keys=True) + "\n")
    return out_dir
