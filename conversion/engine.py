"""Move weights between a Hugging Face checkpoint and a (tensor-parallel) Megatron model.

Architecture-agnostic: everything specific comes from a `MappingTable`. Tensor-parallel layout is
read from Megatron's own parameter attributes (`tensor_model_parallel`, `partition_dim`), so a
parameter is split or gathered the way the layer that owns it splits its math.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from conversion.mapping import MappingError, MappingTable
from conversion.safetensors_io import CheckpointReader


def megatron_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> parameter or persistent buffer, as Megatron's state dict names them (no extra state)."""
    return {
        name: tensor
        for name, tensor in model.state_dict(keep_vars=True).items()
        if not name.endswith("_extra_state")
    }


def _tp() -> tuple[int, int, object]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def _partition_dim(tensor: torch.Tensor, tp_size: int) -> int | None:
    if tp_size > 1 and getattr(tensor, "tensor_model_parallel", False):
        return tensor.partition_dim
    return None


def full_shape(tensor: torch.Tensor, tp_size: int) -> torch.Size:
    shape = list(tensor.shape)
    dim = _partition_dim(tensor, tp_size)
    if dim is not None:
        shape[dim] *= tp_size
    return torch.Size(shape)


def expected_hf_shapes(model: torch.nn.Module, table: MappingTable) -> dict[str, tuple[int, ...]]:
    """The shape every checkpoint tensor must have, from the model (run on meta tensors: no memory)."""
    _, tp_size, _ = _tp()
    shapes = {}
    for name, tensor in megatron_tensors(model).items():
        rule, indices = table.for_megatron(name) or (None, None)
        if rule is None:
            raise MappingError(f"no mapping rule for Megatron tensor {name}")
        meta = torch.empty(full_shape(tensor, tp_size), dtype=tensor.dtype, device="meta")
        for hf_name, hf_tensor in zip(rule.hf_names(indices), rule.transform.to_hf(meta, tp_size)):
            shapes[hf_name] = tuple(hf_tensor.shape)
    return shapes


def check_checkpoint(model: torch.nn.Module, table: MappingTable, reader: CheckpointReader) -> None:
    """Names and shapes of the whole checkpoint against the model, before a single byte is loaded."""
    table.check_coverage(megatron_tensors(model), reader.names(), where=str(reader.folder))
    for name, shape in expected_hf_shapes(model, table).items():
        if reader.shape(name) != shape:
            raise MappingError(
                f"{reader.tensors[name].file}: tensor {name} has shape {list(reader.shape(name))}, "
                f"the model expects {list(shape)}"
            )


def load_hf_weights(model: torch.nn.Module, table: MappingTable, reader: CheckpointReader, progress: bool = True) -> None:
    """Copy a checkpoint into `model`, this rank's shard of each tensor, one tensor at a time."""
    check_checkpoint(model, table, reader)
    tp_rank, tp_size, _ = _tp()
    tensors = megatron_tensors(model)
    show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
    for name, target in tqdm(tensors.items(), desc="load", unit="tensor", disable=not show, leave=False):
        rule, indices = table.for_megatron(name)
        sources = [reader.get(hf_name) for hf_name in rule.hf_names(indices)]
        full = rule.transform.to_megatron(sources, full_shape(target, tp_size), tp_size)
        dim = _partition_dim(target, tp_size)
        shard = full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank]
        with torch.no_grad():
            target.copy_(shard)


def export_hf_weights(model: torch.nn.Module, table: MappingTable) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full tensor)` for every checkpoint tensor, gathered across TP on every rank.

    Streams: at most one Megatron tensor is gathered at a time. Every TP rank must iterate (the
    gathers are collective); all ranks receive the same tensors.
    """
    _, tp_size, tp_group = _tp()
    for name, tensor in megatron_tensors(model).items():
        rule, indices = table.for_megatron(name) or (None, None)
        if rule is None:
            raise MappingError(f"no mapping rule for Megatron tensor {name}")
        full = tensor.detach()
        dim = _partition_dim(tensor, tp_size)
        if dim is not None:
            shards = [torch.empty_like(full) for _ in range(tp_size)]
            dist.all_gather(shards, full.contiguous(), group=tp_group)
            full = torch.cat(shards, dim=dim)
        yield from zip(rule.hf_names(indices), rule.transform.to_hf(full, tp_size))
