"""Checkpoints in another naming and precision, seen through the `CheckpointReader` interface.

`CheckpointView` wraps a `CheckpointReader` and shows the tensors under the names a bridge's mapping
table uses (a `rename` function), dequantising FP8-block and MXFP4 weights on `get`, one tensor at a
time (modelzoo/deepseek_v4/release/quantization.py). Scale tensors (`<x>.scale` or `<x>.weight_scale_inv` beside
`<x>.weight`) are consumed, not shown. Headers are validated when the view is built, before a byte of
data is read: a quantised weight without its scale, a scale without its weight, a scale of the wrong
block geometry or an unknown dtype is one error naming the tensor and its file.

`quantize_stream` is the other direction: `(name, tensor)` pairs in, the same pairs renamed, with the
chosen ones quantised and followed by their scales.

Kept scales make import -> export lossless for checkpoints quantised by rules other than ours: an import
keeps the source's scale tensors and formats beside the Megatron checkpoint (`KeptScales`, by the
view's weight names); the export quantises the weights the source quantised, in its formats, each
with its kept scale wherever that scale still encodes the weight's values exactly
(modelzoo/deepseek_v4/release/quantization.py, "Kept scales").

Release formats differ in their FP8 block (`fp8_block(name)`: DeepSeek-V4's 128 x 128, V4.1's 32 x 32 and 1 x 32)
and in scales a model holds as tensors of its own (`own_scale(name)`: DeepSeek-V4.1's Engram tables, whose
`.scale` the lookup multiplies in): such a pair is shown as two tensors, the FP8 codes cast to the view's dtype
and the scale as float32, both exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from modelzoo.deepseek_v4.release import quantization as q
from modelzoo.deepseek_v4.release.quantization import Block
from modelzoo.conversion.files import read_json
from modelzoo.conversion.safetensors_io import CheckpointError, CheckpointReader, TensorInfo

KEPT_SCALES_DIR = "kept_scales"  # beside an imported checkpoint's config.json (the Megatron checkpoint's hf/)
SCALE_SUFFIXES = {"native": ".scale", "hf": ".weight_scale_inv"}  # both are read; which one is written
_UNSCALED_FORBIDDEN = {torch.float8_e4m3fn, torch.float8_e5m2, q.E8M0}


def weight_of_scale(name: str) -> str | None:
    for suffix in SCALE_SUFFIXES.values():
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return None


def scale_name(weight_name: str, naming: str) -> str:
    if not weight_name.endswith(".weight"):
        raise CheckpointError(f"{weight_name}: only `.weight` tensors are quantised")
    return weight_name[: -len(".weight")] + SCALE_SUFFIXES[naming]


def _default_block(name: str) -> Block:
    return q.FP8_BLOCK_2D


def _no_own_scales(name: str) -> bool:
    return False


class CheckpointView:
    """Same interface as CheckpointReader (folder, tensors, names, shape, get, close).

    `fp8_block(name)`: the FP8 block of a weight, by its shown name; `own_scale(name)`: whether the stored
    weight `name`'s scale is a tensor of the model (shown, not consumed)."""

    def __init__(self, reader: CheckpointReader, rename: Callable[[str], str] | None = None,
                 dtype: torch.dtype = torch.float32, fp8_block: Callable[[str], Block] = _default_block,
                 own_scale: Callable[[str], bool] = _no_own_scales):
        self.reader, self.folder, self.dtype = reader, reader.folder, dtype
        self.fp8_block = fp8_block
        rename = rename or (lambda name: name)
        scales: dict[str, str] = {}
        self._own: dict[str, str] = {}  # shown name -> "codes" | "scale" of a pair the model holds as two tensors
        for name in reader.names():
            weight = weight_of_scale(name)
            if weight is not None and own_scale(weight) and weight in reader.tensors:
                self._own[rename(name)], self._own[rename(weight)] = "scale", "codes"
                continue
            if weight is not None:
                if weight not in reader.tensors:
                    raise CheckpointError(f"{reader.tensors[name].file}: scale {name} has no weight {weight}")
                if weight in scales:
                    raise CheckpointError(f"{reader.tensors[name].file}: weight {weight} has two scales, "
                                          f"{scales[weight]} and {name}")
                scales[weight] = name
        self.tensors: dict[str, TensorInfo] = {}
        self._source: dict[str, tuple[str, str | None]] = {}
        scale_names = set(scales.values())
        for name, info in reader.tensors.items():
            if name in scale_names:
                continue
            where = f"{info.file}: tensor {name}"
            scale = scales.get(name)
            target = rename(name)
            own = self._own.get(target)
            if own is not None:
                allowed = (torch.float8_e4m3fn, *q.FLOAT_DTYPES) if own == "codes" else q.FP8_SCALE_DTYPES
                if info.dtype not in allowed:
                    raise CheckpointError(f"{where} is {info.dtype}; it must be one of {list(allowed)}")
                info = TensorInfo(info.file, info.shape, dtype if own == "codes" else torch.float32)
            elif scale is not None:
                s_info = reader.tensors[scale]
                shape = q.logical_shape(info.shape, info.dtype, s_info.shape, s_info.dtype, name=where,
                                        block=fp8_block(target))
                info = TensorInfo(info.file, shape, dtype)
            elif info.dtype in _UNSCALED_FORBIDDEN or info.dtype in q.MXFP4_PACKED_DTYPES:
                raise CheckpointError(f"{where} is {info.dtype} but has no scale "
                                      f"({name.removesuffix('.weight')}.scale or .weight_scale_inv)")
            if target in self.tensors:
                raise CheckpointError(f"{where}: renamed to {target}, which another tensor already has")
            self.tensors[target] = info
            self._source[target] = (name, scale)

    @property
    def quantized(self) -> bool:
        return any(scale is not None for _, scale in self._source.values())

    def names(self) -> list[str]:
        return list(self.tensors)

    def partial_blocks(self) -> list[str]:
        """The quantised tensors (shown names) whose scale blocks do not tile them: a row or column of blocks
        ends in a partial one (DeepSeek's rule), which a loader that takes the block size from the scale grid
        misreads."""
        partial = []
        for name, (stored, scale) in self._source.items():
            if scale is None:
                continue
            fp8 = q.quantized_format(self.reader.tensors[stored].dtype, stored) == "fp8"
            block = self.fp8_block(name) if fp8 else (1, q.MX_BLOCK)
            if any(size % side for size, side in zip(self.tensors[name].shape[-2:], block)):
                partial.append(name)
        return partial

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def source(self, name: str) -> tuple[str, str | None]:
        """(stored weight name, stored scale name or None) of a shown tensor."""
        return self._source[name]

    def get(self, name: str) -> torch.Tensor:
        stored, scale = self._source[name]
        tensor = self.reader.get(stored)
        own = self._own.get(name)
        if own == "codes":  # E4M3 codes (or floats) cast: exact
            return tensor.to(self.dtype)
        if own == "scale":
            return q.scale_to_float(tensor)
        if scale is None:
            return tensor
        return q.dequantize(tensor, self.reader.get(scale), self.dtype,
                            name=f"{self.tensors[name].file}: tensor {stored}", block=self.fp8_block(name))

    def close(self) -> None:
        self.reader.close()


