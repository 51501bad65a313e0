"""Hugging Face checkpoints on disk: a lazy reader and an atomic sharded writer.

The reader opens `model.safetensors` or the shards listed by `model.safetensors.index.json` and
gives one tensor at a time; shapes and dtypes come from the headers without reading data. Each tensor
(of 1 MiB or more) is a memory map of its own bytes (`file_bytes`), not a copy: the data goes from the page cache
straight to where it is written, and since the mapping goes when the tensor does, its pages count in
the process's resident memory only while the tensor is in use (a map of the whole file would show the
whole checkpoint by the end of a streamed conversion).
The writer fills shards up to a size bound, writes them into a temporary folder beside the target
and renames it into place only when everything succeeded, so a failure leaves nothing behind. It
copies a tensor whose bytes are still a file's (one of those maps, or part of one, that nothing wrote
to: `file_region`) from that file in the kernel (`RegionCopier`, which the torch_dist writer uses too)
rather than from the map.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import io
import json
import math
import mmap
import os
import shutil
import struct
import weakref
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import numpy
import torch

from modelzoo.conversion import validation
from modelzoo.conversion.errors import CheckpointError
from modelzoo.conversion.files import confined, read_json
from modelzoo.conversion.staging import staged_folder
from modelzoo.conversion.transforms import RowBlocks

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
}


_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items() if dtype is not None}


def _entry(data: torch.Tensor | RowBlocks, offset: int, size: int) -> dict:
    """A tensor's entry in a safetensors header."""
    return {"dtype": _DTYPE_NAMES[data.dtype], "shape": list(data.shape), "data_offsets": [offset, offset + size]}


def _entry_length(name: str, entry: dict) -> int:
    """Bytes of an entry in a compact safetensors header, with the comma before it."""
    return len(json.dumps({name: entry}, separators=(",", ":"))) - 1


# A map holds a file descriptor (and at least a page) for as long as its tensor lives, and an export
# group can hold thousands of small tensors at once: below this size a tensor's bytes are read instead.
MAP_MIN_BYTES = 1 << 20


class _OpenFile:
    """A file kept open while a map of it lives, so that the writer can copy the mapped bytes from the
    file itself (`file_region`) after the caller has closed the file object the map was made from.
    One descriptor per file, shared by all of its maps, closed when the last of them goes."""

    def __init__(self, file: io.IOBase):
        self.fd = os.dup(file.fileno())
        self.name = str(getattr(file, "name", "a file"))
        weakref.finalize(self, os.close, self.fd)


class FileRegion(NamedTuple):
    fd: int
    offset: int
    file: str  # its name, for messages


class _Region(NamedTuple):
    mapping: weakref.ref  # the mmap; dead from the moment it is unmapped
    file: _OpenFile
    offset: int  # of the region's first byte in the file


_open_files: weakref.WeakValueDictionary[tuple[int, int], _OpenFile] = weakref.WeakValueDictionary()
_regions: dict[int, _Region] = {}  # a live map's tensor's first byte (its storage's data_ptr) -> its file region


def _forget(address: int, region: _Region) -> None:
    if _regions.get(address) is region:  # not a newer map at the same address
        _regions.pop(address)


def file_bytes(file: io.IOBase, offset: int, size: int) -> torch.Tensor:
    """`size` bytes of an open file from `offset` as a uint8 tensor: from `MAP_MIN_BYTES` on, a private
    (copy-on-write) memory map of just those pages, no copy, unmapped when the tensor and every view
    of it are gone; smaller, a copy in fresh memory. The file must not shrink meanwhile (reading a
    mapped page past its end kills the process), so callers check sizes against the file first."""
    if size < MAP_MIN_BYTES:
        data = os.pread(file.fileno(), size, offset)
        if len(data) != size:
            raise CheckpointError(f"{getattr(file, 'name', 'a file')} ends before byte {offset + size}, the end of "
                                  f"the {size} bytes read from byte {offset}")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY  # a map starts on a page boundary
    mapping = mmap.mmap(file.fileno(), offset - start + size, access=mmap.ACCESS_COPY, offset=start)
    data = torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=offset - start)  # a storage of these bytes
    stat = os.fstat(file.fileno())
    source = _open_files.get((stat.st_dev, stat.st_ino))
    if source is None:  # the descriptor holds the file, so no other file gets its inode meanwhile
        source = _open_files[(stat.st_dev, stat.st_ino)] = _OpenFile(file)
    region = _regions[data.data_ptr()] = _Region(weakref.ref(mapping), source, offset)
    weakref.finalize(mapping, _forget, data.data_ptr(), region)
    return data


