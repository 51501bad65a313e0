"""Checks of what a checkpoint says before it is believed: its config's values, its weights' values.

`check_config`: every config.json value has the type its config class declares (an integer where an
integer is required: JSON `2.5`, `"2"` and `true` are not), numbers are finite (Python's JSON reader
takes `NaN` and `Infinity`) and integers fit 64 bits, sizes and counts are not negative, the model's
dimensions (`POSITIVE_FIELDS`) are at least 1, the attention heads a multiple of the key/value heads,
norm epsilons (`*_eps`) and RoPE bases (`*rope_theta`) are above 0, and the fields an architecture bounds
(`Bounds`: window lengths, ratios, iteration counts) lie in their ranges. Token ids (`*_token_id`) may be
negative: -1 is a common "none". `check_config_fits`: the config's sizes and counts against its checkpoint,
before anything is built from them (or looped over: a mapping table names every expert of every layer).

`check_finite`: weights with NaN or infinite values are refused when they are loaded, and when they are
written, unless the caller allows them (`non_finite_allowed()`, the CLI's `--allow-non-finite`): such a
checkpoint gives NaN log-probabilities, not an error, and nothing downstream says why. What is checked
is the value the model will hold: a weight cast to the model's dtype (`1e300` stored as F64 is infinite
in float32). `check_index_range`: an integer table a checkpoint supplies (a hash router's token -> expert
table) names only what exists.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import types
import typing
from collections.abc import Iterator

import torch

from modelzoo.conversion.errors import CheckpointError

# the HF names of a decoder's dimensions: a model has at least one of each
POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


def _matches(value, annotation) -> bool:
    """Whether a JSON value fits a config field's annotation (annotations it cannot read: yes)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (typing.Any,)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if annotation is dict or typing.get_origin(annotation) is dict:
        return isinstance(value, dict)
    if typing.get_origin(annotation) is typing.Literal:
        return value in typing.get_args(annotation)
    return True


