"""Megatron-Bridge integration: `AutoBridge` finds modelzoo's LoopCoder, DeepSeek-V4 and DeepSeek-V4.1.

    import modelzoo.integrations.megatron_bridge            # registers the bridges (the only import needed)
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = bridge.to_megatron_provider()                 # a ModelzooModelProvider
    provider.tensor_model_parallel_size = 2                  # a trainer's overrides, then:
    provider.finalize()
    provider.initialize_model_parallel(seed=0)
    model = provider.provide_distributed_model(wrap_with_ddp=False)   # weights loaded by modelzoo's engine
    for name, tensor in bridge.export_hf_weights(model): ...

The model, its TransformerConfig fields and its weights come from modelzoo (`build_provider`, the mapping tables,
the LoRA tables), the same code as without Megatron-Bridge, so both paths give the same model bit for bit.
Megatron-Bridge's own weight machinery (`mapping_registry`, param mappings, conversion tasks) is not used.

Megatron-Bridge's own DeepSeek-V4 bridge builds Megatron-Core modules that Megatron-Core does not release yet
(hyper-connections, compressed sparse attention, hash routing); where the installed Megatron-Core lacks them,
ours is registered in its place and a warning says so. Megatron-Bridge has no DeepSeek-V4.1 bridge: ours is
registered. The core package never imports this module.
"""

from __future__ import annotations

import dataclasses
import logging
from importlib.metadata import version
from pathlib import Path

import torch

from modelzoo.compat import stand_in_module


# `import megatron.bridge` (0.6.2) imports transformers' `modeling_attn_mask_utils` (removed after 5.12; we need
# 5.24) for the vendored HF code of its Bailing model, which nothing on our architectures' path uses
stand_in_module("transformers.modeling_attn_mask_utils",
                ("AttentionMaskConverter", "_prepare_4d_attention_mask", "_prepare_4d_causal_attention_mask",
                 "_prepare_4d_causal_attention_mask_for_sdpa"),
                "transformers.modeling_attn_mask_utils is not in this transformers version; Megatron-Bridge's Bailing "
                "model code needs transformers<=5.12")

from megatron.bridge.models.conversion.model_bridge import HFWeightTuple, MegatronModelBridge  # noqa: E402
from megatron.bridge.models.model_provider import ModelProviderMixin  # noqa: E402
from megatron.bridge.models.transformer_config import TransformerConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402

from modelzoo import build_provider, lora  # noqa: E402
from modelzoo.deepseek_v4.provider import DeepseekV4Provider  # noqa: E402
from modelzoo.deepseek_v4.model.model import DeepseekV4Model  # noqa: E402
from modelzoo.deepseek_v41.model.model import DeepseekV41Model  # noqa: E402
from modelzoo.deepseek_v41.provider import DeepseekV41Provider  # noqa: E402
from modelzoo.loopcoder.model import LoopCoderModel  # noqa: E402
from modelzoo.loopcoder.provider import LoopCoderProvider  # noqa: E402
from modelzoo.provider import ModelProvider  # noqa: E402

logger = logging.getLogger(__name__)

# TransformerConfig fields that Megatron-Bridge's DeepSeekV4Bridge sets and that only a Megatron-Core with its
# DeepSeek-V4 modules (hyper-connections, compressed sparse attention, grouped output projection, hash routing) has
DEEPSEEK_V4_CORE_FIELDS = ("enable_hyper_connections", "num_residual_streams", "csa_compress_ratios", "o_groups",
                           "moe_n_hash_layers")


@dataclasses.dataclass
class ModelzooModelProvider(TransformerConfig, ModelProviderMixin):
    """Megatron-Bridge's provider contract (a TransformerConfig that builds the model) around a modelzoo provider.

    Its TransformerConfig fields start as modelzoo's for the checkpoint; a trainer changes them (parallel sizes,
    dtype, recompute) and calls `finalize()` as with any Megatron-Bridge provider. modelzoo's own options
    (`attention="fast"`, LoopCoder's `train_gate`) are set on `modelzoo_provider`.
    """

    modelzoo_provider: ModelProvider | None = None

    @classmethod
    def wrapping(cls, modelzoo_provider: ModelProvider) -> ModelzooModelProvider:
        return cls(modelzoo_provider=modelzoo_provider, **modelzoo_provider.transformer_config_kwargs())

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> torch.nn.Module:
        sizes = (self.tensor_model_parallel_size, self.expert_model_parallel_size, self.context_parallel_size,
                 self.pipeline_model_parallel_size)
        state = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_expert_model_parallel_world_size(),
                 parallel_state.get_context_parallel_world_size(),
                 parallel_state.get_pipeline_model_parallel_world_size())
        if sizes != state:
            raise ValueError(f"the provider asks for tensor/expert/context/pipeline parallel sizes {sizes} but "
                             f"Megatron's parallel state has {state}: call provider.initialize_model_parallel() after "
                             f"setting them")
        self.modelzoo_provider.check_parallel_layout(*sizes)
        return self.modelzoo_provider.provide(self)


def _modelzoo_provider(hf_pretrained) -> ModelProvider:
    """The checkpoint's provider, built from its folder where it is a local one (an architecture may read more than
    the config there: DeepSeek-V4.1 its tokenizer), else from its config."""
    folder = getattr(hf_pretrained, "model_name_or_path", None)
    if folder is not None and Path(folder).is_dir():
        return build_provider(folder)
    return build_provider(hf_pretrained.config.to_dict())


