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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import PretrainedConfig

from modelzoo.conversion import engine
from modelzoo.conversion.mapping import MappingTable
from modelzoo.conversion.safetensors_io import CheckpointReader, ShardedWriter
from modelzoo.conversion.validation import Bounds
from modelzoo import runtime
from modelzoo.layers import context_parallel
from modelzoo.layers.attention import IMPLEMENTATIONS
from modelzoo.logprobs import next_token_logprobs, vocab_parallel_logprobs

if TYPE_CHECKING:
    from modelzoo.conversion.sync import Naming
    from modelzoo.lora.targets import TargetTable

# files carried from an HF checkpoint folder to an exported one besides config.json and the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "chat_template.jinja")

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


class ModelProvider:
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

    # --- generic ------------------------------------------------------------------------------
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

    def checkpoint_reader(self, folder: Path, naming: str | None = None):
        """How this architecture reads a checkpoint folder; one with formats of its own overrides it."""
        if naming not in (None, "hf"):
            raise ValueError(f"{self.name} checkpoints have only the 'hf' naming, not {naming!r}")
        return CheckpointReader(folder)

    def keep_source_files(self, reader, folder: Path) -> None:
        """At import: write into `folder` (the Megatron checkpoint's HF side) what an export needs of the source
        beyond its weights and config; `reader` is `checkpoint_reader`'s (a quantised release keeps its scales)."""

    def load_hf_weights(self, model: torch.nn.Module, hf_dir: str | Path | None = None, progress: bool = True,
                        naming: str | None = None) -> None:
        """Stream a checkpoint into `model`; `naming` picks the layout (None: the architecture detects it)."""
        folder = Path(hf_dir) if hf_dir is not None else self.hf_dir
        if folder is None:
            raise ValueError("load_hf_weights needs hf_dir: this provider was built from a config, not a folder")
        reader = self.checkpoint_reader(folder, naming)
        try:
            engine.load_hf_weights(model, self.mapping(), reader, progress=progress)
        finally:
            reader.close()

    def export_hf_weights(self, model) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream `(hf_name, full tensor)`; every TP rank must iterate (gathers are collective).

        `model` (here and in `save_hf`, `save_checkpoint`): the Megatron model, or its tensors streamed
        from a Megatron checkpoint (`modelzoo.conversion.megatron_ckpt.stream_weights`)."""
        return engine.export_hf_weights(model, self.mapping())

    def save_hf(self, model: torch.nn.Module, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30,
                source_dir: str | Path | None = None) -> int:
        """Write an HF checkpoint folder atomically; returns bytes of weights written.

        Collective: every rank calls it, rank 0 writes. Tokenizer files are copied from
        `source_dir` (default: the folder this provider was built from) when present.
        """
        source = Path(source_dir) if source_dir is not None else self.hf_dir
        # a fused tensor's HF tensors as runs of its rows: the writer copies each from the checkpoint's file
        tensors = engine.export_hf_weights(model, self.mapping(), row_blocks=True)
        if engine.rank() != 0:
            for _ in tensors:  # take part in the gathers
                pass
            return 0
        with ShardedWriter(out_dir, max_shard_bytes) as writer:
            for name, tensor in tqdm(tensors, desc="export", unit="tensor", leave=False):
                writer.add(name, tensor)
            if source is None or not (source / "config.json").exists():
                writer.write_json("config.json", self.hf_config.to_dict())
            for file_name in ("config.json", *TOKENIZER_FILES):
                if source is not None and (source / file_name).exists():
                    writer.copy_file(source / file_name, source)
        return writer.total_bytes

    def save_checkpoint(self, model: torch.nn.Module, out_dir: str | Path, format: str = "hf",
                        quantize: str | None = None, **options) -> int:
        """`save_hf`, or a format of the architecture's own (`checkpoint_formats`), e.g. quantised."""
        if format != "hf" or quantize is not None:
            raise ValueError(f"{self.name} checkpoints are written only in the 'hf' format without quantisation")
        return self.save_hf(model, out_dir, **options)

    def token_logprobs(self, model: torch.nn.Module, input_ids: torch.Tensor, *, position_ids=None,
                       attention_mask=None, packed_seq_params=None, loss_mask: torch.Tensor | None = None):
        """log p(t[i+1] | t[:i+1]) from one forward, fp32, on every TP and CP rank.

        - rows `input_ids` [b, s] (padded ones with `attention_mask` / `position_ids`, GPTModel's arguments):
          a tensor [b, s - 1]; entries whose target is padding mean nothing;
        - a packed row [1, T] with `packed_seq_params` (THD): a list of each sequence's [length - 1] tensor,
          equal to running that sequence alone;
        - with `loss_mask` (same shape as input_ids, nonzero on the tokens to score, e.g. the response tokens):
          a list, per row or per packed sequence, of the scored tokens' log-probabilities, in order.
        Under context parallelism every rank passes the whole batch: each runs its share (`modelzoo.layers.context_parallel`)
        and the log-probabilities are gathered back.
        """
        from modelzoo.layers.sequences import BatchLayoutError, packed_spans

        if context_parallel.current() is None:
            logits = self.forward(model, input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                  packed_seq_params=packed_seq_params)
            logprobs = next_token_logprobs(logits, input_ids, self.vocab_size)     # [b, s - 1]
        else:
            logprobs = self._context_parallel_logprobs(model, input_ids, position_ids, attention_mask,
                                                       packed_seq_params)
        if packed_seq_params is None:
            spans = [(row, 0, input_ids.shape[1]) for row in range(input_ids.shape[0])]
            if loss_mask is None:
                return logprobs
        else:
            lengths, offsets = packed_spans(packed_seq_params, input_ids.shape[1])
            spans = [(0, offset, length) for offset, length in zip(offsets, lengths)]
        if loss_mask is None:
            return [logprobs[row, start:start + length - 1] for row, start, length in spans]
        if loss_mask.shape != input_ids.shape:
            raise BatchLayoutError(f"loss_mask must have input_ids' shape {list(input_ids.shape)}, "
                                   f"got {list(loss_mask.shape)}")
        scored = loss_mask.to(device=logprobs.device) != 0
        first = [number for number, (row, start, _) in enumerate(spans) if scored[row, start]]
        if first:
            raise BatchLayoutError(f"loss_mask marks the first token of sequence {first[0]}, which has no "
                                   f"log-probability (nothing precedes it)")
        return [logprobs[row, start:start + length - 1][scored[row, start + 1:start + length]]
                for row, start, length in spans]

    def _context_parallel_logprobs(self, model, input_ids, position_ids, attention_mask, packed_seq_params):
        """`next_token_logprobs` of the whole batch from this CP rank's share of it: each token's target is read
        from the whole row before it is split, and the per-token result is gathered back."""
        seq = input_ids.shape[1]
        packed_rows = None if packed_seq_params is not None else context_parallel.rows_as_packed(input_ids,
                                                                                                  position_ids)
        if packed_rows is not None:  # rows the ranks cannot split evenly: each row a sequence in a padded slot
            batch, positions = packed_rows
            logprobs = self._context_parallel_logprobs(model, batch.input_ids, positions, attention_mask,
                                                       batch.packed_seq_params)
            return torch.stack([logprobs[0, start:start + seq - 1] for start in batch.offsets])
        targets = input_ids.roll(-1, dims=1)
        local_ids, local_targets, local_positions = (context_parallel.split_for_rank(tensor, packed_seq_params)
                                                     for tensor in (input_ids, targets, position_ids))
        logits = self.forward(model, local_ids, position_ids=local_positions, attention_mask=attention_mask,
                              packed_seq_params=packed_seq_params)
        local = vocab_parallel_logprobs(logits, local_targets, self.vocab_size)
        return context_parallel.gather_from_ranks(local, packed_seq_params)[:, : seq - 1]

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor, **call) -> torch.Tensor:
        """`model(input_ids, **call)` (GPTModel's call) on every rank; `input_ids` are this CP rank's share under
        context parallelism. With several pipeline stages, one micro-batch through Megatron's forward-only schedule;
        the last stage's output is sent to every stage."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        group = engine.pipeline_group()
        if group is None:
            return model(input_ids, **call)
        kept = []

        def forward_step(data_iterator, module):
            def keep(output):
                kept.append(output)
                return output.new_zeros(()), {}
            return module(input_ids, **call), keep

        # the schedule's seq_length is the whole row's: it divides it by the CP size (and TP size under SP) itself
        whole_row = input_ids.shape[1] * parallel_state.get_context_parallel_world_size()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=self.pipeline_seq_length(whole_row), micro_batch_size=input_ids.shape[0], forward_only=True)
        last = dist.get_global_rank(group, dist.get_world_size(group) - 1)
        described = [(tuple(kept[0].shape), kept[0].dtype) if parallel_state.is_pipeline_last_stage() else None]
        dist.broadcast_object_list(described, src=last, group=group)
        shape, dtype = described[0]
        output = kept[0].contiguous() if kept else torch.empty(shape, dtype=dtype, device=runtime.device())
        dist.broadcast(output, src=last, group=group)
        return output

    @torch.no_grad()
    def gathered_logits(self, model: torch.nn.Module, input_ids: torch.Tensor, **call) -> torch.Tensor:
        """Full-vocabulary logits [batch, seq, vocab] on every rank (for parity checks; not for training); under
        context parallelism from the whole rows, each rank running its share."""
        from megatron.core import parallel_state

        seq, packed_seq_params = input_ids.shape[1], call.get("packed_seq_params")
        packed_rows = None if packed_seq_params is not None else context_parallel.rows_as_packed(
            input_ids, call.get("position_ids"))
        if packed_rows is not None:  # rows the ranks cannot split evenly: each row a sequence in a padded slot
            batch, positions = packed_rows
            call = {**call, "packed_seq_params": batch.packed_seq_params}
            if positions is not None:
                call["position_ids"] = positions
            logits = self.gathered_logits(model, batch.input_ids, **call)
            return torch.stack([logits[0, start:start + seq] for start in batch.offsets])
        local = self.forward(model, context_parallel.split_for_rank(input_ids, packed_seq_params),
                             **call).contiguous()
        shards = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
        dist.all_gather(shards, local, group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1)[..., : self.vocab_size]
        return context_parallel.gather_from_ranks(logits, packed_seq_params)[:, :seq]


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
