"""LoRA training checkpoints in torch_dist: adapters, optimizer state, step and RNG; the frozen base is not saved.

    FOLDER/
      lora.json   architecture, base checkpoint folder, params dtype, LoRA config, TP and world size, step
      state/      megatron.core.dist_checkpointing: adapters and the optimizer's per-parameter tensors as
                  ShardedTensors split like their parameters (they reshard across TP sizes); the step and the
                  optimizer's scalars and hyper-parameters as common state; each rank's RNG states

Resuming (`resume_training`) restores everything, so training continues bit for bit; it needs the world size the
checkpoint was written at (RNG states are per rank). `load_adapter_checkpoint` restores the adapters alone, at any
TP size. Optimizers: any torch optimizer whose per-parameter tensors have the parameter's shape (Adam, AdamW, SGD).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from modelzoo.conversion import safe_pickle, validation
from modelzoo.conversion.errors import CheckpointError
from modelzoo.conversion.files import confined, read_json
from modelzoo.conversion.megatron_ckpt import check_stored_tensors, rank, save_sharded_state
from modelzoo.conversion.safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointReader
from modelzoo.conversion.torch_dist_streaming import original_errors, streaming_load_strategy
from modelzoo import runtime
from modelzoo.lora.export import NAMINGS, lora_config, save_adapter
from modelzoo.lora.layers import LoRAConfig, adapter_parameters, apply_lora, lora_layers, sharded_like

METADATA_FILE = "lora.json"
STATE_DIR = "state"
PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _adapter_state(model: torch.nn.Module) -> dict:
    state = {}
    for name, layer in lora_layers(model):
        state.update(layer.lora.sharded_state_dict(f"{name}.lora."))
    return state


def _rng_state():
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    states = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
              "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    return ShardedObject("rng_state", states, (_world_size(),), (rank(),), replica_id=0)


def _set_rng_state(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"])


def _group_names(model: torch.nn.Module, optimizer) -> list[list[str]]:
    """Parameter names of each optimizer group, in the optimizer's order (the order of its state indices)."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]


def _optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    """Per-parameter tensors as ShardedTensors keyed by parameter name; scalars and hyper-parameters as common."""
    torch_state = optimizer.state_dict()
    params = dict(model.named_parameters())
    group_names = _group_names(model, optimizer)
    sharded, scalars, layout = {}, {}, {}
    for index, name in enumerate(name for names in group_names for name in names):
        for key, value in torch_state["state"].get(index, {}).items():
            if torch.is_tensor(value) and value.shape == params[name].shape:
                sharded.update(sharded_like(params[name], value, f"optimizer.{name}.{key}"))
                layout.setdefault(name, []).append(key)
            else:
                scalars.setdefault(name, {})[key] = value
    groups = [{key: value for key, value in group.items() if key != "params"} for group in torch_state["param_groups"]]
    return {"sharded": sharded, "scalars": scalars, "layout": layout, "groups": groups, "group_names": group_names}


def _optimizer_template(model: torch.nn.Module, saved: dict) -> dict:
    params = dict(model.named_parameters())
    template = {}
    for name, keys in saved["layout"].items():
        for key in keys:
            template.update(sharded_like(params[name], torch.empty_like(params[name]), f"optimizer.{name}.{key}"))
    return {"sharded": template}


def _torch_optimizer_state(model: torch.nn.Module, optimizer, saved: dict) -> dict:
    """The loaded state in `optimizer.load_state_dict`'s format (state by index, groups with indices)."""
    group_names = _group_names(model, optimizer)
    if group_names != saved["group_names"]:
        raise CheckpointError("the optimizer's parameter groups differ from the checkpoint's")
    state, param_groups, index = {}, [], 0
    for group, names in zip(saved["groups"], group_names):
        param_groups.append({**group, "params": list(range(index, index + len(names)))})
        for name in names:
            tensors = {key: saved["sharded"][f"optimizer.{name}.{key}"] for key in saved["layout"].get(name, [])}
            if tensors or name in saved["scalars"]:
                state[index] = {**saved["scalars"].get(name, {}), **tensors}
            index += 1
    return {"state": state, "param_groups": param_groups}


