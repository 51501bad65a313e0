"""Megatron checkpoints in `torch_dist` format (megatron.core.dist_checkpointing), Megatron-LM layout.

    MEGATRON_DIR/
      latest_checkpointed_iteration.txt   "release"
      release/                            dist_checkpointing files: {"model": ..., "iteration": 0, ...}
      hf/                                 config.json and tokenizer files of the source checkpoint
      modelzoo.json                       architecture, dtype, TP size it was written at

torch_dist stores each tensor with its global shape and this rank's slice, so a checkpoint written
at one TP size loads at any other. Saving is atomic: everything goes into a staging folder that is
renamed into place once every rank has finished.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from conversion.safetensors_io import CheckpointError, create_staging_folder, publish_staging_folder

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
HF_SUBDIR = "hf"
METADATA_FILE = "modelzoo.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast(value):
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(model: torch.nn.Module, folder: str | Path, metadata: dict, hf_files: list[Path] = ()) -> None:
    """Collective: write `model` (every rank its shard) plus metadata and HF side files, atomically."""
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    staging = None
    error = None
    if _rank() == 0:
        try:
            staging = create_staging_folder(folder)
        except CheckpointError as failure:
            error = str(failure)
    staging, error = _broadcast((staging, error))
    if error:
        raise CheckpointError(error)
    try:
        state = {"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 0}
        if _rank() == 0:
            (staging / RELEASE).mkdir()
        _barrier()
        dist_checkpointing.save(state, str(staging / RELEASE))
        _barrier()
        if _rank() == 0:
            (staging / TRACKER_FILE).write_text(RELEASE)
            (staging / HF_SUBDIR).mkdir()
            for file in hf_files:
                shutil.copy2(file, staging / HF_SUBDIR / file.name)
            (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
            publish_staging_folder(staging, folder)
        _barrier()
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def read_metadata(folder: str | Path) -> dict:
    folder = Path(folder)
    path = folder / METADATA_FILE
    if not (folder / TRACKER_FILE).exists() or not path.exists():
        raise CheckpointError(f"{folder} is not a modelzoo Megatron checkpoint (no {TRACKER_FILE} or {METADATA_FILE})")
    return json.loads(path.read_text())


def load(model: torch.nn.Module, folder: str | Path) -> None:
    """Collective: fill `model` (this rank's shards) from a checkpoint written by `save` at any TP."""
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    read_metadata(folder)
    iteration = (folder / TRACKER_FILE).read_text().strip()
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(folder / iteration))
    model.load_state_dict(state["model"], strict=True)
