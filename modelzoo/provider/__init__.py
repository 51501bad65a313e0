"""`ModelProvider`: what a trainer gets from `build_provider` for one checkpoint.

    provider = modelzoo.build_provider("path/to/hf_checkpoint", attention="fast")
    with modelzoo.runtime.parallel(tp=2):
        model = provider.provide()                 # Megatron-Core module, this rank's shard
        provider.load_hf_weights(model)            # streamed from the checkpoint
        logprobs = provider.token_logprobs(model, input_ids)
        for name, tensor in provider.export_hf_weights(model): ...

An architecture subclasses it and fills in three things: the TransformerConfig fields, the module and the
mapping table. Every module takes Megatron-Core GPTModel's call (`modelzoo.layers.gpt_call`). Everything else
(parallel sizes, vocabulary padding, weight movement, log-probabilities) is generic and lives here.

    building.py    the TransformerConfig, the module (`provide`, `provide_skeleton`), the parallel layout checks
    weights.py     weights in and out: checkpoint readers, streamed loads, exports, checkpoint writes
    inference.py   forwards, log-probabilities and full logits on every parallel layout
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import PretrainedConfig

from modelzoo.conversion.mapping import MappingTable
from modelzoo.conversion.validation import Bounds
from modelzoo.layers.attention import IMPLEMENTATIONS
from modelzoo.provider.building import (SWIGLU_RMSNORM_FIELDS, VOCAB_PADDING_MULTIPLE, ModelBuilding, cast_floating,
                                        keep_fp32)
from modelzoo.provider.inference import InferenceHelpers
from modelzoo.provider.weights import TOKENIZER_FILES, WeightsIO

if TYPE_CHECKING:
    from modelzoo.conversion.sync import Naming
    from modelzoo.lora.targets import TargetTable

__all__ = ["SWIGLU_RMSNORM_FIELDS", "TOKENIZER_FILES", "VOCAB_PADDING_MULTIPLE", "ModelProvider", "cast_floating",
           "keep_fp32"]


class ModelProvider(ModelBuilding, WeightsIO, InferenceHelpers):
    """Builds the Megatron model of one HF config and moves its weights both ways."""

    name: ClassVar[str]                     # the registry name, e.g. "llama"
    hf_model_types: ClassVar[tuple[str, ...]]
    hf_architectures: ClassVar[tuple[str, ...]]
    has_experts: ClassVar[bool] = False     # whether expert parallelism means anything for it
    # whether its attention can hold copies of a KV head on several TP ranks (modelzoo/layers/replicated_kv.py), so that
    # TP may be a multiple of the KV heads (num_query_groups) instead of a divisor
    copies_kv_heads: ClassVar[bool] = False
    # whether its attention runs context-parallel (queries of this rank over every rank's keys: modelzoo.layers.attention)
    supports_context_parallel: ClassVar[bool] = False
    # the weight names inference engines load (vLLM, SGLang): `modelzoo.sync.WeightSync`'s default naming
    engine_naming: ClassVar[str] = "hf"
    # the ranges of its config fields beyond the generic checks (`modelzoo.conversion.validation.check_config`): windows,
    # ratios, iteration counts
    config_bounds: ClassVar[dict[str, Bounds]] = {}
    # count -> the fields whose product each unit of it holds weights of at least (every layer holds a norm of
    # hidden_size), so that a config claiming more than its checkpoint holds is refused before a model is built
    weights_per_unit: ClassVar[dict[str, tuple[str, ...]]] = {"num_hidden_layers": ("hidden_size",)}
    # the options `model_options()` records in a Megatron checkpoint, with their types
    recorded_options: ClassVar[dict[str, type]] = {}
    # checkpoint formats besides "hf" (`checkpoint_reader` and `save_checkpoint` take them): name -> description
    checkpoint_formats: ClassVar[dict[str, str]] = {}
    # the options it adds to the `modelzoo` command: flag -> argparse keywords, plus "commands" (those that take
    # it) and "passed_to" ("provider": a `build_provider` keyword, "save": a `save_checkpoint` keyword; passed only
    # when it is not its default). Literals only: the command reads them (and the three above) from the source of
    # a built-in provider without importing it (`modelzoo.registry`)
    cli_options: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, hf_config: PretrainedConfig, hf_dir: str | Path | None = None,
                 attention: str = "exact", params_dtype: torch.dtype = torch.float32, **config_overrides: Any):
        if attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention={attention!r} is not one of {IMPLEMENTATIONS}")
        self.hf_config = hf_config
        self.hf_dir = Path(hf_dir) if hf_dir is not None else None
        self.attention = attention
        self.params_dtype = params_dtype
        self.config_overrides = config_overrides
        self._check_overrides()
        self.check_supported()

    # --- what an architecture provides -------------------------------------------------------
    @classmethod
    def hf_config_class(cls) -> type[PretrainedConfig]:
        raise NotImplementedError

    def check_supported(self) -> None:
        """Raise ValueError naming any config field this implementation does not support (and `config_source`)."""

    @property
    def config_source(self) -> str:
        """Where the config comes from, for messages: its file, or the architecture's name for a config dict."""
        return str(self.hf_dir / "config.json") if self.hf_dir is not None else f"{self.name} config"

    def model_options(self) -> dict[str, Any]:
        """Keyword arguments of `build_provider` that rebuild this model from its config alone (a Megatron
        checkpoint records them: its HF side holds the config, not the weights the provider looked at)."""
        return {}

    @classmethod
    def check_recorded_options(cls, options: dict[str, Any], where: str) -> None:
        """Refuse recorded options (`model_options`, read back from `where`) this architecture does not record,
        or of another type: they are keyword arguments of `build_provider`, which also takes any
        TransformerConfig field (`num_layers`), and a checkpoint may not choose those."""
        for name, value in options.items():
            kind = cls.recorded_options.get(name)
            if kind is None:
                raise ValueError(f"{where}: model option {name!r} is not one a {cls.name} checkpoint records "
                                 f"({sorted(cls.recorded_options) or 'none'})")
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"{where}: model option {name!r} is {value!r}; it must be {kind.__name__}")

    def transformer_config_fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def build_model(self, config) -> torch.nn.Module:
        raise NotImplementedError

    def mapping(self) -> MappingTable:
        raise NotImplementedError

    def hf_model_class(self):
        """The transformers class that is the parity oracle for this architecture."""
        raise NotImplementedError

    @contextlib.contextmanager
    def oracle_checkpoint(self) -> Iterator[Path]:
        """The folder the parity oracle loads (`hf_model_class().from_pretrained`): the checkpoint itself, unless
        the architecture knows that loader misreads it; then a copy it reads right, removed afterwards."""
        yield self.hf_dir

    def oracle_forward_kwargs(self) -> dict[str, Any]:
        """Keywords of the parity oracle's forward that make it compute what this provider's model computes (an
        option of the model that the oracle takes at its call, not from the checkpoint)."""
        return {}

    @classmethod
    def lora_targets(cls) -> TargetTable:
        """The modules LoRA adapts and refuses (`LORA_TARGETS`, data in the architecture's lora.py)."""
        raise ValueError(f"LoRA has no target table for {cls.name} yet (declare one: `lora_targets`, "
                         f"docs/architecture.md)")

    @classmethod
    def sync_namings(cls) -> dict[str, Naming]:
        """Engine naming ("hf", and any the architecture adds) -> the tensors an engine fuses on load (`NAMINGS`,
        data in the architecture's sync.py)."""
        raise ValueError(f"{cls.name}: no update groups declared: a weight sync could split tensors an engine "
                         f"fuses; declare them (`sync_namings`, docs/weight_sync.md)")