def _annotation_text(annotation) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _non_finite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_non_finite(v) for v in value)
    return False


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The numbers a config field may hold, and why: at least `low` (above it with `above_low`), at most `high`,
    an integer with `integer`. An architecture's table (`ModelProvider.config_bounds`) names a field, or `name.*`
    for every value of a field that is an object or a list."""

    low: float | None = None
    high: float | None = None
    above_low: bool = False
    why: str = ""
    integer: bool = False

    def refusal(self, value) -> str | None:
        """Why `value` is refused, or None."""
        if self.integer and not isinstance(value, int):
            limit = "an integer"
        elif self.low is not None and (value <= self.low if self.above_low else value < self.low):
            limit = f"above {self.low}" if self.above_low else f"at least {self.low}"
        elif self.high is not None and value > self.high:
            limit = f"at most {self.high}"
        else:
            return None
        return f"it must be {limit}" + (f" ({self.why})" if self.why else "")


def _bounded_values(config: dict, field: str) -> list[tuple[str, object]]:
    """(name, value) of what `field` (`name` or `name.*`) names in `config`; None and absent fields: nothing."""
    name, each = field.removesuffix(".*"), field.endswith(".*")
    value = config.get(name)
    if value is None:
        return []
    if not each:
        return [(name, value)]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    return [(f"{name}[{key!r}]", item) for key, item in items]


def check_config(config: dict, config_class: type, where: str, bounds: dict[str, Bounds] | None = None) -> None:
    """Refuse the first config.json value that cannot be right, naming the field and `where` (the file);
    `bounds`: the architecture's ranges (`Bounds`)."""
    annotations = ({field.name: field.type for field in dataclasses.fields(config_class)}
                   if dataclasses.is_dataclass(config_class) else {})
    for name, value in config.items():
        if _non_finite(value):
            raise ValueError(f"{where}: {name} is {_shown(value)}; only finite numbers are allowed")
        annotation = annotations.get(name)
        if annotation is not None and not isinstance(annotation, str) and not _matches(value, annotation):
            raise ValueError(f"{where}: {name} is {_shown(value)}; it must be {_annotation_text(annotation)}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number and (name.endswith("_eps") or name.endswith("rope_theta")) and value is not None:
            raise ValueError(f"{where}: {name} is {_shown(value)}; it must be a number")
        if not number:
            continue
        if isinstance(value, int) and abs(value) >= 2**63:
            raise ValueError(f"{where}: {name} is {value}, more than a 64-bit integer holds")
        if name in POSITIVE_FIELDS and not value >= 1:
            raise ValueError(f"{where}: {name} is {value!r}; it must be at least 1")
        if (name.endswith("_eps") or name.endswith("rope_theta")) and not value > 0:
            raise ValueError(f"{where}: {name} is {value!r}; it must be above 0")
        if isinstance(value, int) and value < 0 and not name.endswith("_token_id"):
            raise ValueError(f"{where}: {name} is {value!r}; it must not be negative")
    for name, value in _rope_settings(config):
        if name.rsplit(".", 1)[-1] in ("rope_type", "type"):
            if not isinstance(value, str):
                raise ValueError(f"{where}: {name} is {_shown(value)}; it must be a string")
        elif value is not None and not isinstance(value, (bool, int, float)):
            raise ValueError(f"{where}: {name} is {_shown(value)}; it must be a number")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            refusal = ROPE_BOUNDS.get(name.rsplit(".", 1)[-1], Bounds()).refusal(value)
            if refusal is not None:
                raise ValueError(f"{where}: {name} is {value!r}; {refusal}")
    for field, bound in (bounds or {}).items():
        for name, value in _bounded_values(config, field):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{where}: {name} is {_shown(value)}; it must be a number")
            refusal = bound.refusal(value)
            if refusal is not None:
                raise ValueError(f"{where}: {name} is {value!r}; {refusal}")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")


# the RoPE settings (`rope_parameters`, or an official `rope_scaling`) that scale frequencies or positions
ROPE_FIELDS = ("rope_parameters", "rope_scaling")
ROPE_BOUNDS = {"rope_theta": Bounds(0, above_low=True, why="the RoPE base"),
               "factor": Bounds(0, above_low=True, why="it scales the positions"),
               "original_max_position_embeddings": Bounds(1, why="a number of positions"),
               "beta_fast": Bounds(0, above_low=True, why="YaRN's rotations"),
               "beta_slow": Bounds(0, above_low=True, why="YaRN's rotations"),
               "partial_rotary_factor": Bounds(0, 1, above_low=True, why="the fraction of head_dim that RoPE rotates")}


def _rope_settings(config: dict) -> list[tuple[str, object]]:
    """(dotted name, value) of every RoPE setting: the entries of `rope_parameters` / `rope_scaling`, and of the
    objects inside them (DeepSeek-V4 keeps one per kind of layer)."""
    settings = []
    for field in ROPE_FIELDS:
        value = config.get(field)
        for key, item in value.items() if isinstance(value, dict) else ():
            if isinstance(item, dict):
                settings += [(f"{field}.{key}.{inner}", leaf) for inner, leaf in item.items()]
            else:
                settings.append((f"{field}.{key}", item))
    return settings


def _shown(value) -> str:
    """A config value in a message, cut short (a list of a million entries is not repeated back)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def check_config_fits(hf_config, where: str, elements: int, tensors: int | None = None,
                      weights_per_unit: dict[str, tuple[str, ...]] | None = None) -> None:
    """The config's dimensions against the checkpoint at `where` (`elements` weights in all, in `tensors` tensors
    when the format gives every layer tensors of its own: a Hugging Face checkpoint), before a model of them is
    built (building even an empty one takes time and memory per layer and per head): no more layers than
    tensors; no dimension of the model (`POSITIVE_FIELDS`, but the context length, which has no weights) larger
    than the number of weights; and, for each count of `weights_per_unit` (layers, experts), the count times the
    weights each unit holds at least (the product of those fields) no larger either."""
    layers = getattr(hf_config, "num_hidden_layers", None)
    if tensors is not None and isinstance(layers, int) and layers > tensors:
        raise CheckpointError(f"{where}: its config.json claims {layers} layers (num_hidden_layers), "
                              f"its weights hold {tensors} tensors in all")
    for name in POSITIVE_FIELDS:
        value = getattr(hf_config, name, None)
        if name != "max_position_embeddings" and isinstance(value, int) and value > elements:
            raise CheckpointError(f"{where}: its config.json claims {name} {value}, more than the "
                                  f"{elements} weights of the checkpoint")
    for count, sizes in (weights_per_unit or {}).items():
        values = [getattr(hf_config, name, None) for name in (count, *sizes)]
        if all(isinstance(value, int) for value in values) and math.prod(values) > elements:
            raise CheckpointError(f"{where}: its config.json claims {count} {values[0]}, each with at least "
                                  f"{' x '.join(sizes)} = {math.prod(values[1:])} weights: more than the "
                                  f"{elements} weights of the checkpoint")


def reader_contents(reader) -> tuple[int, int]:
    """(tensors, elements) of an HF checkpoint reader, for `check_config_fits`."""
    return len(reader.names()), sum(math.prod(reader.shape(name)) for name in reader.names())


# --- weights ----------------------------------------------------------------------------------------
_non_finite_allowed = contextvars.ContextVar("non_finite_allowed", default=False)

# about this many elements are checked at a time: bounds what an FP8 tensor's float copy takes
_CHECK_CHUNK = 1 << 24


@contextlib.contextmanager
def non_finite_allowed(allowed: bool = True) -> Iterator[None]:
    """Meanwhile, weights with NaN or infinite values load (`check_finite` lets them through)."""
    token = _non_finite_allowed.set(allowed)
    try:
        yield
    finally:
        _non_finite_allowed.reset(token)


def first_non_finite(tensor: torch.Tensor) -> tuple[int, float] | None:
    """(flat index, value) of the first NaN or infinite element of `tensor`, or None (integer tensors: None).

    A part's minimum and maximum (`aminmax`: one pass, no memory, on one thread: `_one_thread`) are NaN or
    infinite when one of its elements is; only then is the part searched, with `isfinite` (a boolean tensor the
    size of the part). The parts are whole rows, views: nothing is copied (FP8 rows are, having no arithmetic)."""
    if not tensor.is_floating_point():
        return None
    rows = tensor.reshape(1, -1) if tensor.dim() < 2 else tensor
    row_elements = math.prod(rows.shape[1:])
    if rows.numel() == 0:
        return None
    step = max(1, _CHECK_CHUNK // max(1, row_elements))
    with _one_thread():
        for start in range(0, rows.shape[0], step):
            part = rows[start:start + step]
            part = part.float() if part.element_size() == 1 else part
            low, high = torch.aminmax(part)
            if math.isfinite(low.item()) and math.isfinite(high.item()):
                continue
            bad = (~torch.isfinite(part)).nonzero()
            if len(bad):
                position = tuple(bad[0].tolist())
                flat = start * row_elements + sum(i * math.prod(part.shape[k + 1:]) for k, i in enumerate(position))
                return flat, part[position].item()
    return None


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch's operators on one thread meanwhile: a tensor mapped from a file and read for the first time is
    read 2-5x faster so (measured on 2 CPUs: threads faulting the pages of one map wait on each other), and
    one already in memory as fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def refuses_non_finite() -> bool:
    return not _non_finite_allowed.get()


def check_finite(name: str, tensor: torch.Tensor, where: str, dtype: torch.dtype | None = None) -> None:
    """Refuse NaN or infinite values in tensor `name` (of file `where`), unless they are allowed; with `dtype`
    (the model's), also a finite value that the cast to `dtype` makes infinite."""
    if not refuses_non_finite():
        return
    found = first_non_finite(tensor)
    if found is not None:
        index, value = found
        raise CheckpointError(f"{where}: tensor {name} holds {value} at element {index}: weights with NaN or "
                              "infinite values are refused (--allow-non-finite loads them)")
    if dtype is None or dtype == tensor.dtype or not tensor.is_floating_point():
        return
    rows = tensor.reshape(1, -1) if tensor.dim() < 2 else tensor
    step = max(1, _CHECK_CHUNK // max(1, math.prod(rows.shape[1:])))
    for start in range(0, rows.shape[0], step):  # cast a part at a time: a float32 copy of all of it may not fit
        found = first_non_finite(rows[start:start + step].to(dtype))
        if found is not None:
            index = start * math.prod(rows.shape[1:]) + found[0]
            value = rows.reshape(-1)[index].item()
            raise CheckpointError(f"{where}: tensor {name} holds {value} at element {index}, which is {found[1]} in "
                                  f"{str(dtype).removeprefix('torch.')}, the model's dtype: weights that are not "
                                  "finite in it are refused (--allow-non-finite loads them)")


def check_written(name: str, blocks: list[torch.Tensor]) -> None:
    """Refuse writing tensor `name` (as its row blocks, one after the other) with NaN or infinite values, unless
    they are allowed."""
    if not refuses_non_finite():
        return
    first = 0
    for block in blocks:
        found = first_non_finite(block)
        if found is not None:
            index, value = found
            raise CheckpointError(f"tensor {name} holds {value} at element {first + index}: weights with NaN or "
                                  "infinite values are not written (--allow-non-finite writes them)")
        first += block.numel()


def check_index_range(name: str, tensor: torch.Tensor, low: int, high: int, meaning: str, where: str) -> None:
    """Refuse an integer tensor `name` (of `where`) holding a value outside [low, high) (`meaning`: what its
    values name, for the message)."""
    if tensor.numel() == 0 or tensor.is_floating_point():
        return
    smallest, largest = torch.aminmax(tensor)
    if smallest.item() >= low and largest.item() < high:
        return
    flat = tensor.reshape(-1)
    index = int(((flat < low) | (flat >= high)).nonzero()[0, 0])
    raise CheckpointError(f"{where}: tensor {name} holds {flat[index].item()} at element {index}: its values "
                          f"name {meaning}, which lie in [{low}, {high})")