class KeptScales:
    """The scales and formats of a quantised source, kept beside an imported checkpoint (`folder`), by the
    view's weight names: which weights the source quantised, how, and with which scale."""

    FORMATS_FILE = "formats.json"

    def __init__(self, folder, fp8_block: Callable[[str], Block] = _default_block):
        self.reader, self.fp8_block = CheckpointReader(folder), fp8_block
        self.formats: dict[str, str] = read_json(Path(folder) / self.FORMATS_FILE, folder)
        if not all(fmt in ("fp8", "mxfp4") for fmt in self.formats.values()):
            raise CheckpointError(f"{Path(folder) / self.FORMATS_FILE} must map weight names to 'fp8' or 'mxfp4'")

    @classmethod
    def write(cls, view: CheckpointView, folder, max_shard_bytes: int = 2 * 2**30) -> int:
        """Keep the scale of every quantised tensor of `view` in `folder`. Returns how many (0: nothing
        quantised, nothing written)."""
        from modelzoo.conversion.safetensors_io import ShardedWriter

        scaled = [(name, scale) for name in view.names() for _, scale in [view.source(name)] if scale is not None]
        if not scaled:
            return 0
        formats = {}
        with ShardedWriter(folder, max_shard_bytes) as writer:
            for name, scale in scaled:
                formats[name] = q.quantized_format(view.reader.tensors[view.source(name)[0]].dtype, name)
                writer.add(name, view.reader.get(scale))
            writer.write_json(cls.FORMATS_FILE, formats)
        return len(scaled)

    def format(self, name: str) -> str | None:
        """'fp8' | 'mxfp4' as the source stored weight `name`, None if it was not quantised."""
        return self.formats.get(name)

    def scale(self, name: str, fmt: str, scale_dtype: torch.dtype, shape) -> torch.Tensor | None:
        """The kept scale of `name` if it fits a `fmt` quantisation of a `shape` tensor into `scale_dtype`."""
        if name not in self.formats:
            return None
        kept = self.reader.get(name)
        return kept if q.can_keep(kept, fmt, scale_dtype, shape, self.fp8_block(name)) else None

    def close(self) -> None:
        self.reader.close()


def keep_source_scales(reader, folder: Path) -> None:
    """At import: keep a quantised source's scales in `folder`/KEPT_SCALES_DIR (nothing for any other source)."""
    if isinstance(reader, CheckpointView) and reader.quantized:
        KeptScales.write(reader, Path(folder) / KEPT_SCALES_DIR)


def quantize_stream(tensors: Iterable[tuple[str, torch.Tensor]], rename: Callable[[str], str],
                    fmt_of: Callable[[str], str | None], naming: str, scale_dtype: torch.dtype = q.E8M0,
                    dtype: torch.dtype | None = None, kept: KeptScales | None = None,
                    fp8_block: Callable[[str], Block] = _default_block) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename each tensor; quantise those whose `fmt_of(name)` is 'fp8' | 'mxfp4' and yield their scales.

    `dtype` casts the tensors that stay unquantised (floating point, not FP8 codes), e.g. bfloat16. `kept`: the
    source's scales, used where they fit the requested format. `fp8_block(name)`: a weight's FP8 block.
    """
    for name, tensor in tensors:
        out = rename(name)
        fmt = fmt_of(name)
        if fmt is None:
            cast = dtype is not None and tensor.is_floating_point() and tensor.element_size() > 1
            yield out, tensor.to(dtype) if cast else tensor
            continue
        keep_scale = kept.scale(name, fmt, scale_dtype, tensor.shape) if kept is not None else None
        weight, scale = q.quantize(tensor, fmt, scale_dtype, name=out, keep_scale=keep_scale, block=fp8_block(name))
        yield out, weight
        yield scale_name(out, naming), scale
