"""Move weights between a Hugging Face checkpoint and a (tensor-parallel) Megatron model.

Architecture-agnostic: everything specific comes from a `MappingTable`. The parallel layout is read
from the parameters' own attributes (Megatron's `tensor_model_parallel`, `partition_dim`; our
`expert_parallel`), so a parameter is split or gathered the way the layer that owns it splits its math.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from modelzoo.conversion import validation
from modelzoo.conversion.mapping import MappingError, MappingTable, Rule
from modelzoo.conversion.safetensors_io import CheckpointReader
from modelzoo.conversion.transforms import RowBlocks


# the name Megatron's checkpoints give the word embedding on every pipeline stage that holds a copy of it
# (LanguageModule.tie_embeddings_and_output_weights_state_dict)
SHARED_EMBEDDING_NAME = "embedding.word_embeddings.weight"


def rank() -> int:
    """This process's rank (0 without torch.distributed): the one that reports and writes."""
    return dist.get_rank() if dist.is_initialized() else 0


def checkpoint_name_of(model: torch.nn.Module) -> Callable[[str], str]:
    """State-dict name -> the name of that tensor in the whole model, as the mapping table and checkpoints know it.

    A pipeline stage numbers its layers from 0; Megatron's `layer_number` (1-based, counted over all stages) of a
    layer in a ModuleList says which layer of the model it is. A weight Megatron marks `shared_embedding` is the
    word embedding, or on a later stage its copy (a tied output layer, the embedding of the MTP layers), named as
    the embedding. At one stage every name is its own.
    """
    renamed = {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            for index, layer in enumerate(module):
                number = getattr(layer, "layer_number", None)
                if isinstance(number, int) and number - 1 != index:
                    renamed[f"{module_name}.{index}."] = f"{module_name}.{number - 1}."
    shared = {name for name, tensor in model.state_dict(keep_vars=True).items()
              if getattr(tensor, "shared_embedding", False)}

    def checkpoint_name(name: str) -> str:
        if name in shared:
            return SHARED_EMBEDDING_NAME
        for prefix, whole_model_prefix in renamed.items():
            if name.startswith(prefix):
                return whole_model_prefix + name[len(prefix):]
        return name

    return checkpoint_name


def state_dict_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State-dict name -> parameter or persistent buffer, as this rank's module names them.

    Leaves out Megatron's extra state and LoRA adapters (`is_lora_adapter`): this engine moves the
    base weights, `modelzoo.lora` exports adapters.
    """
    return {
        name: tensor
        for name, tensor in model.state_dict(keep_vars=True).items()
        if not name.endswith("_extra_state") and not getattr(tensor, "is_lora_adapter", False)
    }


def megatron_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`state_dict_tensors` by the names of the whole model (`checkpoint_name_of`): on a pipeline stage, its
    layers under their numbers in the model."""
    checkpoint_name = checkpoint_name_of(model)
    return {checkpoint_name(name): tensor for name, tensor in state_dict_tensors(model).items()}


def pipeline_group():
    """Megatron's pipeline-parallel group when there are several stages, else None."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return ps.get_pipeline_model_parallel_group()


def all_stages(value):
    """Collective over the pipeline stages: every stage's `value`, first stage first ([value] at one stage)."""
    group = pipeline_group()
    if group is None:
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


# the parameter attributes ShardLayout reads
LAYOUT_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "expert_parallel")


def with_layout_of(tensor: torch.Tensor | RowBlocks, param: torch.Tensor) -> torch.Tensor | RowBlocks:
    """`tensor` carrying `param`'s parallel-layout attributes (data read apart from its parameter)."""
    for attribute in LAYOUT_ATTRIBUTES:
        if hasattr(param, attribute):
            setattr(tensor, attribute, getattr(param, attribute))
    return tensor


