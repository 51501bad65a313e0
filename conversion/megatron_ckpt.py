"""Megatron checkpoints in `torch_dist` format (megatron.core.dist_checkpointing), Megatron-LM layout.

    MEGATRON_DIR/
      latest_checkpointed_iteration.txt   "release"
      release/                            dist_checkpointing files: {"model": ..., "iteration": 0, ...}
      hf/                                 config.json and tokenizer files of the source checkpoint
                                          (+ kept_scales/ of a quantised source, modelzoo/deepseek_v4/release/view.py)
      modelzoo.json                       architecture, dtype, TP size it was written at

torch_dist stores each tensor with its global shape and this rank's slice, so a checkpoint written
at one TP size loads at any other. Saving is atomic: everything goes into a staging folder that is
renamed into place once every rank has finished. Conversion streams both ways (torch_dist_streaming.py):
`save` of a model built on the meta device makes each tensor when it is written, and `stream_weights`
reads a checkpoint back a bounded group of tensors at a time. Reading a checkpoint checks it first:
every pickle in it read by an allow-list (conversion/safe_pickle.py), every tensor against the model
(`check_stored_tensors`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from modelzoo.conversion import safe_pickle
from modelzoo.conversion.engine import checkpoint_name_of, rank, state_dict_tensors, with_layout_of
from modelzoo.conversion.errors import CheckpointError
from modelzoo.conversion.files import confined, read_bytes, read_json
from modelzoo.conversion.safetensors_io import is_int
from modelzoo.conversion.staging import create_staging_folder, publish_staging_folder, write_failure
from modelzoo.conversion.torch_dist_streaming import (
    ParameterData,
    load_groups,
    original_errors,
    streaming_load_strategy,
    streaming_save_strategy,
)
from modelzoo.conversion.transforms import RowBlocks

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
HF_SUBDIR = "hf"
METADATA_FILE = "modelzoo.json"
# an iteration number or "release", and a newline: a longer tracker is not Megatron-LM's
MAX_TRACKER_BYTES = 64


def _broadcast(value):
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sharded_state(state: dict, folder: str | Path, state_dir: str, write_side_files: Callable[[Path], None],
                       sharded_strategy=None) -> None:
    """Collective: `dist_checkpointing.save(state, sharded_strategy=...)` into `folder/state_dir`, atomically.

    Everything is written into a staging folder beside `folder`; once every rank has saved its shards,
    rank 0 calls `write_side_files(staging)` and renames the staging folder into place. On any error the
    staging folder is removed and nothing appears at `folder` (a full disk or a read-only folder is
    reported as such, naming `folder`).
    """
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    staging, error = None, None
    if rank() == 0:
        try:
            staging = create_staging_folder(folder)
        except CheckpointError as failure:
            error = str(failure)
    staging, error = _broadcast((staging, error))
    if error:
        raise CheckpointError(error)
    try:
        if rank() == 0:
            (staging / state_dir).mkdir()
        _barrier()
        with original_errors():
            dist_checkpointing.save(state, str(staging / state_dir), sharded_strategy=sharded_strategy)
        _barrier()
        if rank() == 0:
            write_side_files(staging)
            publish_staging_folder(staging, folder)
        _barrier()
    except BaseException as error:
        if rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        failure = write_failure(error, folder)
        if failure is not None:
            raise failure from None
        raise


def save(model: torch.nn.Module, folder: str | Path, metadata: dict, hf_files: list[Path] = (),
         weights: Callable[[str], RowBlocks] | None = None, progress: bool = True,
         write_hf_side: Callable[[Path], None] | None = None) -> None:
    """Collective: write `model` (every rank its shard) plus metadata and HF side files, atomically.

    `hf_files` are copied into the checkpoint's hf/ folder; `write_hf_side(folder)` (rank 0) adds what
    else the export will need from the source there (e.g. a quantised source's kept scales).

    The writer takes one tensor at a time. `weights`: for a model built on the meta device
    (`provider.provide_skeleton()`), `weights(name)` makes this rank's tensor `name` (as
    `transforms.RowBlocks`) when the writer reaches it, so memory stays near one tensor, not the model.
    """
    def write_side_files(staging: Path) -> None:
        (staging / TRACKER_FILE).write_text(RELEASE)
        (staging / HF_SUBDIR).mkdir()
        for file in hf_files:  # files of the source folder: refused if a link leads out of it (`files.confined`)
            shutil.copy2(confined(file, file.parent), staging / HF_SUBDIR / file.name)
        if write_hf_side is not None:
            write_hf_side(staging / HF_SUBDIR)
        (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")

    state = {"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 0}
    params = {name: t for name, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    data = ParameterData(params, weights, progress and rank() == 0) if weights is not None else None
    try:
        save_sharded_state(state, folder, RELEASE, write_side_files, streaming_save_strategy(data))
    finally:
        if data is not None:
            data.close()


def read_metadata(folder: str | Path) -> dict:
    """modelzoo.json of a checkpoint folder: a JSON object; the architecture and the dtype (names), the layout it
    was written at (counts of at least 1) and the architecture's options (an object) where it gives them."""
    folder = Path(folder)
    path = folder / METADATA_FILE
    if not (folder / TRACKER_FILE).exists() or not path.exists():
        raise CheckpointError(f"{folder} is not a modelzoo Megatron checkpoint (no {TRACKER_FILE} or {METADATA_FILE})")
    metadata = read_json(path, folder)
    if not all(isinstance(metadata.get(key), (str, type(None))) for key in ("architecture", "dtype")):
        raise CheckpointError(f"{path}: architecture and dtype must be names")
    for key in ("written_at_tp", "written_at_ep", "written_at_pp"):
        value = metadata.get(key, 1)
        if not is_int(value) or value < 1:
            raise CheckpointError(f"{path}: {key} is {json.dumps(value)[:40]}; it must be an integer of at least 1")
    if not isinstance(metadata.get("model_options", {}), dict):
        raise CheckpointError(f"{path}: model_options must be a JSON object")
    return metadata


