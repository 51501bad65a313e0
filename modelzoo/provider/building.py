"""Building a provider's model: its TransformerConfig, the module (`provide`, `provide_skeleton`) and the checks of
a parallel layout."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from modelzoo import runtime

# TransformerConfig fields of a pre-norm SwiGLU decoder built from Megatron-Core's local (unfused) layers:
# no bias, and none of the fused kernels that need Transformer Engine or Apex
SWIGLU_RMSNORM_FIELDS = dict(
    normalization="RMSNorm",
    gated_linear_unit=True,
    activation_func=torch.nn.functional.silu,
    add_bias_linear=False,
    bias_activation_fusion=False,
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
)


# Megatron-LM's default --make-vocab-size-divisible-by: a checkpoint we write loads there unchanged
VOCAB_PADDING_MULTIPLE = 128



def keep_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """Mark a parameter or buffer to stay fp32 whatever the model's dtype (RoPE frequencies). `provide` keeps
    it; a cast of the whole module afterwards (`.bfloat16()`, Megatron-LM's Float16Module) does not know the mark."""
    tensor.keep_fp32 = True
    return tensor



def cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast `model`'s floating parameters and buffers to `dtype` in place, but those marked `keep_fp32`."""
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and not getattr(param, "keep_fp32", False):
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and not getattr(buffer, "keep_fp32", False):
                setattr(module, name, buffer.to(dtype))
    return model



class ModelBuilding:
    """`ModelProvider`'s building half: what it does with the architecture's `transformer_config_fields` and
    `build_model`."""

    def _check_overrides(self) -> None:
        if not self.config_overrides:  # nothing to check: a provider that is only read does not import Megatron-Core
            return
        from megatron.core.transformer import TransformerConfig

        unknown = sorted(set(self.config_overrides) - {field.name for field in dataclasses.fields(TransformerConfig)})
        if unknown:
            raise ValueError(f"{self.name}: unknown option {unknown[0]!r}: not an option of this architecture nor a "
                             f"Megatron TransformerConfig field")

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def padded_vocab_size(self, tp: int | None = None) -> int:
        tp = tp if tp is not None else _parallel_sizes()["tensor_model_parallel_size"]
        multiple = math.lcm(VOCAB_PADDING_MULTIPLE, tp)
        return -(-self.vocab_size // multiple) * multiple

    def transformer_config(self):
        from megatron.core.transformer import TransformerConfig

        fields = self.transformer_config_kwargs(**_parallel_sizes())
        self.check_parallel_layout(fields["tensor_model_parallel_size"], fields["expert_model_parallel_size"],
                                   cp=fields["context_parallel_size"], pp=fields["pipeline_model_parallel_size"])
        return TransformerConfig(**fields)

    def transformer_config_kwargs(self, **parallel_sizes: int) -> dict[str, Any]:
        """The TransformerConfig fields: generic ones, `parallel_sizes`, the architecture's, then the overrides."""
        fields = dict(
            params_dtype=self.params_dtype,
            bf16=self.params_dtype == torch.bfloat16,
            fp16=self.params_dtype == torch.float16,
            use_cpu_initialization=not torch.cuda.is_available(),
            hidden_dropout=0.0,
            attention_dropout=0.0,
            pipeline_dtype=self.params_dtype,  # of the activations sent between pipeline stages
            **parallel_sizes,
        )
        fields.update(self.transformer_config_fields())
        fields.update(self.config_overrides)
        groups, tp = fields.get("num_query_groups"), parallel_sizes.get("tensor_model_parallel_size", 1)
        if self.copies_kv_heads and groups and groups < tp:  # one query group per rank, each with a KV head copy
            fields["num_query_groups"] = tp
        return fields

    def check_parallel_layout(self, tp: int, ep: int = 1, cp: int = 1, pp: int = 1) -> None:
        """Refuse a layout that does not split this model evenly (before any work starts)."""
        fields = self.transformer_config_fields()
        if pp < 1 or fields["num_layers"] % pp:
            raise ValueError(f"pipeline parallel size {pp} must divide the {fields['num_layers']} decoder layers of "
                             f"this {self.name} model")
        heads = fields["num_attention_heads"]
        groups = fields.get("num_query_groups") or heads
        if tp < 1 or heads % tp or (groups % tp and not (self.copies_kv_heads and tp % groups == 0)):
            kv_rule = "divide or be a multiple of" if self.copies_kv_heads else "divide"
            raise ValueError(
                f"tensor parallel size {tp} must divide the attention heads ({heads}) and {kv_rule} the key/value "
                f"heads ({groups}) of this {self.name} model"
            )
        if ep != 1 and not self.has_experts:
            raise ValueError(f"expert parallel size {ep}: this {self.name} model has no experts to split")
        if cp != 1 and not self.supports_context_parallel:
            raise ValueError(f"context parallel size {cp}: context parallelism is not implemented for this {self.name} "
                             f"model")

    @staticmethod
    def pipeline_stage() -> dict[str, bool]:
        """GPTModel's `pre_process` (this stage embeds) and `post_process` (it holds the head) for this rank."""
        from megatron.core import parallel_state

        return dict(pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())

    def pipeline_seq_length(self, seq_length: int) -> int:
        """The `seq_length` to give Megatron's schedules for micro-batches of `seq_length` tokens (whole rows: the
        schedules divide it by the CP size, and by the TP size under sequence parallelism): they pass tensors of
        [seq_length, micro_batch, hidden] between stages (an architecture that sends more overrides it)."""
        return seq_length

    def provide(self, config=None) -> torch.nn.Module:
        """The Megatron module for the current parallel state, on the current device.

        `config`: the TransformerConfig to build with, default `transformer_config()`; a trainer that
        owns the config (Megatron-Bridge's provider) passes its own, made from `transformer_config_kwargs`.
        """
        config = config if config is not None else self.transformer_config()
        model = self.build_model(config)
        # Megatron builds some modules (norms) in fp32 and leaves the cast to Megatron-LM's
        # Float16Module; we cast here so that every floating tensor has the dtype asked for, but those
        # the architecture keeps in fp32 (`keep_fp32`)
        return cast_floating(model, config.params_dtype).to(device=runtime.device())

    def provide_skeleton(self) -> torch.nn.Module:
        """The module of `provide()` on the meta device: names, shapes, dtypes, parallel layout and sharded
        state dict, no memory and no initialisation. What streaming conversion builds instead of the model."""
        config = self.transformer_config()
        # no device argument in Megatron's parameter constructors, so torch.device("meta") places them all
        config.use_cpu_initialization, config.perform_initialization = True, False
        config.init_model_with_meta_device = True  # no all-reduce of a word embedding shared by pipeline stages
        with torch.device("meta"):
            return cast_floating(self.build_model(config), self.params_dtype)


def _parallel_sizes() -> dict[str, int]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is not initialised: wrap this in `modelzoo.runtime.parallel()`")
    return dict(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
    )
