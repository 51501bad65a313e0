"""torch_dist checkpoints written and read a tensor (or a bounded group) at a time, from a meta-device model.

Megatron-Core's `dist_checkpointing.save` takes a sharded state dict of real tensors, and its writer
copies every one of them into write buckets before the first byte is written
(`FileSystemWriterAsync.prepare_write_data`): a conversion through it holds the model twice. Here the
sharded state dict comes from the model built on the meta device (names, global shapes, offsets and
factories exactly as Megatron makes them, no memory), Megatron translates it to DCP objects as its own
torch_dist strategy does, and torch's `FileSystemWriter` writes it through a planner that makes each
tensor's data only when the writer asks for it (`resolve_data`). The files are the ones
`dist_checkpointing.save` writes (same keys, chunks, `.metadata`, `common.pt`, `metadata.json`);
`dist_checkpointing.load` and Megatron-LM read them. Reading back a bounded group at a time needs no
private API: `dist_checkpointing.load` accepts a partial sharded state dict.

This is the one place where `conversion` relies on private behaviour of Megatron-Core 0.19 and torch
(tests: tests/test_streaming_checkpoint.py):

| what                                                        | why                                            |
|-------------------------------------------------------------|------------------------------------------------|
| `_replace_state_dict_keys_with_sharded_keys`,               | the translation `TorchDistSaveShardedStrategy. |
| `mcore_to_pyt_state_dict` (dist_checkpointing.strategies.   | async_save` does, so that the files are        |
| torch), `TorchDistSaveShardedStrategy.save` overridden      | Megatron's; only the writer is replaced        |
| `filesystem._write_item`, `DEFAULT_SUFFIX`, `FileSystemWriter | torch's writer keeps every tensor of a file    |
| .write_data` overridden                                     | until the file is closed; ours drops each one  |
| `Tensor.untyped_storage()._cdata`                           | which parameter a meta tensor is a view of:    |
|                                                             | meta tensors have no data pointer, and the     |
|                                                             | factories (SwiGLU's [gate; up] split) and the  |
|                                                             | DCP translation hand on views, not parameters  |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm


def storage_id(tensor: torch.Tensor) -> int:
    """Identity of the storage under `tensor`, shared by a parameter and every view of it (meta included)."""
    return tensor.untyped_storage()._cdata


def view_like(real: torch.Tensor, meta_view: torch.Tensor) -> torch.Tensor:
    """The view of `real` that `meta_view` is of its meta parameter (`real` has the parameter's shape)."""
    return real.as_strided(meta_view.size(), meta_view.stride(), real.storage_offset() + meta_view.storage_offset())


class ParameterData:
    """Real data for the views of a meta model's parameters, made by `make(name)` one parameter at a time.

    Keeps the last parameter made: the writer asks for the pieces of one parameter (the two halves of
    a SwiGLU fc1) one after the other, so each parameter is made once and memory stays one parameter.
    """

    def __init__(self, params: dict[str, torch.Tensor], make: Callable[[str], torch.Tensor], progress: bool):
        self.params = params
        self.name_of = {storage_id(param): name for name, param in params.items()}
        self.make = make
        self.last: tuple[str, torch.Tensor] | None = None
        self.bar = tqdm(total=len(params), desc="write", unit="tensor", disable=not progress, leave=False)

    def __call__(self, meta_view: torch.Tensor) -> torch.Tensor:
        name = self.name_of.get(storage_id(meta_view))
        if name is None:
            raise RuntimeError("a meta tensor of the sharded state dict is not a view of any parameter "
                               f"(shape {list(meta_view.shape)}): cannot make its data")
        if self.last is None or self.last[0] != name:
            self.last = None  # free the previous parameter before making the next
            param = self.params[name]
            real = self.make(name).to(param.dtype)
            if real.shape != param.shape:
                raise RuntimeError(f"{name}: made a tensor of shape {list(real.shape)}, the model has {list(param.shape)}")
            self.last = (name, real.contiguous())
            self.bar.update()
        return view_like(self.last[1], meta_view)

    def close(self) -> None:
        self.last = None
        self.bar.close()


def streaming_save_strategy(data: Callable[[torch.Tensor], torch.Tensor] | None):
    """A `dist_checkpointing.save` strategy whose writer takes one tensor at a time; `data(meta_view)`
    makes the real data of a meta tensor when it is written (None: every tensor is real)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.futures import Future

    class LazyPlanner(MCoreSavePlanner):
        def create_global_plan(self, all_plans):
            global_plans, metadata = super().create_global_plan(all_plans)
            metadata.all_local_plans = all_plans  # recorded like Megatron's saver: its cached-structure saves read them
            return global_plans, metadata

        def resolve_data(self, write_item):
            resolved = super().resolve_data(write_item)
            if isinstance(resolved, torch.Tensor) and resolved.is_meta:
                if data is None:
                    raise RuntimeError(f"{write_item.index.fqn} is on the meta device and nothing makes its data")
                return data(resolved)
            return resolved

    class StreamingWriter(dcp.FileSystemWriter):
        """torch's FileSystemWriter with one file per rank (`__<rank>_0.distcp`, byte items first, then
        tensors in plan order: the file torch's and Megatron's writers make), each item made, written
        and dropped before the next. torch 2.14's own loop (`_write_files_from_queue`) keeps every
        tensor of a file until the file is closed. No fsync, like the safetensors writer: the staging
        folder's rename, not fsync, is what keeps a failed conversion from leaving a checkpoint behind."""

        def write_data(self, plan, planner):
            file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            items = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)  # stable
            results = []
            with self.fs.create_stream(self.fs.concat_path(self.path, file_name), "wb") as stream:
                for item in items:
                    resolved = planner.resolve_data(item)
                    if item.type != WriteItemType.BYTE_IO:
                        resolved = resolved.detach()
                        if resolved.untyped_storage().nbytes() != resolved.nbytes:
                            resolved = resolved.clone()  # torch.save writes a view's whole storage
                    results.append(_write_item(self.transforms, stream, resolved, item, file_name,
                                               SerializationFormat.TORCH_SAVE))
                    del resolved
            future = Future()
            future.set_result(results)
            return future

    class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            # TorchDistSaveShardedStrategy.async_save's translation and planner (Megatron-Core 0.19.2)
            sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded, False)
            planner = LazyPlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                  flatten_state_dict=False, flatten_sharded_tensors=False)
            dcp.save(pyt_state_dict, storage_writer=StreamingWriter(str(checkpoint_dir)), planner=planner)

    return StreamingSaveStrategy()


def with_real_data(sharded, real_by_storage: dict[int, torch.Tensor]):
    """A sharded-state-dict entry (ShardedTensor or factory) with its meta data swapped for real tensors."""
    return dataclasses.replace(sharded, data=view_like(real_by_storage[storage_id(sharded.data)], sharded.data))


def load_groups(sharded_state_dict: dict, params: dict[str, torch.Tensor], groups: list[list[str]],
                folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: `(name, this rank's tensor)` for every name of `groups`, one `dist_checkpointing.load`
    per group (a partial sharded state dict), so that only one group is in memory at a time."""
    from megatron.core import dist_checkpointing

    for group in groups:
        real = {storage_id(params[name]): torch.empty(params[name].shape, dtype=params[name].dtype) for name in group}
        part = {name: with_real_data(sharded_state_dict[name], real) for name in group}
        del real
        loaded = dist_checkpointing.load({"model": part}, folder)["model"]
        for name in group:
            yield name, loaded.pop(name)