def hf_side(folder: str | Path) -> Path:
    """The checkpoint's `hf/` folder (its config and tokenizer files), which must lie in it (`files.confined`)."""
    return confined(Path(folder) / HF_SUBDIR, folder, folder=True)


def state_folder(folder: str | Path) -> Path:
    """The folder of the state the tracker file names: `release`, or `iter_0000100` for iteration 100 (as
    Megatron-LM names them), and nothing else: the tracker cannot point outside the checkpoint, nor can the
    state folder be a link that leads out of it."""
    folder = Path(folder)
    tracker = folder / TRACKER_FILE
    iteration = read_bytes(tracker, MAX_TRACKER_BYTES, folder).decode(errors="replace").strip()
    if iteration == RELEASE:
        state = folder / RELEASE
    elif iteration.isdigit() and iteration.isascii():
        state = folder / f"iter_{int(iteration):07d}"
    else:
        raise CheckpointError(f"{tracker} holds {iteration[:40]!r}: an iteration number or {RELEASE!r} was expected")
    if not state.is_dir():
        raise CheckpointError(f"{tracker} names {state.name}, which is not a folder of {folder}")
    return confined(state, folder, folder=True)


def check_stored_tensors(sharded_state_dict: dict, metadata, where: Path, dtypes: str | None = None) -> None:
    """The tensors of `sharded_state_dict` against what a checkpoint's metadata (`safe_pickle.check_folder`)
    says it stores: every key there, with the same global shape; with `dtypes` (what the model's dtypes
    come from, for the message), with the same dtype too."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def sharded_tensors(values):
        for value in values:
            if isinstance(value, ShardedTensorFactory):
                yield from sharded_tensors(nested_values(value.build()))
            elif isinstance(value, ShardedTensor):
                yield value

    for tensor in sharded_tensors(nested_values(sharded_state_dict)):
        stored = metadata.state_dict_metadata.get(tensor.key)
        if not isinstance(stored, TensorStorageMetadata):
            raise CheckpointError(f"{where} has no tensor {tensor.key}: it is not a checkpoint of this model")
        if tuple(stored.size) != tuple(tensor.global_shape):
            raise CheckpointError(f"{where}: tensor {tensor.key} has shape {list(stored.size)}, the model expects "
                                  f"{list(tensor.global_shape)}")
        if dtypes is not None and stored.properties.dtype != tensor.data.dtype:
            raise CheckpointError(f"{where}: tensor {tensor.key} is stored as {stored.properties.dtype}, the model "
                                  f"({dtypes}) has {tensor.data.dtype}")


def load(model: torch.nn.Module, folder: str | Path) -> None:
    """Collective: fill `model` (this rank's shards) from a checkpoint written by `save` at any TP."""
    from megatron.core import dist_checkpointing

    read_metadata(folder)
    state = state_folder(folder)
    sharded_state_dict = {"model": model.sharded_state_dict()}
    stored = safe_pickle.check_folder(state)
    check_stored_tensors(sharded_state_dict, stored, state / safe_pickle.METADATA_FILE)
    with original_errors():  # the streaming strategy checks each item it reads against its chunk
        loaded = dist_checkpointing.load(sharded_state_dict, str(state),
                                         sharded_strategy=streaming_load_strategy(stored))
    model.load_state_dict(loaded["model"], strict=True)


def checked_state(folder: str | Path):
    """The torch_dist metadata of the state a checkpoint's tracker names, every pickle of that folder read
    safely first (`safe_pickle.check_folder`)."""
    return safe_pickle.check_folder(state_folder(folder))


def stream_weights(model: torch.nn.Module, folder: str | Path, group_bytes: int = 256 * 2**20, stored=None,
                   ) -> Iterator[tuple[str, torch.Tensor | RowBlocks]]:
    """Collective: `(name, this rank's tensor)` for every tensor of `model` (built on the meta device:
    `provider.provide_skeleton()`) read from a checkpoint written by `save` at any TP / EP size; a
    tensor stored in pieces of whole rows (a SwiGLU fc1's [gate; up] halves) comes as `RowBlocks` of
    those pieces, not copied together.

    Reads consecutive tensors in groups of at most `group_bytes` (a larger tensor alone), so memory stays
    near one group. Each tensor carries its parameter's parallel attributes, so it can stand in for the
    model in `engine.export_hf_weights`; names are the whole model's (`engine.checkpoint_name_of`). Every rank
    must iterate to the end (the reads are collective).
    The checkpoint is checked when this is called, before the first tensor is asked for (`stored`: what
    `checked_state` returned for it, when the caller has checked it already).
    """
    metadata = read_metadata(folder)
    state = state_folder(folder)
    stored = stored if stored is not None else safe_pickle.check_folder(state)
    sharded_state_dict = model.sharded_state_dict()
    check_stored_tensors(sharded_state_dict, stored, state / safe_pickle.METADATA_FILE,
                         dtypes=f"{METADATA_FILE}'s dtype {metadata.get('dtype')}")
    params, checkpoint_name = state_dict_tensors(model), checkpoint_name_of(model)
    groups: list[list[str]] = [[]]
    size = 0
    for name, param in params.items():
        nbytes = param.numel() * param.element_size()
        if groups[-1] and size + nbytes > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return ((checkpoint_name(name), with_layout_of(tensor, params[name]))
            for name, tensor in load_groups(sharded_state_dict, params, groups, str(state), stored))