def save_training_checkpoint(model: torch.nn.Module, provider, folder: str | Path, optimizer=None,
                             step: int = 0) -> None:
    """Collective: write adapters, optimizer state, `step` and every rank's RNG states atomically."""
    state = {"adapter": _adapter_state(model), "rng": _rng_state(), "step": step}
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(model, optimizer)
    metadata = {
        "architecture": provider.name,
        "base": str(provider.hf_dir) if provider.hf_dir is not None else None,
        "params_dtype": str(provider.params_dtype).removeprefix("torch."),
        "lora": dataclasses.asdict(lora_config(model)),
        "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
        "world_size": _world_size(),
        "step": step,
        "optimizer": optimizer is not None,
    }

    def write_metadata(staging: Path) -> None:
        (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")

    save_sharded_state(state, folder, STATE_DIR, write_metadata)


def read_checkpoint_metadata(folder: str | Path) -> dict:
    """lora.json of a LoRA checkpoint, every field checked by type and range (the LoRA settings by `LoRAConfig`,
    see `lora_settings`)."""
    path = Path(folder) / METADATA_FILE
    if not path.exists() or not (Path(folder) / STATE_DIR).is_dir():
        raise CheckpointError(f"{folder} is not a modelzoo LoRA checkpoint (no {METADATA_FILE} or {STATE_DIR}/)")
    metadata = read_json(path, folder)
    fields = {"architecture": str, "params_dtype": str, "lora": dict, "world_size": int, "step": int, "optimizer": bool}
    wrong = [key for key, kind in fields.items() if not isinstance(metadata.get(key), kind)
             or (kind is int and isinstance(metadata[key], bool))]
    if wrong:
        raise CheckpointError(f"{path} must be a JSON object with {', '.join(wrong)} ({', '.join(fields)})")
    if metadata["params_dtype"] not in PARAMS_DTYPES:
        raise CheckpointError(f"{path}: params_dtype {metadata['params_dtype']!r:.40} is not one of "
                              f"{sorted(PARAMS_DTYPES)}")
    for key, least in (("world_size", 1), ("step", 0), ("tensor_parallel", 1)):
        value = metadata.get(key, least)
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value < 2**63:
            raise CheckpointError(f"{path}: {key} is {value!r:.40}; it must be an integer of at least {least}")
    if not isinstance(metadata.get("base"), (str, type(None))):
        raise CheckpointError(f"{path}: base must be a folder name or null")
    return metadata


def lora_settings(metadata: dict, folder: str | Path) -> LoRAConfig:
    """The `LoRAConfig` lora.json records, each value checked (`LoRAConfig`'s own checks)."""
    try:
        return LoRAConfig(**metadata["lora"])
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{Path(folder) / METADATA_FILE}: its lora settings are not a LoRAConfig "
                              f"({error})") from None


def check_adapter_rank(stored, config: LoRAConfig, where: Path) -> None:
    """The adapters the checkpoint's metadata (`stored`) describes against lora.json's rank, before adapters
    of that rank are made: A is [rank, in], B [out, rank]."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    adapters = {key: entry for key, entry in stored.state_dict_metadata.items()
                if isinstance(entry, TensorStorageMetadata) and key.endswith((".lora.A", ".lora.B"))}
    if not adapters:
        raise CheckpointError(f"{where} holds no LoRA adapter tensors")
    for key, entry in adapters.items():
        rank = entry.size[0] if key.endswith(".A") else entry.size[-1] if len(entry.size) else None
        if rank != config.rank:
            raise CheckpointError(f"{where}: adapter {key} has shape {list(entry.size)}, not of the rank "
                                  f"{config.rank} that {METADATA_FILE} records")


def _state_folder(folder: str | Path, template: dict):
    """The checkpoint's state folder (which must lie in `folder`), its pickles read safely
    (conversion/safe_pickle.py) and its tensors checked against `template` before Megatron reads it; and the
    strategy that loads it, which checks every item it reads (`streaming_load_strategy`)."""
    state = confined(Path(folder) / STATE_DIR, folder, folder=True)
    stored = safe_pickle.check_folder(state)
    check_stored_tensors(template, stored, state / safe_pickle.METADATA_FILE)
    return str(state), streaming_load_strategy(stored)


def _copy_adapters(model: torch.nn.Module, loaded: dict) -> None:
    with torch.no_grad():
        for name, param in adapter_parameters(model).items():
            param.copy_(loaded[name])


def load_adapter_checkpoint(model: torch.nn.Module, folder: str | Path) -> dict:
    """Collective: fill the model's adapters from a checkpoint written at any TP size; returns its metadata."""
    from megatron.core import dist_checkpointing

    metadata = read_checkpoint_metadata(folder)
    template = {"adapter": _adapter_state(model)}
    state_dir, strategy = _state_folder(folder, template)
    with original_errors():
        loaded = dist_checkpointing.load(template, state_dir, sharded_strategy=strategy)
    _copy_adapters(model, loaded["adapter"])
    return metadata


