"""What a torch_dist checkpoint may make when it is read: the objects of its metadata and plain data, never code.

A torch_dist folder holds pickles, and unpickling runs whatever code its bytes name. torch's
`FileSystemReader.read_metadata` reads `.metadata` with a plain `pickle.load`; torch's
`DefaultLoadPlanner.load_bytes` reads each byte item of the `.distcp` files with
`torch.load(weights_only=False)`, and Megatron-Core's `dist_checkpointing.load` and
`load_common_state_dict` go through both (the `common_state` item; a LoRA checkpoint's RNG and
optimizer state are byte items too; a legacy `common.pt` is read by `torch.load`'s default). A Megatron
checkpoint downloaded from a hub or handed over by a colleague is untrusted input, so every path of
modelzoo that reads one (`megatron_ckpt.load`, `megatron_ckpt.stream_weights`, the LoRA checkpoint
loads and `export-adapter`) first calls `check_folder`, which reads every pickle of the folder itself:

- `.metadata` with `RestrictedUnpickler`, which resolves only `METADATA_CLASSES` (torch's
  distributed-checkpoint metadata dataclasses and enums, torch dtypes, `torch.Size`, `pathlib.PosixPath`:
  what torch and Megatron write there);
- every byte item, and `common.pt`, with torch's weights-only unpickler (`torch.load(weights_only=True)`:
  tensors, containers, numbers, strings, None), with no class added to it;
- and the layout: each item in a file of this folder (a plain name), inside that file.

A pickle that names any other class or function is refused before anything else unpickles it
(`UnsafeCheckpointError`, naming the class and the file), so nothing in a checkpoint is ever run. Once
a folder has passed, torch and Megatron read the same bytes with their own unpicklers: a pickle
resolves the same globals whichever unpickler reads it, and these readers have seen every one. (The
folder must not be rewritten meanwhile: the check reads it once, then the load reads it again.)
modelzoo's own tensor reader (torch_dist_streaming.py) takes the metadata `check_folder` returns.
The list names what torch pickles there, private classes included (`modelzoo.compat.TORCH_DCP_PICKLED_GLOBALS`):
a torch that pickles others has its checkpoints refused, naming the class, until it is added.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import pickle
import reprlib
from pathlib import Path, PurePosixPath

import torch

from modelzoo.compat import TORCH_DCP_PICKLED_GLOBALS, storage_info_class
from modelzoo.conversion.errors import CheckpointError
from modelzoo.conversion.files import confined, read_bytes
from modelzoo.conversion.safetensors_io import is_int

METADATA_FILE = ".metadata"
CONFIG_FILE = "metadata.json"  # Megatron's: {"sharded_backend": "torch_dist", ...}
LEGACY_COMMON_FILE = "common.pt"
# the most Megatron's metadata.json, a `.metadata` and a byte item or legacy common.pt may hold (written: a few
# hundred bytes; a few MiB for a large model's chunks; a few KiB of common state or RNG states)
MAX_CONFIG_BYTES = 2**20
MAX_METADATA_BYTES = 2**30
MAX_OBJECT_BYTES = 256 * 2**20
# what a byte item's object may hold, each reference counted (a list holding one list ten times, nested 30
# deep, is small in its pickle and 10**30 items to whoever walks it: Megatron's merge does)
MAX_OBJECT_ITEMS = 10**6
MAX_OBJECT_DEPTH = 100
# a tensor's chunks cut its shape into at most this many pieces per chunk: the pieces of a grid (what
# torch_dist writes: each dimension split evenly) are its chunks themselves
MAX_PIECES_PER_CHUNK = 16

# torch's pickled globals (modelzoo.compat), and the checkpoint's path when it was written
METADATA_CLASSES = TORCH_DCP_PICKLED_GLOBALS | {("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")}


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint's pickle names a class or function outside the allow-list."""


