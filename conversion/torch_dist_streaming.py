"""torch_dist checkpoints written and read a tensor (or a bounded group) at a time, from a meta-device model.

Megatron-Core's `dist_checkpointing.save` takes a sharded state dict of real tensors, and its writer
copies every one of them into write buckets before the first byte is written
(`FileSystemWriterAsync.prepare_write_data`): a conversion through it holds the model twice. Here the
sharded state dict comes from the model built on the meta device (names, global shapes, offsets and
factories exactly as Megatron makes them, no memory), Megatron translates it to DCP objects as its own
torch_dist strategy does, and torch's `FileSystemWriter` writes it through a planner that makes each
tensor's data only when the writer asks for it (`resolve_data`), straight from where it lies (a memory
map of the source file) when it can, and the writer copies such a tensor's bytes from that file in the
kernel (`CopyingStream`). The files are the ones `dist_checkpointing.save` writes (same
keys, chunks, `.metadata`, `common.pt`, `metadata.json`, byte for byte) but for the CRC-32 fields of
each item's `torch.save` zip, left 0, and so its `serialization_id` (`without_crc32`);
`dist_checkpointing.load` and Megatron-LM read them. Reading back a bounded group at a time:
`dist_checkpointing.load` accepts a partial sharded state dict; its strategy here is Megatron's with
a reader that copies each tensor once, from a memory map of the file, where torch's copies it three
times, and no factory merge of pieces handed over unread (`merged_unless_deferred`).

This is the one place where `conversion` relies on private behaviour of Megatron-Core 0.19 and torch
(tests: tests/conversion/test_streaming_checkpoint.py):

| what                                                        | why                                            |
|-------------------------------------------------------------|------------------------------------------------|
| `_replace_state_dict_keys_with_sharded_keys`,               | the translation `TorchDistSaveShardedStrategy. |
| `mcore_to_pyt_state_dict` (dist_checkpointing.strategies.   | async_save` does, so that the files are        |
| torch), `TorchDistSaveShardedStrategy.save` overridden      | Megatron's; only the writer is replaced        |
| `filesystem._write_item`, `DEFAULT_SUFFIX`, `FileSystemWriter | torch's writer keeps every tensor of a file    |
| .write_data` overridden                                     | until the file is closed; ours drops each one  |
| `torch.save`'s zip writer calls `write` on the stream with  | `CopyingStream` recognises a tensor's bytes by |
| a memoryview of the storage itself, all at once, and with   | their address, to copy them from their file,   |
| CRC-32 off reads none of it                                 | or to write the blocks a stand-in's are        |
| `Tensor.untyped_storage()._cdata`                           | which parameter a meta tensor is a view of:    |
|                                                             | meta tensors have no data pointer, and the     |
|                                                             | factories (SwiGLU's [gate; up] split) and the  |
|                                                             | DCP translation hand on views, not parameters  |
| the same two functions and `_replace_sharded_keys_with_     | the translation `TorchDistLoadShardedStrategy. |
| state_dict_keys`, `_restore_dict_types`, `_unwrap_pyt_      | load` does, so that loading is Megatron's;     |
| sharded_tensor`, `MCoreLoadPlanner` (same module),          | only the reader is replaced                    |
| `TorchDistLoadShardedStrategy.load` overridden              |                                                |
| `FileSystemReader.read_data` overridden, its `storage_data` | torch's reader copies each tensor three times  |
| and `_slice_file`; `_shard._utils.narrow_tensor_by_index`   | (read, `torch.load`, into the target); ours    |
|                                                             | once, from a memory map                        |
| `UntypedStorage._checkpoint_offset`, set by `torch.load(..., | where a DCP item's tensor data starts in its   |
| map_location="meta")`                                       | `torch.save` zip (torch's own experimental DCP |
|                                                             | checkpoint reader reads it the same way)       |
| `ShardedTensorFactory.merge_fn` replaced; `dist_checkpoint- | a merge of pieces the reader handed over       |
| ing.load` calls it with the factory's loaded pieces, which  | unread would copy memory nothing uses (the     |
| are the targets the strategy was given                      | whole SwiGLU fc1, concatenated)                |
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import traceback
from collections.abc import Callable, Iterator

import numpy
import torch
from tqdm import tqdm

from modelzoo.conversion import safe_pickle
from modelzoo.conversion.errors import CheckpointError
from modelzoo.conversion.safetensors_io import RegionCopier, file_bytes
from modelzoo.conversion.transforms import RowBlocks


@contextlib.contextmanager
def original_errors() -> Iterator[None]:
    """Meanwhile, an error that torch's distributed checkpoint wrapped in a `CheckpointException` (a
    BaseException whose message is every failed rank's traceback) is raised as it was: the first failed
    rank's own exception (a full disk's OSError, a checkpoint's CheckpointError)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        if not error.failures:
            raise
        raise next(iter(error.failures.values()))[0] from None