class ShardLayout:
    """How this rank's piece of a Megatron tensor sits in the full tensor.

    Tensor parallel: split along `partition_dim` when Megatron marks it `tensor_model_parallel`.
    Expert parallel: a tensor marked `expert_parallel=True` (stacked per-expert weights) is also split
    along dim 0 over the expert-model-parallel group, and its TP split uses the expert-TP group.
    """

    def __init__(self, tensor: torch.Tensor):
        from megatron.core import parallel_state as ps

        self.tp_size, self.tp_rank, self.tp_group = 1, 0, None
        self.ep_size, self.ep_rank, self.ep_group = 1, 0, None
        if ps.model_parallel_is_initialized():
            if getattr(tensor, "expert_parallel", False):
                self.tp_size, self.tp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
                self.tp_group = ps.get_expert_tensor_parallel_group()
                self.ep_size, self.ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
                self.ep_group = ps.get_expert_model_parallel_group()
            else:
                self.tp_size, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
                self.tp_group = ps.get_tensor_model_parallel_group()
        sharded = self.tp_size > 1 and getattr(tensor, "tensor_model_parallel", False)
        self.tp_dim = tensor.partition_dim if sharded else None

    def full_shape(self, tensor: torch.Tensor) -> torch.Size:
        shape = list(tensor.shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] *= self.tp_size
        shape[0] *= self.ep_size
        return torch.Size(shape)

    def shard(self, full: torch.Tensor | RowBlocks) -> torch.Tensor | RowBlocks:
        if self.ep_size > 1:
            full = full.chunk(self.ep_size, dim=0)[self.ep_rank]
        if self.tp_dim is not None:
            full = full.chunk(self.tp_size, dim=self.tp_dim)[self.tp_rank]
        return full

    def gather(self, local: torch.Tensor | RowBlocks) -> torch.Tensor | RowBlocks:
        """Collective over this tensor's TP (then EP) group: every rank gets the full tensor (row blocks
        stay row blocks when there is nothing to gather)."""
        gathered = [(dim, size, group) for dim, size, group in ((self.tp_dim, self.tp_size, self.tp_group),
                                                                (0, self.ep_size, self.ep_group))
                    if dim is not None and size > 1]
        if isinstance(local, RowBlocks):
            if not gathered:
                return local
            local = local.tensor()
        full = local.detach()
        for dim, size, group in gathered:
            parts = [torch.empty_like(full) for _ in range(size)]
            dist.all_gather(parts, full.contiguous(), group=group)
            full = torch.cat(parts, dim=dim)
        return full


def _rule_for(table: MappingTable, name: str):
    found = table.for_megatron(name)
    if found is None:
        raise MappingError(f"no mapping rule for Megatron tensor {name}")
    return found


def expected_hf_tensors(model: torch.nn.Module, table: MappingTable) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor as the model expects it, on the meta device: its shape, and its dtype's
    kind (floating point or not). From the model's meta tensors: no memory."""
    expected = {}
    for name, tensor in megatron_tensors(model).items():
        rule, indices = _rule_for(table, name)
        layout = ShardLayout(tensor)
        meta = torch.empty(layout.full_shape(tensor), dtype=tensor.dtype, device="meta")
        expected.update(zip(rule.hf_names(indices), rule.transform.to_hf(meta, layout.tp_size)))
    return expected


def check_checkpoint(model: torch.nn.Module, table: MappingTable, reader: CheckpointReader) -> None:
    """Names, shapes and kinds of dtype of the whole checkpoint against the model, before a single byte
    is loaded: a floating-point weight stored as integers would be cast to a wrong one, not refused.
    Collective over the pipeline stages: the checkpoint is covered by all their tensors together."""
    names = dict.fromkeys(name for stage in all_stages(list(megatron_tensors(model))) for name in stage)
    table.check_coverage(names, reader.names(), where=str(reader.folder))
    for name, tensor in expected_hf_tensors(model, table).items():
        info = reader.tensors[name]
        if info.dtype.is_floating_point != tensor.dtype.is_floating_point:
            raise MappingError(f"{info.file}: tensor {name} is stored as {info.dtype}, the model expects "
                               f"{'a floating-point' if tensor.dtype.is_floating_point else 'an integer'} tensor")
        if info.shape != tuple(tensor.shape):
            raise MappingError(f"{info.file}: tensor {name} has shape {list(info.shape)}, the model expects "
                               f"{list(tensor.shape)}")


def hf_shard(name: str, target: torch.Tensor, table: MappingTable, reader: CheckpointReader) -> RowBlocks:
    """This rank's shard of Megatron tensor `name`, made from the checkpoint as row blocks of the source
    tensors (nothing concatenated yet), in the dtype of `target` (the parameter, real or on the meta device,
    which gives its shape and parallel layout too): no copy where the source has that dtype. NaN or infinite
    values, as stored or once cast to that dtype, are refused (`validation.check_finite`) unless allowed, and
    so are integer values outside the range the rule gives them: the shard is checked, which reads only this
    rank's part."""
    rule, indices = table.for_megatron(name)
    layout = ShardLayout(target)
    hf_names = rule.hf_names(indices)
    sources = [reader.get(hf_name) for hf_name in hf_names]
    rows = layout.shard(rule.transform.to_megatron_rows(sources, layout.full_shape(target), layout.tp_size))
    rows = rows.to(target.dtype)
    if validation.refuses_non_finite() and any(validation.first_non_finite(block) is not None for block in rows.blocks):
        for hf_name, source in zip(hf_names, sources):  # which source it came from, for the message
            validation.check_finite(hf_name, source, str(reader.tensors[hf_name].file), target.dtype)
    if rule.values is not None:
        for hf_name, source in zip(hf_names, sources):
            validation.check_index_range(hf_name, source, 0, rule.values.end, rule.values.meaning,
                                         str(reader.tensors[hf_name].file))
    return rows