def _refusal(where: str, name: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{where} needs {name}, which a checkpoint may not contain (only torch_dist metadata "
                                 f"and plain data are read from one): refused, nothing in it was run")


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only `METADATA_CLASSES`; any other global is refused."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_CLASSES:
            raise _refusal(self.where, f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: str | os.PathLike):
    """A torch_dist `.metadata` file, unpickled with `RestrictedUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as file:
            metadata = RestrictedUnpickler(file, str(path)).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist: the folder is not a complete torch_dist checkpoint") from None
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever a malformed pickle of allowed classes raises
        raise CheckpointError(f"{path} is not torch_dist metadata ({type(error).__name__}: {error})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not torch_dist metadata (it holds a {type(metadata).__name__})")
    return metadata


def load_object(data: bytes, where: str):
    """An object saved by `torch.save`, read by torch's weights-only unpickler (no class added)."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
        except Exception:  # noqa: BLE001 - not even a readable torch.save archive: reported as below
            unsafe = []
        if unsafe:
            raise _refusal(where, unsafe[0]) from None
        raise CheckpointError(f"{where} is not a torch.save object ({str(error).splitlines()[0]})") from None
    except Exception as error:  # noqa: BLE001 - a truncated or garbled archive
        raise CheckpointError(f"{where} is not a torch.save object ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''})") from None


def _tensor_layout(storage, storage_offset, size, stride, *rest):
    """`torch._utils._rebuild_tensor_v2`'s arguments, kept: where the tensor lies on its storage."""
    return storage_offset, size, stride


class _LayoutUnpickler(pickle.Unpickler):
    """Reads the pickle of a `torch.save`d tensor for its layout alone: the arguments that rebuild it (offset,
    sizes, strides, as stored), the storage not loaded. Resolves only what that pickle names."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _tensor_layout
        if (module, name) == ("collections", "OrderedDict") or (module == "torch" and name.endswith("Storage")):
            return super().find_class(module, name)  # named, not called
        raise _refusal(self.where, f"{module}.{name}")

    def persistent_load(self, pid):
        return None  # the storage: not read


def stored_layout(item, where: str) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(storage offset, sizes, strides) of the tensor a `torch.save` zip holds (`item`: a file object of it), as
    its pickle says: torch.load onto the meta device reports no negative stride, it makes the tensor contiguous."""
    try:
        record = torch._C.PyTorchFileReader(item).get_record("data.pkl")
        layout = _LayoutUnpickler(io.BytesIO(record), where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever a garbled zip or pickle raises
        raise CheckpointError(f"{where} is not a torch.save tensor ({type(error).__name__})") from None
    if (not isinstance(layout, tuple) or len(layout) != 3 or not is_int(layout[0])
            or not all(isinstance(part, tuple) and all(is_int(n) for n in part) for part in layout[1:])):
        raise CheckpointError(f"{where} is not a torch.save tensor")
    return layout


def _is_shape(value) -> bool:
    return isinstance(value, tuple) and all(is_int(size) and size >= 0 for size in value)


def _check_tensor_entry(path: Path, key: str, entry) -> None:
    """A tensor's entry: a dtype, a global shape and chunks that tile it without overlap (`_overlap_free`)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    where = f"{path}: tensor {key}"
    if (not isinstance(entry.properties, TensorProperties) or not isinstance(entry.properties.dtype, torch.dtype)
            or not _is_shape(entry.size) or not isinstance(entry.chunks, list)):
        raise CheckpointError(f"{where} has a malformed entry")
    boxes = []
    for chunk in entry.chunks:
        if (not isinstance(chunk, ChunkStorageMetadata) or not _is_shape(chunk.offsets) or not _is_shape(chunk.sizes)
                or len(chunk.offsets) != len(entry.size) or len(chunk.sizes) != len(entry.size)
                or any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size))):
            raise CheckpointError(f"{where}: a chunk lies outside its shape {list(entry.size)}")
        boxes.append((chunk.offsets, chunk.sizes))
    if sum(math.prod(sizes) for _, sizes in boxes) != math.prod(entry.size):
        raise CheckpointError(f"{where}: its chunks hold {sum(math.prod(s) for _, s in boxes)} elements, "
                              f"its shape {list(entry.size)} has {math.prod(entry.size)}")
    overlap_free = _overlap_free(boxes)
    if overlap_free is None:
        raise CheckpointError(f"{where}: its {len(boxes)} chunks do not cut its shape {list(entry.size)} into a grid "
                              f"(as torch_dist writes them)")
    if not overlap_free:
        raise CheckpointError(f"{where}: two of its chunks overlap")


def _overlap_free(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool | None:
    """Whether no two boxes (offsets, sizes) share an element; None when they are too far from a grid to tell
    in time linear in their number. The boxes' edges cut each dimension into intervals, so the space into
    cells; each cell a box covers is marked, and a cell marked twice is an overlap: as many marks as cells at
    most before one is found, so the cells are bounded (`MAX_PIECES_PER_CHUNK` per box). Boxes holding no
    element overlap nothing and are left out."""
    boxes = [(offsets, sizes) for offsets, sizes in boxes if all(sizes)]
    if not boxes:
        return True
    dims = len(boxes[0][0])
    cuts = [sorted({offsets[d] for offsets, _ in boxes} | {offsets[d] + sizes[d] for offsets, sizes in boxes})
            for d in range(dims)]
    cells = math.prod(len(edges) - 1 for edges in cuts)
    if cells > MAX_PIECES_PER_CHUNK * len(boxes):
        return None
    cell_of = [{edge: number for number, edge in enumerate(edges)} for edges in cuts]
    strides = [math.prod(len(edges) - 1 for edges in cuts[d + 1:]) for d in range(dims)]
    covered = bytearray(cells)
    for offsets, sizes in boxes:
        spans = [range(cell_of[d][offsets[d]], cell_of[d][offsets[d] + sizes[d]]) for d in range(dims)]
        for cell in itertools.product(*spans):
            flat = sum(index * stride for index, stride in zip(cell, strides))
            if covered[flat]:
                return False
            covered[flat] = 1
    return True


def check_plain_object(value, where: str) -> None:
    """Refuse an unpickled object that nests deeper than `MAX_OBJECT_DEPTH` or holds more than
    `MAX_OBJECT_ITEMS` items, each reference counted: what a reader walks (Megatron merges the common state
    into the loaded state), it must be able to walk. Walked without recursion, and stopped at the bound."""
    stack, items = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        items += 1
        if items > MAX_OBJECT_ITEMS:
            raise CheckpointError(f"{where} holds more than {MAX_OBJECT_ITEMS} objects (each reference counted): "
                                  "refused")
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            children = item
        else:
            continue
        if depth >= MAX_OBJECT_DEPTH and children:
            raise CheckpointError(f"{where} nests deeper than {MAX_OBJECT_DEPTH} levels: refused")
        stack.extend((child, depth + 1) for child in children)


def check_folder(folder: str | os.PathLike):
    """Read a torch_dist folder's metadata and every pickle in it safely, and check where its items lie.

    Returns the metadata (`torch.distributed.checkpoint.metadata.Metadata`). Raises `CheckpointError`
    (`UnsafeCheckpointError` for a pickle that needs a class outside the allow-list) naming the file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    folder = Path(folder)
    config = folder / CONFIG_FILE
    if not (config.exists() or config.is_symlink()):
        raise CheckpointError(f"{config} does not exist: {folder} is not a torch_dist checkpoint")
    raw = read_bytes(config, MAX_CONFIG_BYTES, folder)
    try:
        backend = json.loads(raw).get("sharded_backend")
    except (ValueError, AttributeError, RecursionError):  # not UTF-8, not JSON, not an object
        raise CheckpointError(f"{config} is not a JSON object") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{config}: sharded_backend is {str(backend)[:40]!r}, modelzoo reads 'torch_dist' "
                              "checkpoints")
    metadata_path = folder / METADATA_FILE
    if (metadata_path.exists() or metadata_path.is_symlink()) and \
            confined(metadata_path, folder).stat().st_size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{metadata_path} holds more than {MAX_METADATA_BYTES} bytes, more than such a file can "
                              "hold: refused")
    metadata = read_metadata(metadata_path)
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{metadata_path} is not torch_dist metadata (no entries or no storage map)")
    chunk_bytes: dict = {}  # a tensor chunk's storage index -> the bytes of its elements
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{metadata_path}: entry {str(key)[:80]!r} is neither a tensor nor bytes")
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor_entry(metadata_path, key, entry)
            indices = [MetadataIndex(key, chunk.offsets) for chunk in entry.chunks]
            itemsize = entry.properties.dtype.itemsize
            chunk_bytes.update((index, math.prod(chunk.sizes) * itemsize)
                               for index, chunk in zip(indices, entry.chunks))
        else:
            indices = [MetadataIndex(key)]
        if not all(index in storage for index in indices):
            raise CheckpointError(f"{metadata_path}: entry {key} has no place in the checkpoint's files")
    file_sizes: dict[str, int] = {}
    for index, info in storage.items():
        if (not isinstance(index, MetadataIndex) or not isinstance(info, storage_info_class())
                or not isinstance(info.relative_path, str) or not is_int(info.offset) or not is_int(info.length)):
            raise CheckpointError(f"{metadata_path}: a storage entry is malformed")
        name = info.relative_path
        if name not in file_sizes:
            # a file of this folder by its plain name: no path, so nothing outside the folder is read
            if PurePosixPath(name).name != name or name in ("", ".", ".."):
                raise CheckpointError(f"{metadata_path}: item {index.fqn} is in {name!r}, not a file of {folder}")
            if not ((folder / name).exists() or (folder / name).is_symlink()):
                raise CheckpointError(f"{metadata_path}: item {index.fqn} is in {folder / name}, which does not exist")
            file_sizes[name] = confined(folder / name, folder).stat().st_size
        if info.offset < 0 or info.length < 0 or info.offset + info.length > file_sizes[name]:
            raise CheckpointError(f"{folder / name} is truncated: item {index.fqn} spans bytes {info.offset} to "
                                  f"{info.offset + info.length} of a {file_sizes[name]}-byte file")
        if info.length < chunk_bytes.get(index, 0):  # a torch.save zip holds its tensor's bytes as they are
            raise CheckpointError(f"{folder / name}: item {index.fqn} holds {info.length} bytes, fewer than the "
                                  f"{chunk_bytes[index]} of its chunk's elements")
        if isinstance(entries.get(index.fqn), BytesStorageMetadata):
            if info.length > MAX_OBJECT_BYTES:
                raise CheckpointError(f"{folder / name}: item {index.fqn} holds {info.length} bytes, more than the "
                                      f"{MAX_OBJECT_BYTES} an object of a checkpoint may: refused")
            with open(folder / name, "rb") as file:
                data = os.pread(file.fileno(), info.length, info.offset)
            where = f"{folder / name}: item {index.fqn}"
            _check_byte_item(index.fqn, load_object(data, where), where)
    common = folder / LEGACY_COMMON_FILE
    if common.exists() or common.is_symlink():
        _check_byte_item(LEGACY_COMMON_FILE, load_object(read_bytes(common, MAX_OBJECT_BYTES, folder), str(common)),
                         str(common))
    return metadata


def _check_byte_item(fqn: str, value, where: str) -> None:
    """A byte item's object, as its readers will walk it (`check_plain_object`); the common state, which
    Megatron merges into the loaded state dict, a dict (stored as a ShardedObject: a list of that one dict;
    in a legacy common.pt, the dict itself)."""
    check_plain_object(value, where)
    if fqn == LEGACY_COMMON_FILE:
        state = value
    elif fqn.split("/")[0] == "common_state":
        state = value[0] if isinstance(value, list) and len(value) == 1 else None
    else:
        return
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} holds {type(value).__name__} {reprlib.repr(value)}: the common state must "
                              "be a dict")
