"""Checks of what a checkpoint says before it is believed: its config's values, its weights' values.

`check_config`: every config.json value has the type its config class declares (an integer where an
integer is required: JSON `2.5`, `"2"` and `true` are not), numbers are finite (Python's JSON reader
takes `NaN` and `Infinity`) and integers fit 64 bits, sizes and counts are not negative, the model's
dimensions (`POSITIVE_FIELDS`) are at least 1, the attention heads a multiple of the key/value heads, and
norm epsilons (`*_eps`) and RoPE bases (`*rope_theta`) are above 0. Token ids (`*_token_id`) may be
negative: -1 is a common "none". `check_config_fits`: the config's sizes against its checkpoint, before
anything is built from them.

`check_finite`: weights with NaN or infinite values are refused when they are loaded, unless the
caller allows them (`non_finite_allowed()`, the CLI's `--allow-non-finite`): such a checkpoint gives
NaN log-probabilities, not an error, and nothing downstream says why.
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

from conversion.safetensors_io import CheckpointError

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


def check_config(config: dict, config_class: type, where: str) -> None:
    """Refuse the first config.json value that cannot be right, naming the field and `where` (the file)."""
    annotations = ({field.name: field.type for field in dataclasses.fields(config_class)}
                   if dataclasses.is_dataclass(config_class) else {})
    for name, value in config.items():
        if _non_finite(value):
            raise ValueError(f"{where}: {name} is {value!r}; only finite numbers are allowed")
        annotation = annotations.get(name)
        if annotation is not None and not isinstance(annotation, str) and not _matches(value, annotation):
            raise ValueError(f"{where}: {name} is {value!r}; it must be {_annotation_text(annotation)}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
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
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")


def check_config_fits(hf_config, reader) -> None:
    """The config's dimensions against its checkpoint, before a model of them is built (building even an empty
    one takes time and memory per layer and per head): every layer has weights of its own, so there are no
    more layers than tensors, and no dimension of the model (`POSITIVE_FIELDS`, but the context length,
    which has no weights) exceeds the number of weights the checkpoint holds."""
    tensors = len(reader.names())
    layers = getattr(hf_config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > tensors:
        raise CheckpointError(f"{reader.folder}: its config.json claims {layers} layers (num_hidden_layers), "
                              f"its weights hold {tensors} tensors in all")
    elements = sum(math.prod(reader.shape(name)) for name in reader.names())
    for name in POSITIVE_FIELDS:
        value = getattr(hf_config, name, None)
        if name != "max_position_embeddings" and isinstance(value, int) and value > elements:
            raise CheckpointError(f"{reader.folder}: its config.json claims {name} {value}, more than the "
                                  f"{elements} weights of the checkpoint")


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

    A part's sum in float64 is NaN or infinite when one of its elements is, and finite float32 values cannot
    add up to an overflow: summing takes no memory, where `isfinite` would make a boolean tensor the size of
    the part (the parts are whole rows, views: nothing is copied; FP8 rows are, having no arithmetic)."""
    if not tensor.is_floating_point():
        return None
    rows = tensor.reshape(1, -1) if tensor.dim() < 2 else tensor
    row_elements = math.prod(rows.shape[1:])
    step = max(1, _CHECK_CHUNK // max(1, row_elements))
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        part = part.float() if part.element_size() == 1 else part
        if math.isfinite(part.sum(dtype=torch.float64).item()):
            continue
        bad = (~torch.isfinite(part)).nonzero()
        if len(bad):
            position = tuple(bad[0].tolist())
            flat = start * row_elements + sum(i * math.prod(part.shape[k + 1:]) for k, i in enumerate(position))
            return flat, part[position].item()
    return None


def refuses_non_finite() -> bool:
    return not _non_finite_allowed.get()


def check_finite(name: str, tensor: torch.Tensor, where: str) -> None:
    """Refuse NaN or infinite values in tensor `name` (of file `where`), unless they are allowed."""
    found = first_non_finite(tensor) if refuses_non_finite() else None
    if found is not None:
        index, value = found
        raise CheckpointError(f"{where}: tensor {name} holds {value} at element {index}: weights with NaN or "
                              "infinite values are refused (--allow-non-finite loads them)")