# flags of a page's 64-bit entry in /proc/self/pagemap (the kernel's Documentation/admin-guide/mm/pagemap.rst)
_PAGEMAP_PRESENT, _PAGEMAP_SWAPPED, _PAGEMAP_FILE = numpy.uint64(1 << 63), numpy.uint64(1 << 62), numpy.uint64(1 << 61)


def _pagemap(address: int, size: int) -> numpy.ndarray | None:
    """The pagemap entries of the pages of this process's memory from `address` on (`size` bytes), or
    None where /proc/self/pagemap cannot be read."""
    first, end = address // mmap.PAGESIZE, -(-(address + size) // mmap.PAGESIZE)
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            raw = os.pread(pagemap.fileno(), 8 * (end - first), 8 * first)
    except OSError:
        return None
    return numpy.frombuffer(raw, dtype="<u8") if len(raw) == 8 * (end - first) else None


def _private(pages: numpy.ndarray) -> numpy.ndarray:
    """Which pages are in memory and not a file's: written, for a page of a copy-on-write map."""
    return (pages & (_PAGEMAP_PRESENT | _PAGEMAP_FILE)) == _PAGEMAP_PRESENT


@functools.cache
def _pagemap_shows_writes() -> bool:
    """Whether pagemap shows memory just written as such (an emulated /proc may show no page present)."""
    probe = torch.ones(2 * mmap.PAGESIZE, dtype=torch.uint8)
    pages = _pagemap(probe.data_ptr(), probe.nbytes)
    return pages is not None and bool(_private(pages).all())


def _written(address: int, size: int) -> bool:
    """Whether a page of this process's memory from `address` on (`size` bytes) has been written since
    it was mapped from a file, as the kernel's page table says: a written page of a copy-on-write map is
    a private copy, in memory or in swap. True where pagemap cannot tell."""
    pages = _pagemap(address, size) if _pagemap_shows_writes() else None
    return pages is None or bool(_private(pages).any() or (pages & _PAGEMAP_SWAPPED).any())


