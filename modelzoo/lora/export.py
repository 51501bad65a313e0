"""What leaves the trainer: merged weights (for an engine without LoRA) and the adapter in Hugging Face PEFT layout.

Both stream full tensors under Hugging Face names, gathered over tensor parallelism on every rank (every TP rank
must iterate), and go through the architecture's weight mapping, so a fused layer's B is split per projection by
the same transform that splits its weight. A fused layer's projections share A: PEFT gets a copy per projection.

    merged W_p = W_p + (alpha / r) B_p A        in fp32 from the frozen base, cast to the base dtype once

Adapter names (`naming`): "transformers" (default) names each adapted module as the architecture's HF model class
does, which is what peft looks up; "release" names it as the checkpoint names its weight. They differ where
transformers renames checkpoint names on load (DeepSeek-V4: `attn.wq_a` is the module `self_attn.q_a_proj`);
a target table says so per target (`Target.transformers`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from megatron.core import parallel_state

from modelzoo.conversion import engine, validation
from modelzoo.conversion.mapping import compile_pattern, fill_pattern
from modelzoo.conversion.staging import staged_folder
from modelzoo.lora.layers import LoRAConfig, LoRALayer, lora_layers
from modelzoo.lora.targets import projections

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
NAMINGS = ("transformers", "release")


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


def module_namer(provider, naming: str = "transformers") -> Callable[[str], str]:
    """checkpoint module name (a weight's name without `.weight`) -> the adapter's name for that module."""
    if naming not in NAMINGS:
        raise ValueError(f"adapter naming {naming!r} is not one of {NAMINGS}")
    mapping = provider.mapping()
    renames = []
    for target in provider.lora_targets().targets if naming == "transformers" else ():
        if target.transformers is not None:
            checkpoint_modules = projections(mapping, target.module)
            if len(checkpoint_modules) != 1:
                raise ValueError(f"{provider.name} LoRA target table: {target.module} has {len(checkpoint_modules)} "
                                 f"projections; `transformers` names the module of a one-projection target")
            renames.append((compile_pattern(checkpoint_modules[0]), target.transformers))

    def name(module: str) -> str:
        for pattern, transformers_module in renames:
            if match := pattern.match(module):
                return fill_pattern(transformers_module, match.groups())
        return module

    return name


def adapter_hf_weights(model: torch.nn.Module, provider, naming: str = "transformers"
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(peft_name, full tensor)`: `base_model.model.<module>.lora_{A,B}.weight` for every adapted
    projection, in PEFT's layout (A [r, in], B [out, r]; scaling alpha/r is applied by the loader); modules
    named as `naming` says (module docstring)."""
    mapping, module_name = provider.mapping(), module_namer(provider, naming)
    for name, layer in lora_layers(model):
        rule, indices = mapping.for_megatron(f"{name}.weight")
        a, b_parts = _factors(layer, rule)
        hf_names = rule.hf_names(indices)
        for index in layer.lora.projections:
            module = PEFT_PREFIX + module_name(_module(hf_names[index]))
            yield f"{module}.lora_A.weight", a.contiguous()
            yield f"{module}.lora_B.weight", b_parts[index].contiguous()


def lora_config(model: torch.nn.Module) -> LoRAConfig:
    configs = {layer.lora.config for _, layer in lora_layers(model)}
    if len(configs) != 1:
        raise ValueError(f"expected one LoRA config on the model, found {len(configs)}")
    return configs.pop()


def hf_model_modules(provider) -> set[str]:
    """Module names of the architecture's HF model class, built from the config on the meta device (no memory)."""
    with torch.device("meta"):
        hf_model = provider.hf_model_class()(provider.hf_config)
    return {name for name, _ in hf_model.named_modules()}


def peft_config(model: torch.nn.Module, provider, naming: str = "transformers") -> dict:
    """adapter_config.json of the model's adapters (HF PEFT `LoraConfig` fields), modules named as `naming` says.

    `target_modules` are leaf names (`q_proj`) where every module with that leaf (of the HF model class, or of
    the checkpoint for "release") is adapted, else the full module names, so PEFT adapts exactly what the file
    holds. `packed_modules_mapping` documents the serving engine's fused modules (vLLM): PEFT ignores it with a
    warning, vLLM reads only the fields it knows.
    """
    config = lora_config(model)
    mapping, module_name = provider.mapping(), module_namer(provider, naming)
    adapted = set()
    for name, layer in lora_layers(model):
        rule, indices = mapping.for_megatron(f"{name}.weight")
        adapted.update(module_name(_module(rule.hf_names(indices)[i])) for i in layer.lora.projections)
    if naming == "transformers":
        hf_modules = hf_model_modules(provider)
        absent = sorted(adapted - hf_modules)
        if absent:
            raise ValueError(f"{provider.name} LoRA target table: {provider.hf_model_class().__name__} has no "
                             f"module {absent[0]} (set the target's `transformers` name)")
    else:
        base_names = engine.megatron_tensors(model)  # adapters are not among them
        hf_modules = {_module(hf) for names in mapping.hf_names_for(base_names).values() for hf in names
                      if hf.endswith(".weight")}
    targets = set()
    for leaf in {_leaf(module) for module in adapted}:
        same_leaf = {module for module in hf_modules if _leaf(module) == leaf}
        targets.update({leaf} if same_leaf <= adapted else same_leaf & adapted)
    packed = {}
    for target in provider.lora_targets().targets:
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


def save_adapter(model: torch.nn.Module, provider, out_dir: str | Path, naming: str = "transformers") -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (PEFT layout) atomically, modules named as `naming`
    says; a tensor with NaN or infinite values is refused unless allowed (`validation.non_finite_allowed`).
    Collective: every rank calls it, rank 0 writes; an existing `out_dir` is refused."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = adapter_hf_weights(model, provider, naming)
    if engine.rank() != 0:
        for _ in tensors:  # take part in the gathers
            pass
        return out_dir
    collected = {name: tensor.clone() for name, tensor in tensors}  # a fused layer's projections share one A
    for name, tensor in collected.items():
        validation.check_written(name, [tensor])
    # strict JSON: a NaN or infinite value is an error here, not `NaN` in the file
    config = json.dumps(peft_config(model, provider, naming), indent=2, sort_keys=True, allow_nan=False) + "\n"
    with staged_folder(out_dir) as staging:
        save_file(collected, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (staging / ADAPTER_CONFIG).write_text(config)
    return out_dir
