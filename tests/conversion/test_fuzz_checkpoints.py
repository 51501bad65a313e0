"""Fuzzing `modelzoo import` with random damage to the tiny checkpoints: safetensors headers (their encoding
and their names too), tensor bytes, values and shapes, config.json values and the file itself, and files
replaced by links out of the folder.

Every run must end in exit code 0 with the right weights, or in exit code 2 with exactly one line on
stderr; never a traceback, never a leftover output or staging folder. "The right weights": what the
safetensors library (an independent reader) reads from the damaged file, in the dtype of the import,
bit for bit, read back from the written Megatron checkpoint. A damaged file that the safetensors library
reads, with the original names, shapes and kinds of dtype, values finite in the dtype of the import, integer
tables naming what exists (a hash router's experts) and an unchanged config, must be accepted: the checks may
not refuse good checkpoints either.

Seeded (`SEED`): a failure names its case, and `FUZZ_CASE=model:number` runs that case alone. Huge values are
tried in every architecture's config, its own counts (experts, loops, iterations) included: each must be
refused before a model of that size is built, or be harmless.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelzoo.conversion import engine, megatron_ckpt
from modelzoo.conversion.cli import main

TINY = Path(__file__).resolve().parents[2] / "tiny_checkpoints"
SEED = 20261205
CASES = {"llama-tiny": 240, "loopcoder-tiny": 40, "deepseek-v4-tiny": 60}

DTYPE_NAMES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "Q4",
               "", 5, None]
def nested(depth: int) -> list:
    """A list nested `depth` deep (a config value no config has)."""
    value: list | int = 1
    for _ in range(depth):
        value = [value]
    return value


SMALL_VALUES = [0, 1, 2, 3, -1, -3, 2.5, 0.5, -1e-5, "2", "", True, False, None, [], {}, [1, 2], float("nan"),
                float("inf"), nested(65), {"a": -4}, "x\n"]
HUGE_VALUES = [10**9, 2**63, -(2**63), 1e300, 10**6, 100000]
# what a whole config.json may be instead of an object, or how it may be written
NOT_CONFIGS = [b"[]", b"null", b"5", b'"config"', b"[" * 100000 + b"]" * 100000, b"\xef\xbb\xbf{}", b'{"a": "\xff"}', b""]


# --- the safetensors file ---------------------------------------------------------------------------
def read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_safetensors(path: Path, header, data: bytes, length: int | None = None) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded) if length is None else length) + encoded + data)


def tensor_names(header: dict) -> list[str]:
    return sorted(name for name in header if name != "__metadata__")


def mutate_header(rng: random.Random, path: Path) -> str:
    header, data = read_safetensors(path)
    name = rng.choice(tensor_names(header))
    entry = header[name]
    begin, end = entry["data_offsets"]
    kind = rng.choice(["dtype", "shape", "offsets", "offsets", "delete", "rename", "duplicate", "extra field",
                       "entry type", "metadata", "header type", "length", "truncate", "append", "garbage",
                       "encoding", "control characters"])
    if kind == "dtype":
        entry["dtype"] = rng.choice(DTYPE_NAMES)
    elif kind == "shape":
        shape = list(entry["shape"])
        entry["shape"] = rng.choice([
            shape[:-1] + [shape[-1] + 1], shape[:-1] + [shape[-1] - 1], shape[::-1], shape + [1], [1] + shape,
            [], [-1] + shape[1:], [str(n) for n in shape], [n + 0.5 for n in shape], [True] * len(shape), None,
            [shape[0] * 2, shape[-1] // 2] if len(shape) == 2 else shape * 2])
    elif kind == "offsets":
        step = rng.choice([1, 4, 8, 64, 4096])
        entry["data_offsets"] = rng.choice([
            [begin + step, end + step], [begin - step, end - step], [begin, end + step], [begin + step, end],
            [end, begin], [-8, end - begin - 8], [0, 2**63], [str(begin), str(end)], [begin], [begin, end, end],
            None, [begin, end + len(data)]])
    elif kind == "delete":
        del header[name]
    elif kind == "rename":
        header[name + rng.choice(["_", ".x", ""]) if rng.random() < 0.5 else rng.choice(tensor_names(header))] = header.pop(name)
    elif kind == "duplicate":
        header[name.replace("weight", "extra")] = dict(entry)
    elif kind == "extra field":
        entry[rng.choice(["offset", "dtype2", "data_offsets "])] = 1
    elif kind == "entry type":
        header[name] = rng.choice([5, "x", [], None])
    elif kind == "metadata":
        header["__metadata__"] = rng.choice([{"format": 5}, [], "x", {"format": "pt", "x": None}, {}])
    elif kind == "header type":
        header = rng.choice([[], 5, "x", None])
    elif kind == "length":
        encoded = len(json.dumps(header).encode())
        write_safetensors(path, header, data, rng.choice([encoded - 1, encoded + 1, 0, 7, 2**63, 2**64 - 1,
                                                         encoded + len(data) + 9]))
        return f"header length field: {kind}"
    elif kind == "truncate":
        raw = path.read_bytes()
        cut = rng.randrange(len(raw))
        path.write_bytes(raw[:cut])
        return f"file truncated at byte {cut}"
    elif kind == "append":
        with open(path, "ab") as file:
            file.write(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
        return "bytes appended"
    elif kind == "garbage":
        raw = bytearray(path.read_bytes())
        (length,) = struct.unpack("<Q", raw[:8])
        for _ in range(rng.randrange(1, 4)):
            raw[8 + rng.randrange(length)] = rng.choice(b'{}[]":,0123456789-.eE \x00\xff')
        path.write_bytes(bytes(raw))
        return "header bytes garbled"
    elif kind == "encoding":  # the same JSON in another encoding, or after a byte-order mark
        encoding = rng.choice(["utf-16", "utf-16-le", "utf-32", "utf-8-sig", "latin-1 name"])
        text = json.dumps(header, ensure_ascii=False)
        encoded = (text.replace(name, name + "\xe9").encode("latin-1") if encoding == "latin-1 name"
                   else text.encode(encoding))
        path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
        return f"header in {encoding}"
    elif kind == "control characters":
        header[name + rng.choice(["\n", "\r", "\x1b[2K", "\x00", "\u2028"]) + "modelzoo: error: forged"] = header.pop(name)
    write_safetensors(path, header, data)
    return f"header {kind} of {name}"


def mutate_data(rng: random.Random, path: Path) -> str:
    header, data = read_safetensors(path)
    data = bytearray(data)
    kind = rng.choice(["bytes", "non-finite", "integer table"])
    if kind == "bytes":
        positions = [rng.randrange(len(data)) for _ in range(rng.randrange(1, 9))]
        for position in positions:
            data[position] = rng.randrange(256)
        description = f"{len(positions)} data bytes changed"
    elif kind == "non-finite":
        name = rng.choice([n for n in tensor_names(header) if header[n]["dtype"] == "F32"])
        begin, end = header[name]["data_offsets"]
        element = rng.randrange((end - begin) // 4)
        value = rng.choice([float("nan"), float("inf"), -float("inf")])
        data[begin + 4 * element:begin + 4 * element + 4] = struct.pack("<f", value)
        description = f"{value} in {name}"
    else:  # an integer table (a hash router's token -> expert table): a value that may or may not name an expert
        tables = [n for n in tensor_names(header) if header[n]["dtype"] in ("I64", "I32")]
        if not tables:
            return mutate_data(rng, path)
        name = rng.choice(tables)
        begin, end = header[name]["data_offsets"]
        size = 8 if header[name]["dtype"] == "I64" else 4
        element = rng.randrange((end - begin) // size)
        value = rng.choice([-1, 0, 1, 7, 8, 9, 2**31 - 1])
        data[begin + size * element:begin + size * (element + 1)] = value.to_bytes(size, "little", signed=True)
        description = f"{value} at element {element} of {name}"
    write_safetensors(path, header, bytes(data))
    return description


def mutate_tensors(rng: random.Random, path: Path) -> str:
    """Consistent files, rewritten by the safetensors library: another dtype, shape or set of tensors."""
    tensors = load_file(path)
    name = rng.choice(sorted(tensors))
    tensor = tensors[name]
    kind = rng.choice(["dtype", "shape", "drop", "add", "overflow"])
    if kind == "overflow" and tensor.is_floating_point():  # finite as stored, not in the float32 of the import
        tensors[name] = tensor.to(torch.float64)
        tensors[name].view(-1)[rng.randrange(tensor.numel())] = rng.choice([1e300, -1e300, 3.5e38, 1e38])
        description = f"{name} as float64 with a value float32 may not hold"
    elif kind == "dtype":
        dtype = rng.choice([torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int8, torch.bool,
                            torch.float8_e4m3fn])
        tensors[name] = tensor.to(dtype)
        description = f"{name} as {dtype}"
    elif kind == "shape":
        tensors[name] = rng.choice([tensor.t().contiguous() if tensor.dim() == 2 else tensor[None],
                                    tensor[:-1].contiguous() if tensor.shape[0] > 1 else tensor.repeat(2, *[1] * (tensor.dim() - 1)),
                                    tensor.reshape(-1), tensor[..., None]])
        description = f"{name} reshaped to {list(tensors[name].shape)}"
    elif kind == "drop":
        del tensors[name]
        description = f"{name} dropped"
    else:
        tensors[name + ".extra"] = tensor.clone()
        description = f"{name}.extra added"
    save_file(tensors, path, metadata={"format": "pt"})
    return description


def mutate_config(rng: random.Random, path: Path) -> str:
    config = json.loads(path.read_text())
    if rng.random() < 0.05:
        path.write_bytes(rng.choice(NOT_CONFIGS))
        return "config.json not a JSON object"
    key = rng.choice(sorted(config) + ["head_dim", "num_key_value_heads", "rope_theta"])
    if rng.random() < 0.1:
        config.pop(key, None)
        description = f"config {key} removed"
    elif isinstance(config.get(key), dict) and config[key] and rng.random() < 0.5:  # a value inside (compress_rates)
        inner = rng.choice(sorted(config[key]))
        config[key][inner] = rng.choice(SMALL_VALUES + HUGE_VALUES)
        description = f"config {key}[{inner!r}] = {config[key][inner]!r}"
    else:
        value = rng.choice(SMALL_VALUES + HUGE_VALUES)
        config[key] = value
        description = f"config {key} = {value!r}"
    path.write_text(json.dumps(config))
    return description


def lead_out(rng: random.Random, folder: Path) -> str:
    """A file of the checkpoint (or a tokenizer file it did not have) made a link to a file outside it."""
    name = rng.choice(["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"])
    outside = folder.parent / f"{folder.name}-elsewhere"
    if (folder / name).exists():
        shutil.move(folder / name, outside)
    else:
        outside.write_text("{}")
    (folder / name).symlink_to(outside)
    return f"{name} a link out of the folder"


# --- one case ---------------------------------------------------------------------------------------
def damage(model: str, number: int, folder: Path) -> list[str]:
    """A copy of the tiny checkpoint `model` in `folder`, with case `number`'s random damage; what was done."""
    rng = random.Random(f"{SEED}:{model}:{number}")
    folder.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(TINY / model / file, folder / file)
    # the weights file, the config, or (one case in ten) both; one in twenty-five, a file linked out of the folder
    if rng.random() < 0.04:
        return [lead_out(rng, folder)]
    file_damage, config_damage = rng.choices([(True, False), (False, True), (True, True)], weights=[68, 22, 10])[0]
    done = []
    if file_damage:
        mutate = rng.choices([mutate_header, mutate_data, mutate_tensors], weights=[60, 20, 20])[0]
        done.append(mutate(rng, folder / "model.safetensors"))
    if config_damage:
        done.append(mutate_config(rng, folder / "config.json"))
    return done