def storage_id(tensor: torch.Tensor) -> int:
    """Identity of the storage under `tensor`, shared by a parameter and every view of it (meta included)."""
    return tensor.untyped_storage()._cdata


def view_like(real: torch.Tensor, meta_view: torch.Tensor) -> torch.Tensor:
    """The view of `real` that `meta_view` is of its meta parameter (`real` has the parameter's shape)."""
    return real.as_strided(meta_view.size(), meta_view.stride(), real.storage_offset() + meta_view.storage_offset())


def row_span(meta_view: torch.Tensor, meta_param: torch.Tensor) -> tuple[int, int] | None:
    """(first row, number of rows) when `meta_view` is whole consecutive rows of `meta_param`, else None."""
    row = math.prod(meta_param.shape[1:])
    if (meta_param.dim() == 0 or not meta_param.is_contiguous() or not meta_view.is_contiguous() or row == 0
            or meta_view.shape[1:] != meta_param.shape[1:]):
        return None
    offset = meta_view.storage_offset() - meta_param.storage_offset()
    return (offset // row, meta_view.shape[0]) if offset % row == 0 else None


class ParameterData:
    """Real data for the views of a meta model's parameters, made by `make(name)` one parameter at a time.

    Keeps the last parameter made: the writer asks for the pieces of one parameter (the two halves of
    a SwiGLU fc1) one after the other, so each parameter is made once and memory stays one parameter.
    `make` gives the parameter as row blocks (`RowBlocks`); a piece that is whole rows is taken from the
    blocks holding them, with no copy when that is one block (each half of a TP-1 fc1 is the HF gate or
    up tensor, itself a map of the source file), so only pieces across blocks (a fused QKV) are copied.
    """

    def __init__(self, params: dict[str, torch.Tensor], make: Callable[[str], RowBlocks], progress: bool):
        self.params = params
        self.name_of = {storage_id(param): name for name, param in params.items()}
        self.make = make
        self.last: tuple[str, torch.Tensor] | None = None
        self.stand_in: tuple[int, list[torch.Tensor]] | None = None  # (its address, the blocks it stands for)
        self.bar = tqdm(total=len(params), desc="write", unit="tensor", disable=not progress, leave=False)

    def __call__(self, meta_view: torch.Tensor) -> torch.Tensor:
        name = self.name_of.get(storage_id(meta_view))
        if name is None:
            raise RuntimeError("a meta tensor of the sharded state dict is not a view of any parameter "
                               f"(shape {list(meta_view.shape)}): cannot make its data")
        param = self.params[name]
        if self.last is None or self.last[0] != name:
            self.last = None  # free the previous parameter before making the next
            rows = self.make(name).to(param.dtype)
            if rows.shape != param.shape:
                raise RuntimeError(f"{name}: made a tensor of shape {list(rows.shape)}, the model has {list(param.shape)}")
            self.last = (name, rows)
            self.bar.update()
        rows = self.last[1]
        span = row_span(meta_view, param)
        if span is None:  # concatenated once, kept for the parameter's other pieces
            whole = rows.tensor().contiguous()
            self.last = (name, RowBlocks([whole]))
            return view_like(whole, meta_view)
        picked = rows.narrow(0, *span)
        if len(picked.blocks) == 1:
            return picked.tensor()
        # rows across blocks (a fused QKV): the writer appends the blocks themselves (`blocks_of`), so
        # the concatenation is never made; this stand-in's memory is never written, read or touched
        stand_in = torch.empty(picked.shape, dtype=picked.dtype)
        self.stand_in = (stand_in.data_ptr(), picked.blocks)
        return stand_in

    def blocks_of(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """The row blocks whose bytes `tensor` stands in for, when it is the last stand-in made."""
        if self.stand_in is None or self.stand_in[0] != tensor.data_ptr():
            return None
        blocks, self.stand_in = self.stand_in[1], None
        return blocks

    def close(self) -> None:
        self.last = self.stand_in = None
        self.bar.close()


def with_own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on a storage of exactly its bytes, as torch.save must get it (it writes a tensor's whole
    storage, and a view's is larger); copies only a tensor that is not contiguous."""
    if not tensor.is_contiguous():
        return tensor.contiguous()
    if tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    # numpy's array over the view's bytes (it keeps the view alive) becomes the new tensor's storage
    return torch.from_numpy(tensor.reshape(-1).view(torch.uint8).numpy()).view(tensor.dtype).view(tensor.shape)


@contextlib.contextmanager
def without_crc32() -> Iterator[None]:
    """`torch.save` computing no CRC-32 of its zip records (their CRC fields are 0) meanwhile: a third of
    the time it takes to save a tensor. Nothing checks it: `torch.load` (and so torch's and Megatron's
    DCP readers and ours) reads a record without it; only zip tools would call the record corrupt."""
    computes = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(computes)


class CopyingStream:
    """A `.distcp` file as `torch.save` writes to it, where the bytes of the tensor being saved (`saving`)
    are appended by `RegionCopier.write`: copied from the file they still are a region of (`file_region`:
    most tensors of an import at TP 1, maps of the source safetensors files) in the kernel, rather than
    written from their map, which would fault every page of it in; a tensor that stands in for row
    blocks (`ParameterData`: a fused QKV) as those blocks, each copied or written. torch's zip writer
    calls `write` with a memoryview of the storage itself, all of its bytes at once, and with CRC-32 off
    (`without_crc32`) reads none of them; `_write_item` also calls `tell` and `flush`. The file's bytes
    are the same either way."""

    def __init__(self, file: io.BufferedWriter, copier: RegionCopier):
        self.file = file
        self.copier = copier
        self.source = None  # (first byte's address, bytes, blocks, what) of the tensor being saved, until appended
        # the error of a failed write: torch's zip writer reports it as a RuntimeError ("unexpected pos
        # ..."), so the writer raises this one instead
        self.error: OSError | None = None

    @contextlib.contextmanager
    def saving(self, name: str, tensor: torch.Tensor, stands_for: list[torch.Tensor] | None = None) -> Iterator[None]:
        """Meanwhile, `tensor`'s bytes, when torch.save writes them, are appended as `stands_for` (its
        row blocks, `tensor`'s own memory being unwritten) or else as `tensor` itself."""
        self.source = (tensor.data_ptr(), tensor.nbytes, stands_for or [tensor], f"tensor {name}")
        try:
            yield
            if stands_for is not None and self.source is not None:
                raise RuntimeError(f"tensor {name}: torch.save did not write its storage in one piece, so the "
                                   "row blocks it stands for were not written in its place")
        finally:
            self.source = None

    def write(self, data) -> int:
        try:
            if self.source is not None:
                address, size, blocks, what = self.source
                with memoryview(data) as view:
                    ours = view.nbytes == size and numpy.frombuffer(view, numpy.uint8).ctypes.data == address
                if ours:
                    self.copier.write(self.file, blocks, what)
                    self.source = None
                    return size
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        self.file.flush()


def streaming_save_strategy(data: ParameterData | None):
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
            # the copier waits for its copies before the file is closed, on an error too
            with self.fs.create_stream(self.fs.concat_path(self.path, file_name), "wb") as file, RegionCopier() as copier:
                stream = CopyingStream(file, copier)
                try:
                    for item in items:
                        results.append(self._write(stream, planner.resolve_data(item), item, file_name))
                except BaseException as error:
                    # torch's DCP keeps the error, and so the frames it came through, in a reference cycle;
                    # those frames hold what torch was writing (a memoryview of a BytesIO), and CPython
                    # 3.12's garbage collector may clear that after the BytesIO, and crash: let go of it now
                    traceback.clear_frames(error.__traceback__)
                    if not isinstance(error, RuntimeError) or stream.error is None:
                        raise
                    traceback.clear_frames(stream.error.__traceback__)
                    raise stream.error from None  # what made torch's zip writer fail
            future = Future()
            future.set_result(results)
            return future

        def _write(self, stream: CopyingStream, resolved, item, file_name: str):
            if item.type == WriteItemType.BYTE_IO:
                return _write_item(self.transforms, stream, resolved, item, file_name, SerializationFormat.TORCH_SAVE)
            tensor = resolved.detach()
            # the tensor, not its own-storage copy, says where its bytes lie in a map (`file_region`)
            stands_for = data.blocks_of(tensor) if data is not None else None
            with stream.saving(item.index.fqn, tensor, stands_for):
                return _write_item(self.transforms, stream, with_own_storage(tensor), item, file_name,
                                   SerializationFormat.TORCH_SAVE)

    class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            # TorchDistSaveShardedStrategy.async_save's translation and planner (Megatron-Core 0.19.2);
            # the translation torch.saves the non-tensor objects
            with without_crc32():
                sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                           self.keep_only_main_replica)
                pyt_state_dict = mcore_to_pyt_state_dict(sharded, False)
                planner = LazyPlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                      flatten_state_dict=False, flatten_sharded_tensors=False)
                dcp.save(pyt_state_dict, storage_writer=StreamingWriter(str(checkpoint_dir)), planner=planner)

    return StreamingSaveStrategy()


def streaming_load_strategy(metadata):
    """A `dist_checkpointing.load` strategy that copies each tensor at most once, from a memory map of
    its bytes in the file into its target (torch's `FileSystemReader` reads each item into a buffer,
    `torch.load`s that into new memory and copies the result into the target: three copies). A target
    whose storage the caller put in the strategy's `deferred` (storage ids) gets no copy: the strategy's
    `pieces` collects `(target, data on the map)` for the caller to take (`load_groups`). `metadata`: the
    checkpoint's, as `safe_pickle.check_folder` read it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        TorchDistLoadShardedStrategy,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class MappedReader(checkpoint.FileSystemReader):
        """torch's FileSystemReader with `read_data` copying each tensor once, and the metadata that
        `safe_pickle.check_folder` read (torch's own `read_metadata` is a plain `pickle.load`). Where the
        tensor's bytes are in its item (a `torch.save` zip) and how it lies on them come from `torch.load`
        of the item onto the meta device (weights only), which reads the item's pickle and records the
        data's offset; the items of torch's stream transforms (none in Megatron's files) go through torch's
        own reader."""

        def __init__(self, path, deferred: set[int], pieces: list[tuple[torch.Tensor, torch.Tensor]], metadata):
            super().__init__(path)
            self.deferred, self.pieces, self.metadata = deferred, pieces, metadata
            # each item holds its chunk, as the metadata describes it
            self.chunk_sizes = {MetadataIndex(key, chunk.offsets): chunk.sizes
                                for key, entry in metadata.state_dict_metadata.items()
                                for chunk in getattr(entry, "chunks", ())}

        def read_metadata(self, *args, **kwargs):
            # what torch's read_metadata adds to the unpickled metadata; each load asks for it, and the
            # loads of every group share it, as Megatron's own CachedMetadataFileSystemReader does
            if self.metadata.storage_meta is None:
                self.metadata.storage_meta = StorageMeta()
            self.metadata.storage_meta.load_id = self.load_id
            return self.metadata

        def read_data(self, plan, planner):
            if any(self.storage_data[item.storage_index].transform_descriptors for item in plan.items):
                return super().read_data(plan, planner)
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for relative_path, items in per_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                    for item in items:
                        info = self.storage_data[item.storage_index]
                        if item.type == LoadItemType.BYTE_IO:
                            stream.seek(info.offset)
                            planner.load_bytes(item, io.BytesIO(stream.read(info.length)))
                            continue
                        saved = self._mapped_tensor(stream, info)
                        chunk = self.chunk_sizes.get(item.storage_index)
                        if chunk is not None and tuple(saved.size()) != tuple(chunk):
                            raise CheckpointError(
                                f"{self.path}/{relative_path}: the item of {item.storage_index.fqn} holds "
                                f"{saved.dtype} {list(saved.size())}, its chunk in the metadata is {list(chunk)}")
                        target = planner.resolve_tensor(item).detach()
                        if (saved.dim() != len(item.storage_offsets) or target.dtype != saved.dtype or any(
                                o + n > size for o, n, size in zip(item.storage_offsets, item.lengths, saved.size()))):
                            raise CheckpointError(
                                f"{self.path}/{relative_path}: the item of {item.storage_index.fqn} holds "
                                f"{saved.dtype} {list(saved.size())}, which does not hold the model's piece "
                                f"({target.dtype} {list(item.lengths)} from {list(item.storage_offsets)})")
                        data = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
                        if target.size() != data.size():
                            raise CheckpointError(f"{self.path}/{relative_path}: the item of {item.storage_index.fqn} "
                                                  f"gives a piece of shape {list(data.size())}, the model's is "
                                                  f"{list(target.size())}")
                        if storage_id(target) in self.deferred:
                            self.pieces.append((target, data))
                        else:
                            target.copy_(data)
                        planner.commit_tensor(item, target)
            future = Future()
            future.set_result(None)
            return future

        def _mapped_tensor(self, stream, info) -> torch.Tensor:
            """The tensor an item holds, on a memory map of its bytes."""
            where = f"{self.path}/{info.relative_path}: the item at byte {info.offset}"
            try:
                layout = torch.load(self._slice_file(stream, info), map_location="meta", weights_only=True)
            except Exception as error:  # noqa: BLE001 - whatever a garbled zip or pickle raises
                raise CheckpointError(f"{where} is not a torch.save tensor ({type(error).__name__}: "
                                      f"{str(error).splitlines()[0] if str(error) else ''})") from None
            if not isinstance(layout, torch.Tensor):
                raise CheckpointError(f"{where} holds a {type(layout).__name__}, not a tensor")
            storage = layout.untyped_storage()
            start, size = storage._checkpoint_offset, storage.nbytes()
            if start + size > info.length:
                raise CheckpointError(f"{where} holds {info.length} bytes, its tensor's data would end at byte "
                                      f"{start + size}")
            # the layout as stored: the meta tensor reports a negative stride as a contiguous one
            offset, sizes, strides = safe_pickle.stored_layout(self._slice_file(stream, info), where)
            if tuple(sizes) != tuple(layout.size()) or any(stride < 0 for stride in strides) or offset < 0:
                raise CheckpointError(f"{where}: its tensor of sizes {list(sizes)} has strides {list(strides)} from "
                                      f"element {offset}: not a layout on its storage")
            data = file_bytes(stream, info.offset + start, size)
            try:
                return data.view(layout.dtype).as_strided(sizes, strides, offset)
            except RuntimeError:
                raise CheckpointError(f"{where}: its tensor lies outside its own storage") from None

    class StreamingLoadStrategy(TorchDistLoadShardedStrategy):
        def __init__(self):
            super().__init__()
            self.deferred: set[int] = set()
            self.pieces: list[tuple[torch.Tensor, torch.Tensor]] = []

        def load(self, sharded_state_dict, checkpoint_dir, async_strategy="mcore"):
            # TorchDistLoadShardedStrategy.load (Megatron-Core 0.19.2, default settings), its reader replaced
            sharded_tensors = [value for value in nested_values(sharded_state_dict) if isinstance(value, ShardedTensor)]
            flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
            pyt_state_dict = mcore_to_pyt_state_dict(flat, True)
            planner = MCoreLoadPlanner(
                shapes_validation_sharded_tensors=[t for t in sharded_tensors if not t.allow_shape_mismatch],
                allow_shape_mismatch_sharded_tensors={t.key: t for t in sharded_tensors if t.allow_shape_mismatch},
                stream_ckpt_dequant=self.stream_ckpt_dequant, flatten_state_dict=False, flatten_sharded_tensors=False)
            reader = MappedReader(checkpoint_dir, self.deferred, self.pieces, metadata)
            checkpoint.load(pyt_state_dict, reader, planner=planner, no_dist=True)
            loaded = {key: _unwrap_pyt_sharded_tensor(value) for key, value in pyt_state_dict.items()}
            loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
            _restore_dict_types(loaded, sharded_state_dict)
            return loaded

    return StreamingLoadStrategy()


def with_real_data(sharded, real: torch.Tensor):
    """A sharded-state-dict entry (ShardedTensor or factory) with its meta data swapped for the same view
    of `real` (its parameter's real tensor)."""
    return dataclasses.replace(sharded, data=view_like(real, sharded.data))


def assembled(name: str, real: torch.Tensor, pieces: list[tuple[torch.Tensor, torch.Tensor]],
              loaded: torch.Tensor) -> torch.Tensor | RowBlocks:
    """Tensor `name` from the data read for its targets (views of `real`, not yet written): that data
    itself when one piece is the whole tensor, the pieces as `RowBlocks` when they are whole rows of it
    (a SwiGLU fc1's [gate; up] halves): no copy. Else the pieces copied together into new memory (not
    into `real`: writing pages the kernel mapped for a read faults on each one). With no pieces (a
    factory whose pieces are not views of its tensor: the reader copied into them), what the load made
    of them (`loaded`, the factory's merge)."""
    if not pieces:
        return loaded
    if sum(target.numel() for target, _ in pieces) != real.numel():
        raise RuntimeError(f"{name}: the checkpoint gave {sum(target.numel() for target, _ in pieces)} of its "
                           f"{real.numel()} elements")
    if len(pieces) == 1:
        target, data = pieces[0]
        if target.is_contiguous() and target.storage_offset() == real.storage_offset():
            return data.reshape(real.shape).to(real.dtype)
    rows = row_blocks(real, pieces)
    if rows is not None:
        return rows
    whole = torch.empty_like(real)
    for target, data in pieces:
        view_like(whole, target).copy_(data)
    return whole


def row_blocks(real: torch.Tensor, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> RowBlocks | None:
    """The pieces' data as the row blocks of `real`, or None unless their targets are whole consecutive
    rows of it from the first (the caller has checked that they hold all its elements)."""
    spans = [row_span(target, real) for target, _ in pieces]
    if None in spans:
        return None
    blocks, end = [], 0
    for (first, rows), (_, data) in sorted(zip(spans, pieces), key=lambda pair: pair[0]):
        if first != end:
            return None
        blocks.append(data.to(real.dtype))
        end += rows
    return RowBlocks(blocks)


def merged_unless_deferred(factory, deferred: set[int]):
    """`factory` (a `ShardedTensorFactory` with real data) whose merge is skipped when the load read
    nothing into the pieces it would merge, every one a target the caller takes the data of (its
    storage in `deferred`): Megatron's merge (a SwiGLU fc1's `torch.cat` of its halves) would copy
    unread memory into a tensor that `assembled` does not use. Then the merge gives the factory's own,
    unread tensor. `dist_checkpointing.load` calls `merge_fn` with the sub-state dict the strategy
    loaded for the factory's pieces, which are the targets themselves."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    merge, unread = factory.merge_fn, factory.data

    def merge_read(loaded):
        values = list(nested_values(loaded)) if isinstance(loaded, (dict, list)) else [loaded]
        if values and all(isinstance(value, torch.Tensor) and storage_id(value) in deferred for value in values):
            return unread
        return merge(loaded)

    return dataclasses.replace(factory, merge_fn=merge_read)


def load_groups(sharded_state_dict: dict, params: dict[str, torch.Tensor], groups: list[list[str]],
                folder: str, metadata) -> Iterator[tuple[str, torch.Tensor | RowBlocks]]:
    """Collective: `(name, this rank's tensor)` for every name of `groups`, one `dist_checkpointing.load`
    per group (a partial sharded state dict), so that only one group is in memory at a time. The load
    copies nothing into the group's tensors (`deferred`) and merges no factory's pieces: a tensor
    stored in one piece comes back on a memory map of the file, and its new tensor, never written,
    costs no memory; one stored in pieces of whole rows (a SwiGLU fc1's halves) as `RowBlocks` of those
    maps; one stored in other pieces (columns of a tensor written at another TP size) is copied
    together into its own. `metadata`: the folder's, as `safe_pickle.check_folder` read it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    strategy = streaming_load_strategy(metadata)
    for group in groups:
        real = {name: torch.empty(params[name].shape, dtype=params[name].dtype) for name in group}
        name_of = {storage_id(tensor): name for name, tensor in real.items()}
        strategy.deferred = set(name_of)
        part = {name: with_real_data(sharded_state_dict[name], real[name]) for name in group}
        part = {name: merged_unless_deferred(sharded, strategy.deferred) if isinstance(sharded, ShardedTensorFactory)
                else sharded for name, sharded in part.items()}
        with original_errors():
            loaded = dist_checkpointing.load({"model": part}, folder, sharded_strategy=strategy)["model"]
        pieces: dict[str, list] = {name: [] for name in group}
        for target, data in strategy.pieces:
            pieces[name_of[storage_id(target)]].append((target, data))
        strategy.pieces.clear()
        for name in group:
            yield name, assembled(name, real.pop(name), pieces.pop(name), loaded.pop(name))