def file_region(tensor: torch.Tensor) -> FileRegion | None:
    """The file bytes that a contiguous CPU tensor's bytes are, as an open descriptor (open while the
    tensor lives) and offset: when they lie in a map made by `file_bytes` and none of the pages they
    lie on has been written to (the maps are copy-on-write: an in-place change reaches the memory, not
    the file); else None."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    storage = tensor.untyped_storage()  # the region's bytes exactly, for a tensor of a map
    region = _regions.get(storage.data_ptr())
    # a map another thread is unmapping is dead before it is forgotten
    if region is None or region.mapping() is None or _written(tensor.data_ptr(), tensor.nbytes):
        return None
    return FileRegion(region.file.fd, region.offset + tensor.data_ptr() - storage.data_ptr(), region.file.name)


# copy_file_range's errors that mean "not between these files" (different filesystems, a filesystem or
# kernel without it), not a failed read or write
_CANNOT_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


class RegionCopier:
    """Appends a tensor's bytes to a file by copying them, in the kernel (`os.copy_file_range`), from the
    file they still are a region of (`file_region`): writing them from a map of them would first fault
    each of its pages into this process (slow on a VM). The first copy is made in the caller's thread:
    if the files cannot be copied between (`copies` False), it finds no more regions and the caller
    writes every tensor itself. The later ones run on one worker thread while the caller goes on making
    and writing what comes next (the kernel copies with the GIL released): a copy's place in the file is
    known from its size, so the caller writes on after it (one that finds its files cannot be copied
    between writes the bytes from memory itself). `check` runs a check of what is written on a thread of
    its own, beside the copies and the caller. The tensors whose copies or checks are pending stay alive
    (and mapped) until done: past `MAX_IN_FLIGHT_BYTES` of them the caller waits for the oldest, so that a
    caller faster than the copies does not map the checkpoint ahead of them. `finish()` waits for them all
    and raises their errors; the destination file must not be closed before (`with RegionCopier() as
    copier`, or `close()`)."""

    MAX_IN_FLIGHT_BYTES = 256 * 2**20

    def __init__(self):
        self.copies = hasattr(os, "copy_file_range")
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._checker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[tuple[concurrent.futures.Future, int]] = []  # with the bytes each keeps alive

    def __enter__(self) -> RegionCopier:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.finish(raise_errors=exc_type is None)
        finally:
            self.close()

    def region(self, tensor: torch.Tensor) -> FileRegion | None:
        return file_region(tensor) if self.copies else None

    def append(self, file: io.BufferedWriter, region: FileRegion, size: int, what: str, source: torch.Tensor) -> bool:
        """Append `size` bytes from `region` (the bytes of `source`, kept alive until copied) to `file`, at
        its position. False, with `file`'s position unchanged, when these files cannot be copied between;
        the caller writes the bytes instead. `what` names them in errors."""
        file.flush()
        position = file.tell()
        if self._worker is None:  # the first copy, here: whether these files can be copied between at all
            if not _copy(region, file.fileno(), position, size, what):
                self.copies = False
                return False
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="region-copier")
        else:
            self._submit(self._worker, size, _copy_or_write, region, file.fileno(), position, size, what, source)
        file.seek(position + size)  # the copy writes at its own offsets; the file goes on after it
        return True

    def check(self, size: int, check: Callable[..., None], *args) -> None:
        """`check(*args)` (it raises what it finds) on the checking thread, while the caller goes on: a check
        that reads every byte of what is written (`validation.check_written`) runs beside the kernel's
        copies instead of before them. Its error is raised by a later call, at the latest by `finish()`.
        Where the files cannot be copied between, it runs here, before the caller writes the bytes from
        memory: the write then reads pages the check mapped in (two threads reading the same map's pages
        for the first time wait on each other's page faults). `size`: the bytes its arguments keep alive."""
        if not self.copies:
            check(*args)
            return
        if self._checker is None:
            self._checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="region-checker")
        self._submit(self._checker, size, check, *args)

    def _submit(self, pool: concurrent.futures.ThreadPoolExecutor, size: int, work: Callable[..., None], *args) -> None:
        self._raise_failed()
        self._pending.append((pool.submit(work, *args), size))
        while len(self._pending) > 1 and sum(held for _, held in self._pending) > self.MAX_IN_FLIGHT_BYTES:
            self._pending.pop(0)[0].result()  # the oldest: its error is raised here

    def write(self, file: io.BufferedWriter, blocks: list[torch.Tensor], what: str) -> None:
        """Append the blocks' bytes to `file`, one after the other: each copied from the file it is a
        region of where it is one (`append`), else written from memory. `what` names them in errors."""
        for block in blocks:
            block = block.contiguous()
            region = self.region(block)
            if region is None or not self.append(file, region, block.nbytes, what, block):
                file.write(_memory_bytes(block))

    def finish(self, raise_errors: bool = True) -> None:
        """Wait for every copy; raise the first one's error (`raise_errors`)."""
        pending, self._pending = self._pending, []
        errors = [future.exception() for future, _ in pending]
        if raise_errors and any(errors):
            raise next(error for error in errors if error is not None)

    def close(self) -> None:
        """Wait for every copy (their errors dropped: the caller is failing already, or has `finish`ed)
        and stop the worker thread."""
        self.finish(raise_errors=False)
        for pool in (self._worker, self._checker):
            if pool is not None:
                pool.shutdown()
        self._worker = self._checker = None

    def _raise_failed(self) -> None:
        done, running = [], []
        for future, size in self._pending:  # each looked at once: one that ends meanwhile is in one list, not neither
            (done if future.done() else running).append((future, size))
        self._pending = running
        for future, _ in done:
            future.result()