def read_back(megatron_dir: Path) -> dict[str, torch.Tensor]:
    """The HF tensors of a written Megatron checkpoint (streamed back through the export path)."""
    from modelzoo import build_provider, runtime

    with runtime.parallel():
        provider = build_provider(megatron_dir / megatron_ckpt.HF_SUBDIR)
        weights = megatron_ckpt.stream_weights(provider.provide_skeleton(), megatron_dir)
        return {name: tensor.clone() for name, tensor in engine.export_hf_weights(weights, provider.mapping())}


# floating-point dtypes a weight may be stored in without a scale (an FP8 weight without one is refused)
PLAIN_FLOATS = {torch.float32, torch.float16, torch.bfloat16, torch.float64}


def must_be_accepted(model: str, folder: Path, oracle: dict[str, torch.Tensor] | None) -> bool:
    """Nothing in it is wrong: the safetensors library reads it, names and shapes are the original's, its
    floating-point tensors are in a plain float dtype and finite in the float32 of the import, its hash
    router's tables name experts that exist, its files are its own, and the config is unchanged."""
    if (oracle is None or any(path.is_symlink() for path in folder.iterdir())
            or (folder / "config.json").read_bytes() != (TINY / model / "config.json").read_bytes()):
        return False
    original = load_file(TINY / model / "model.safetensors")
    experts = json.loads((folder / "config.json").read_text()).get("n_routed_experts")
    return oracle.keys() == original.keys() and all(
        oracle[name].shape == tensor.shape and oracle[name].is_floating_point() == tensor.is_floating_point()
        and (not tensor.is_floating_point()
             or oracle[name].dtype in PLAIN_FLOATS and bool(torch.isfinite(oracle[name].float()).all()))
        and (not name.endswith("tid2eid") or bool(((oracle[name] >= 0) & (oracle[name] < experts)).all()))
        for name, tensor in original.items())