def resume_training(model: torch.nn.Module, folder: str | Path, optimizer=None) -> int:
    """Collective: restore adapters, optimizer state (when given) and RNG states; returns the saved step."""
    from megatron.core import dist_checkpointing

    metadata = read_checkpoint_metadata(folder)
    if metadata["world_size"] != _world_size():
        raise CheckpointError(f"{folder} holds RNG states of {metadata['world_size']} ranks; resume on as many "
                              f"(this run has {_world_size()}), or load the adapters alone")
    if optimizer is not None and not metadata["optimizer"]:
        raise CheckpointError(f"{folder} was saved without optimizer state")
    template = {"adapter": _adapter_state(model), "rng": _rng_state()}
    state_dir, strategy = _state_folder(folder, template)
    if optimizer is not None:
        saved = dist_checkpointing.load_common_state_dict(state_dir)["optimizer"]
        template["optimizer"] = _optimizer_template(model, saved)
    with original_errors():
        loaded = dist_checkpointing.load(template, state_dir, sharded_strategy=strategy)
    _copy_adapters(model, loaded["adapter"])
    if optimizer is not None:
        optimizer.load_state_dict(_torch_optimizer_state(model, optimizer, loaded["optimizer"]))
    _set_rng_state(loaded["rng"])
    return loaded["step"]


def _export_adapter_rank(rank: int, checkpoint_dir: str, out_dir: str, tp: int, base: str, params_dtype: str,
                         config: LoRAConfig, naming: str, allow_non_finite: bool = False) -> None:
    from modelzoo.registry import build_provider

    with runtime.parallel(tp=tp), validation.non_finite_allowed(allow_non_finite):
        provider = build_provider(base, params_dtype=PARAMS_DTYPES[params_dtype])
        # the rank lora.json records sizes the adapters: checked against the stored ones before any is made
        state = confined(Path(checkpoint_dir) / STATE_DIR, checkpoint_dir, folder=True)
        check_adapter_rank(safe_pickle.check_folder(state), config, state / safe_pickle.METADATA_FILE)
        model = provider.provide_skeleton()  # no base weights: only the adapters, real, are read and written
        apply_lora(model, provider, config)
        load_adapter_checkpoint(model, checkpoint_dir)
        save_adapter(model, provider, out_dir, naming)


def export_adapter(checkpoint_dir: str | Path, out_dir: str | Path, tp: int = 1,
                   base_dir: str | Path | None = None, naming: str = "transformers",
                   allow_non_finite: bool = False) -> dict:
    """`modelzoo export-adapter`: a LoRA training checkpoint -> a PEFT adapter folder, on `tp` ranks; `naming`:
    "transformers" (the HF model class's module names, what peft loads onto) or "release" (the checkpoint's).
    Adapter tensors with NaN or infinite values are refused unless `allow_non_finite`."""
    from modelzoo.registry import build_provider

    if naming not in NAMINGS:
        raise ValueError(f"adapter naming {naming!r} is not one of {NAMINGS}")
    metadata = read_checkpoint_metadata(checkpoint_dir)
    base = base_dir if base_dir is not None else metadata["base"]
    if base is None:
        raise ValueError(f"{checkpoint_dir} records no base checkpoint folder: give it (--base)")
    if Path(out_dir).exists():
        raise FileExistsError(f"output {out_dir} already exists; choose a new path or remove it")
    config = lora_settings(metadata, checkpoint_dir)
    provider = build_provider(base)
    if provider.name != metadata["architecture"]:
        raise ValueError(f"{checkpoint_dir} holds {metadata['architecture']} adapters; {base} is a "
                         f"{provider.name} model")
    provider.check_parallel_layout(tp)
    if any((Path(base) / name).exists() for name in (SINGLE_FILE, INDEX_FILE)):  # its config against its weights
        reader = CheckpointReader(base)
        try:
            tensors, elements = validation.reader_contents(reader)
            validation.check_config_fits(provider.hf_config, str(base), elements, tensors, provider.weights_per_unit)
        finally:
            reader.close()
    runtime.run(_export_adapter_rank, tp, str(checkpoint_dir), str(out_dir), tp, str(base), metadata["params_dtype"],
                config, naming, allow_non_finite)
    return {"architecture": provider.name, "step": metadata["step"], "output": str(out_dir)}