def _memory_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, where they lie in memory."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _copy(region: FileRegion, fd: int, position: int, size: int, what: str) -> bool:
    """`size` bytes from `region` to `fd` at `position` with copy_file_range; False when these files
    cannot be copied between (nothing to undo: the caller writes the same bytes over any copied)."""
    copied = 0
    while copied < size:
        try:
            step = os.copy_file_range(region.fd, fd, size - copied, region.offset + copied, position + copied)
        except OSError as error:
            if error.errno not in _CANNOT_COPY:
                raise
            return False
        if step == 0:
            raise CheckpointError(f"{what}: {region.file} ends before byte {region.offset + size}, "
                                  f"the end of its {size} bytes from byte {region.offset}")
        copied += step
    return True


def _copy_or_write(region: FileRegion, fd: int, position: int, size: int, what: str, source: torch.Tensor) -> None:
    if not _copy(region, fd, position, size, what):  # files the first copy could not tell about
        data = _memory_bytes(source)
        written = 0
        while written < size:
            written += os.pwrite(fd, data[written:], position + written)


class TensorInfo:
    __slots__ = ("file", "shape", "dtype")

    def __init__(self, file: Path, shape: tuple[int, ...], dtype: torch.dtype):
        self.file, self.shape, self.dtype = file, shape, dtype


# the safetensors library's bound on a header: more than this is not a checkpoint (nor memory to spend on one)
MAX_HEADER_BYTES = 100 * 2**20


class _RepeatedName(ValueError):
    pass