def run_case(model: str, number: int, workdir: Path, capsys) -> tuple[int | None, str | None]:
    """One case: its exit code, and None when it ended as it must, else what went wrong."""
    folder, out = workdir / f"{model}-{number}", workdir / f"{model}-{number}-out"
    done = damage(model, number, folder)
    what = f"{model}:{number} ({'; '.join(done)})"
    try:
        code = main(["import", str(folder), str(out)])
    except BaseException as error:  # noqa: BLE001 - a traceback is the failure being looked for
        return None, f"{what}: {type(error).__name__}: {error}"
    err = capsys.readouterr().err
    try:
        oracle = None if (folder / "model.safetensors").is_symlink() else load_file(folder / "model.safetensors")
    except Exception:  # noqa: BLE001 - the safetensors library refuses it
        oracle = None
    leftovers = sorted(p.name for p in workdir.iterdir() if p.name.startswith(f".{out.name}.partial"))
    if leftovers:
        return code, f"{what}: staging folders left: {leftovers}"
    if code == 2:
        lines = err.split("\r")[-1].strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith("modelzoo: error: "):
            return code, f"{what}: exit 2 with stderr {err!r}"
        if out.exists():
            return code, f"{what}: exit 2 but {out} was written"
        if must_be_accepted(model, folder, oracle):
            return code, f"{what}: a good checkpoint was refused: {lines[0]}"
        return code, None
    if code != 0:
        return code, f"{what}: exit code {code}, stderr {err!r}"
    if oracle is None:
        return code, f"{what}: imported a file the safetensors library refuses"
    written = read_back(out)
    shutil.rmtree(out)
    if written.keys() != oracle.keys():
        return code, f"{what}: imported tensors {sorted(written.keys() ^ oracle.keys())} differ from the file's"
    wrong = [name for name, tensor in written.items()
             if tensor.shape != oracle[name].shape or not torch.equal(tensor, oracle[name].to(tensor.dtype))
             or tensor.is_floating_point() != oracle[name].is_floating_point()]
    return code, f"{what}: wrong weights written for {wrong[:3]}" if wrong else None


def selected_cases(model: str) -> list[int]:
    only = os.environ.get("FUZZ_CASE")
    if only:
        name, number = only.rsplit(":", 1)
        return [int(number)] if name == model else []
    return list(range(CASES[model]))


@pytest.mark.parametrize("model", list(CASES))
def test_random_damage_ends_in_one_line_or_the_right_weights(tmp_path, capsys, model):
    failures, codes = [], []
    for number in selected_cases(model):
        code, failure = run_case(model, number, tmp_path, capsys)
        codes.append(code)
        if failure is not None:
            failures.append(failure)
        shutil.rmtree(tmp_path / f"{model}-{number}")
        (tmp_path / f"{model}-{number}-elsewhere").unlink(missing_ok=True)
    assert not failures, "\n".join(failures)
    # both endings are exercised: damage that leaves a good checkpoint (other finite values, another float
    # dtype, a config change that fits) is imported, most damage is refused
    assert os.environ.get("FUZZ_CASE") or (codes.count(0) >= max(1, len(codes) // 20) and codes.count(2) >= len(codes) // 2)