def _single_model(megatron_model) -> torch.nn.Module:
    models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
    if len(models) != 1:
        raise ValueError(f"modelzoo models have no virtual pipeline stages: expected one model chunk, got {len(models)}")
    return unwrap_model(models[0])


class ModelzooBridge(MegatronModelBridge):
    """A Megatron-Bridge bridge whose provider and weight movement are modelzoo's."""

    def provider_bridge(self, hf_pretrained) -> ModelzooModelProvider:
        return ModelzooModelProvider.wrapping(_modelzoo_provider(hf_pretrained))

    def mapping_registry(self):
        raise NotImplementedError(
            f"{type(self).__name__} moves weights with modelzoo's mapping table, not Megatron-Bridge param "
            "mappings: use AutoBridge.load_hf_weights / export_hf_weights / export_adapter_weights")

    def load_weights_hf_to_megatron(self, hf_pretrained, megatron_model, allowed_mismatched_params=None):
        if allowed_mismatched_params:
            raise ValueError("modelzoo's engine loads every weight of the mapping or fails: "
                             "allowed_mismatched_params is not supported")
        provider = _modelzoo_provider(hf_pretrained)
        provider.load_hf_weights(_single_model(megatron_model), hf_pretrained.model_name_or_path, progress=False)
        return megatron_model

    def stream_weights_megatron_to_hf(self, megatron_model, hf_pretrained, cpu=True, show_progress=True,
                                      conversion_tasks=None, merge_adapter_weights=True, weight_dtype=None):
        """Full tensors under HF names on every rank (collective over TP); LoRA adapters merged unless told not.
        `show_progress` is in Megatron-Bridge's signature and has no effect here."""
        if conversion_tasks is not None:
            raise ValueError("modelzoo bridges build no Megatron-Bridge conversion tasks: pass conversion_tasks=None")
        model = _single_model(megatron_model)
        provider = _modelzoo_provider(hf_pretrained)
        if merge_adapter_weights and any(True for _ in lora.lora_layers(model)):
            tensors = lora.export_merged_hf_weights(model, provider)
        else:
            tensors = provider.export_hf_weights(model)
        for name, tensor in tensors:
            yield HFWeightTuple(name, _placed(tensor, cpu, weight_dtype))

    def stream_adapter_weights_megatron_to_hf(self, megatron_model, cpu=True, show_progress=True,
                                              exclude_adapter_base_prefixes=None):
        """modelzoo LoRA adapters in PEFT layout (`base_model.model.<hf module>.lora_{A,B}.weight`); no progress bar."""
        if exclude_adapter_base_prefixes:
            raise ValueError("modelzoo bridges export every adapter: exclude_adapter_base_prefixes is not supported")
        model = _single_model(megatron_model)
        for name, tensor in lora.adapter_hf_weights(model, build_provider(self.hf_config.to_dict())):
            yield HFWeightTuple(name, _placed(tensor, cpu, None))


def _placed(tensor: torch.Tensor, cpu: bool, dtype: torch.dtype | None) -> torch.Tensor:
    tensor = tensor.cpu() if cpu else tensor
    return tensor.to(dtype) if dtype is not None else tensor


def register(bridge: type[ModelzooBridge], provider: type[ModelProvider], model: type[torch.nn.Module]) -> None:
    """Make AutoBridge dispatch the provider's HF architecture to `bridge` (by name, replacing any earlier one)."""
    MegatronModelBridge.register_bridge(source=provider.hf_architectures[0], target=model,
                                        provider=ModelzooModelProvider, model_type=provider.hf_model_types[0])(bridge)


class LoopCoderBridge(ModelzooBridge):
    """IQuest LoopCoder (Megatron-Bridge has none)."""


class DeepseekV4Bridge(ModelzooBridge):
    """DeepSeek-V4, registered only where Megatron-Bridge's own cannot run (see `register_deepseek_v4`)."""


class DeepseekV41Bridge(ModelzooBridge):
    """DeepSeek-V4.1's text model (Megatron-Bridge has none)."""


def missing_deepseek_v4_core_fields() -> list[str]:
    """The fields of `DEEPSEEK_V4_CORE_FIELDS` that the installed Megatron-Core's TransformerConfig lacks."""
    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    return [name for name in DEEPSEEK_V4_CORE_FIELDS if name not in fields]


def register_deepseek_v4() -> bool:
    """Register our DeepSeek-V4 bridge in place of Megatron-Bridge's when that one cannot run; True if it was."""
    missing = missing_deepseek_v4_core_fields()
    if not missing:
        logger.info("Megatron-Bridge's own DeepSeek-V4 bridge can run on megatron-core %s; it stays registered",
                    version("megatron-core"))
        return False
    register(DeepseekV4Bridge, DeepseekV4Provider, DeepseekV4Model)  # the name Megatron-Bridge's is registered by
    logger.warning("Megatron-Bridge's DeepSeek-V4 bridge cannot run on megatron-core %s (its TransformerConfig has "
                   "no %s): modelzoo's DeepSeek-V4 takes its place", version("megatron-core"), ", ".join(missing))
    return True


register(LoopCoderBridge, LoopCoderProvider, LoopCoderModel)
register(DeepseekV41Bridge, DeepseekV41Provider, DeepseekV41Model)
register_deepseek_v4()
