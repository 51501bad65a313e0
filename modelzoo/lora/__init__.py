"""LoRA for every architecture: TP-aware adapters on the Megatron model, merged and PEFT exports, checkpoints.

    provider = modelzoo.build_provider(hf_dir)
    with modelzoo.runtime.parallel(tp=2):
        model = provider.provide(); provider.load_hf_weights(model)
        lora.apply_lora(model, provider, lora.LoRAConfig(targets=("all-linear",), rank=16, alpha=32))
        ...train: only adapter parameters require grad...
        for hf_name, tensor in lora.export_merged_hf_weights(model, provider): ...   # engine without LoRA
        for peft_name, tensor in lora.adapter_hf_weights(model, provider): ...       # engine with LoRA
        lora.save_adapter(model, provider, "adapter/")                               # PEFT folder

Target tables: `modelzoo/<architecture>/lora.py` (`LORA_TARGETS`); names and their resolution: `targets.py`.
See docs/lora.md.
"""

from modelzoo.lora.checkpoint import (
    export_adapter,
    load_adapter_checkpoint,
    read_checkpoint_metadata,
    resume_training,
    save_training_checkpoint,
)
from modelzoo.lora.export import adapter_hf_weights, export_merged_hf_weights, peft_config, save_adapter
from modelzoo.lora.layers import LoRAConfig, adapter_parameters, apply_lora, lora_layers, resolve_targets
from modelzoo.lora.targets import ALL_LINEAR, Refusal, Target, TargetTable

__all__ = [
    "ALL_LINEAR", "LoRAConfig", "Refusal", "Target", "TargetTable", "adapter_hf_weights", "adapter_parameters",
    "apply_lora", "export_adapter", "export_merged_hf_weights", "load_adapter_checkpoint", "lora_layers",
    "peft_config", "read_checkpoint_metadata", "resolve_targets", "resume_training", "save_adapter",
    "save_training_checkpoint",
]