def load_hf_weights(model: torch.nn.Module, table: MappingTable, reader: CheckpointReader, progress: bool = True) -> None:
    """Copy a checkpoint into `model`, this rank's shard of each tensor, one tensor at a time."""
    check_checkpoint(model, table, reader)
    tensors = megatron_tensors(model)
    show = progress and rank() == 0
    for name, target in tqdm(tensors.items(), desc="load", unit="tensor", disable=not show, leave=False):
        with torch.no_grad():
            target.copy_(hf_shard(name, target, table, reader).tensor())


def hf_weights(model: torch.nn.Module, table: MappingTable, reader: CheckpointReader) -> Callable[[str], RowBlocks]:
    """`weights(name)`: this rank's shard of each tensor of `model` (built on the meta device; `name` as its state
    dict names it) as row blocks, made from the checkpoint when asked for (`megatron_ckpt.save(..., weights=...)`); names and
    shapes checked first."""
    check_checkpoint(model, table, reader)
    tensors, checkpoint_name = state_dict_tensors(model), checkpoint_name_of(model)
    return lambda name: hf_shard(checkpoint_name(name), tensors[name], table, reader)


def export_hf_weights(model: torch.nn.Module | Iterable[tuple[str, torch.Tensor | RowBlocks]], table: MappingTable,
                      edit: Callable[[str, Rule, list[torch.Tensor]], list[torch.Tensor]] | None = None,
                      row_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | RowBlocks]]:
    """Yield `(hf_name, full tensor)` for every checkpoint tensor, gathered across TP / EP on every rank.

    `model`: a Megatron model, or its `(name, local tensor or RowBlocks)` pairs read from a checkpoint
    (`megatron_ckpt.stream_weights`, at one pipeline stage). Streams: at most one Megatron tensor is gathered at a
    time. Every rank must iterate (the gathers are collective); all ranks receive the same tensors, those of
    every pipeline stage (each sent from the first stage that holds it).
    `edit(megatron_name, rule, hf_tensors)` may replace a tensor's HF tensors before they are yielded
    (LoRA's merged export). `row_blocks` (without `edit`): the HF tensors come as `RowBlocks` of the
    Megatron tensor's rows, not concatenated, for a writer that takes each block where it is
    (`ShardedWriter.add`: from the checkpoint's file).
    """
    if not isinstance(model, torch.nn.Module):
        tensors = ((name, tensor, ShardLayout(tensor)) for name, tensor in model)
    elif pipeline_group() is None:
        tensors = ((name, tensor, ShardLayout(tensor)) for name, tensor in megatron_tensors(model).items())
    else:
        tensors = _from_every_stage(megatron_tensors(model))
    for name, tensor, layout in tensors:
        rule, indices = _rule_for(table, name)
        full = layout.gather(tensor)
        hf_tensors = rule.transform.to_hf_rows(full if isinstance(full, RowBlocks) else RowBlocks([full]), layout.tp_size)
        if not row_blocks or edit is not None:
            hf_tensors = [rows.tensor() for rows in hf_tensors]
        if edit is not None:
            hf_tensors = edit(name, rule, hf_tensors)
        if rule.values is not None:
            for hf_name, hf_tensor in zip(rule.hf_names(indices), hf_tensors):
                for block in hf_tensor.blocks if isinstance(hf_tensor, RowBlocks) else [hf_tensor]:
                    validation.check_index_range(hf_name, block, 0, rule.values.end, rule.values.meaning,
                                                 f"Megatron tensor {name}")
        yield from zip(rule.hf_names(indices), hf_tensors)


class _Received:
    """ShardLayout of a tensor another pipeline stage gathered and sends whole: nothing to gather here."""

    def __init__(self, tp_size: int):
        self.tp_size = tp_size

    def gather(self, full: torch.Tensor) -> torch.Tensor:
        return full


def _from_every_stage(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor, ShardLayout | _Received]]:
    """Collective over the pipeline stages: `(name, tensor, layout)` of every stage's tensors in stage order, each
    once. The first stage holding a tensor gathers it (TP / EP) and broadcasts it whole to the other stages."""
    group = pipeline_group()
    here = dist.get_rank(group)
    layouts = {name: ShardLayout(tensor) for name, tensor in tensors.items()}
    described = [(name, tuple(layouts[name].full_shape(tensor)), str(tensor.dtype).removeprefix("torch."),
                  layouts[name].tp_size) for name, tensor in tensors.items()]
    sent = set()
    for stage, stage_tensors in enumerate(all_stages(described)):
        for name, shape, dtype, tp_size in stage_tensors:
            if name in sent:
                continue
            sent.add(name)
            if stage == here:
                full = layouts[name].gather(tensors[name])
                full = (full.tensor() if isinstance(full, RowBlocks) else full).contiguous()
            else:
                full = torch.empty(shape, dtype=getattr(torch, dtype), device=next(iter(tensors.values())).device)
            dist.broadcast(full, src=dist.get_global_rank(group, stage), group=group)
            yield name, full, _Received(tp_size)