def _unique_names(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's pairs as a dict, refusing a name given twice (json keeps the last one silently)."""
    result = {}
    for name, value in pairs:
        if name in result:
            raise _RepeatedName(name)
        result[name] = value
    return result


def _header_json(raw: bytes, path: Path) -> dict:
    """A safetensors header's JSON as the safetensors library reads it: UTF-8 text (no other encoding, no
    byte-order mark: Python's JSON reader would take both), an object with no name given twice."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path} is not a safetensors file: its header is not UTF-8 "
                              f"(byte {error.start})") from None
    if text.startswith("\ufeff"):
        raise CheckpointError(f"{path} is not a safetensors file: its header starts with a byte-order mark")
    try:
        header = json.loads(text, object_pairs_hook=_unique_names, parse_constant=_refuse_constant)
    except _RepeatedName as error:
        raise CheckpointError(f"{path}: its header names {error} twice") from None
    except (ValueError, RecursionError):  # not JSON, NaN / Infinity, an integer of too many digits, too deep
        raise CheckpointError(f"{path} is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file: its header is not a JSON object")
    return header


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def is_int(value) -> bool:
    """An integer read from JSON or a pickle, not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, tuple[int, int]]]:
    """Parse and validate a safetensors header, as the safetensors library does: every entry a known dtype,
    a shape and a byte range in the data section whose size is the shape's, the ranges filling the data
    section one after the other.

    Returns every tensor's `TensorInfo` and its (file offset, bytes)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            raw_length = handle.read(8)
            if len(raw_length) < 8:
                raise CheckpointError(f"{path} is not a safetensors file: it is {size} bytes long")
            (header_length,) = struct.unpack("<Q", raw_length)
            if header_length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path} is not a safetensors file: its header would be {header_length} bytes")
            if 8 + header_length > size:
                raise CheckpointError(f"{path} is truncated: its header claims {header_length} bytes, the file has {size}")
            raw = handle.read(header_length)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    header = _header_json(raw, path)
    data_size = size - 8 - header_length
    tensors, spans, ranges = {}, {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CheckpointError(f"{path}: its __metadata__ must map names to strings")
            continue
        where = f"{path}: tensor {name}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise CheckpointError(f"{where}: its entry must have a dtype, a shape and data_offsets")
        dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise CheckpointError(f"{where} has unsupported dtype {entry['dtype']!r}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
            raise CheckpointError(f"{where}: its shape {shape!r} is not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(n) for n in offsets):
            raise CheckpointError(f"{where}: its data_offsets {offsets!r} are not two byte offsets")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise CheckpointError(f"{where}: its data_offsets [{begin}, {end}] are not a byte range")
        if end > data_size:
            raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte {end} of a {data_size}-byte data section")
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise CheckpointError(f"{where} has {end - begin} bytes, its shape {shape} and dtype {entry['dtype']} "
                                  f"need {expected}")
        tensors[name] = TensorInfo(path, tuple(shape), dtype)
        spans[name] = (8 + header_length + begin, end - begin)
        ranges.append((begin, end, name))
    # the tensors fill the data section one after the other, as the safetensors library requires
    filled, previous = 0, None
    for begin, end, name in sorted(ranges):
        if begin < filled:
            raise CheckpointError(f"{path}: tensors {previous} and {name} overlap (bytes {begin} to {filled})")
        if begin > filled:
            raise CheckpointError(f"{path}: bytes {filled} to {begin} of its data section belong to no tensor")
        filled, previous = end, name
    if filled != data_size:
        raise CheckpointError(f"{path}: bytes {filled} to {data_size} of its data section belong to no tensor")
    return tensors, spans


class CheckpointReader:
    """Lazy access to the tensors of a Hugging Face checkpoint folder."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder} is not a folder")
        self.tensors: dict[str, TensorInfo] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # name -> (file offset, bytes)
        for file in self._files():
            tensors, spans = _read_header(file)
            for name in tensors:
                if name in self.tensors:
                    raise CheckpointError(f"{self.folder}: tensor {name} appears in both {self.tensors[name].file.name} and {file.name}")
            self.tensors.update(tensors)
            self._spans.update(spans)
        self._handles: dict[Path, io.RawIOBase] = {}

    def _files(self) -> list[Path]:
        index = self.folder / INDEX_FILE
        if index.exists() or index.is_symlink():
            weight_map = read_json(index, self.folder).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
                raise CheckpointError(f"{index} is not a valid index: its weight_map must map names to file names")
            files = sorted({self._shard(index, shard) for shard in weight_map.values()})
            for file in files:
                if not (file.exists() or file.is_symlink()):
                    raise CheckpointError(f"{index} lists {file.name}, which does not exist")
                confined(file, self.folder)
            return files
        single = self.folder / SINGLE_FILE
        if not (single.exists() or single.is_symlink()):
            raise CheckpointError(f"{self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        return [confined(single, self.folder)]

    def _shard(self, index: Path, shard: str) -> Path:
        """A shard the index lists, which must lie in this folder: a relative path without `..`, in no
        folder that links outside it (the file itself may be a link within the rules of `files.confined`:
        an HF cache's snapshot links each file to its blob)."""
        relative = PurePosixPath(shard)
        path = self.folder / relative
        if (relative.is_absolute() or ".." in relative.parts or not relative.parts
                or not path.parent.resolve().is_relative_to(self.folder.resolve())):
            raise CheckpointError(f"{index} lists {shard!r}, which is not a file of {self.folder}")
        return path

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def get(self, name: str) -> torch.Tensor:
        """One tensor, mapped from its file (copy-on-write: writing to it leaves the file alone)."""
        info = self.tensors[name]
        offset, size = self._spans[name]
        if info.file not in self._handles:
            self._handles[info.file] = open(info.file, "rb", buffering=0)
        return file_bytes(self._handles[info.file], offset, size).view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


class ShardedWriter:
    """Write tensors into shards of at most `max_shard_bytes`, atomically into `folder`.

        with ShardedWriter(out_dir) as writer:
            for name, tensor in tensors:
                writer.add(name, tensor)
            writer.copy_file(src_dir / "config.json", src_dir)

    Streams: each tensor's bytes go to its shard file when it is added, so memory stays one tensor,
    not one shard. A safetensors header (every tensor's offsets) comes before the data, so each shard
    reserves `HEADER_BYTES` for it and pads the JSON with spaces, as the format allows; a shard whose
    header would outgrow that is closed early.
    """

    HEADER_BYTES = 64 * 1024

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int = 5 * 2**30):
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self._file: io.BufferedWriter | None = None
        self._header: dict[str, dict] = {}
        self._header_length = 0
        self._shard_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0
        self._copier = RegionCopier()

    def __enter__(self) -> ShardedWriter:
        self._stage = staged_folder(self.folder)
        self.staging = self._stage.__enter__()
        return self

    def add(self, name: str, tensor: torch.Tensor | RowBlocks) -> None:
        """Append a tensor, or one held as row blocks (written block after block, each taken where it is)."""
        data = tensor if isinstance(tensor, RowBlocks) else RowBlocks([tensor])
        if data.dtype not in _DTYPE_NAMES:
            raise CheckpointError(f"tensor {name}: safetensors has no dtype {data.dtype}")
        blocks = [block.detach().to("cpu") for block in data.blocks]
        if validation.refuses_non_finite():  # read beside the copies; an error is raised before the shard is closed
            self._copier.check(sum(block.nbytes for block in blocks), validation.check_written, name, blocks)
        size = sum(block.nbytes for block in blocks)
        if self._file is not None and (self._shard_bytes + size > self.max_shard_bytes or self._header_length
                                       + _entry_length(name, _entry(data, self._shard_bytes, size)) > self.HEADER_BYTES):
            self._close_shard()
        if self._file is None:
            self._open_shard()
        entry = _entry(data, self._shard_bytes, size)
        entry_length = _entry_length(name, entry)
        if self._header_length + entry_length > self.HEADER_BYTES:
            raise CheckpointError(f"tensor {name}: its header entry is {entry_length} bytes, more than a shard header holds")
        self._header[name] = entry
        self._header_length += entry_length
        self._copier.write(self._file, blocks, f"tensor {name}")
        self._shard_bytes += size
        self.total_bytes += size

    def copy_file(self, source: Path, folder: Path) -> None:
        """Copy file `source` of checkpoint folder `folder` into the output (refused unless it lies in that
        folder and is a regular file: `files.confined`)."""
        shutil.copy2(confined(source, folder), self.staging / source.name)

    def write_json(self, name: str, content: dict) -> None:
        (self.staging / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")

    def _open_shard(self) -> None:
        self._file = open(self.staging / f"shard-{len(self._shards)}.tmp", "wb")
        self._file.seek(8 + self.HEADER_BYTES)
        self._header = {"__metadata__": {"format": "pt"}}
        self._header_length = len(json.dumps(self._header, separators=(",", ":")))
        self._shard_bytes = 0

    def _close_shard(self) -> None:
        self._copier.finish()
        header = json.dumps(self._header, separators=(",", ":")).encode()
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self.HEADER_BYTES) + header.ljust(self.HEADER_BYTES, b" "))
        self._file.close()
        self._file = None
        self._shards.append([name for name in self._header if name != "__metadata__"])

    def __exit__(self, exc_type, exc, tb):
        failure = None
        if exc_type is None:
            try:
                if self._file is None and not self._shards:
                    self._open_shard()  # no tensors: still one (empty) checkpoint file
                if self._file is not None:
                    self._close_shard()
                self._finalise_shard_names()
            except BaseException as error:  # the staging folder goes, the error propagates
                failure, exc_type, exc, tb = error, type(error), error, error.__traceback__
        self._copier.close()  # no copy may still write to a shard once it is closed
        if self._file is not None:  # an error left a shard open
            self._file.close()
        suppressed = self._stage.__exit__(exc_type, exc, tb)
        # the staging context, given an error of this exit (a copy's, a check's), removes the folder and returns
        # False, which propagates only an error of the `with` body: this one is raised here
        if failure is not None:
            raise failure
        return suppressed

    def _finalise_shard_names(self) -> None:
        count = len(self._shards)
        if count == 1:
            os.replace(self.staging / "shard-0.tmp", self.staging / SINGLE_FILE)
            return
        weight_map = {}
        for number, names in enumerate(self._shards):
            final = f"model-{number + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.staging / f"shard-{number}.tmp", self.staging / final)
            weight_map.update(dict.fromkeys(names, final))
        self.write_json(INDEX_FILE, {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map})
