"""Untrusted checkpoints and careless inputs: nothing in a checkpoint runs, nothing wrong is written, and every
bad input ends with one line on stderr, exit code 2 and no output (nor staging folder) left behind.

Crafted pickles create a marker file when unpickled; each is first shown to do so through torch's or
Megatron's own reader (so the test would fail if modelzoo let that reader see it first), then refused.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelzoo.conversion import megatron_ckpt, safe_pickle
from modelzoo.conversion.cli import main
from modelzoo.conversion.safetensors_io import CheckpointReader

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tiny_checkpoints"
LLAMA = TINY / "llama-tiny"


class RunsCode:
    """Unpickled, it creates `marker` (a stand-in for any code an attacker would run)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    """The one line on stderr (after a progress bar, which erases itself with a carriage return)."""
    lines = err.split("\r")[-1].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("modelzoo: error: "), err
    return lines[0]


def assert_refused(capsys, argv, message: str, folder: Path, expected_names: list[str]) -> str:
    """`argv` ends with exit code 2, one line matching `message`, and `folder` holding only `expected_names`."""
    code, _, err = run_cli(capsys, *argv)
    line = one_error_line(err)
    assert code == 2 and re.search(message, line), line
    assert sorted(p.name for p in folder.iterdir()) == sorted(expected_names), "no output or staging folder may remain"
    return line


# --- Megatron checkpoints: fixtures ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """llama-tiny imported at TP 1 and TP 2, and loopcoder-tiny at TP 1 (another model's checkpoint)."""
    folder = tmp_path_factory.mktemp("imported")
    for name, source, tp in (("llama-tp1", LLAMA, 1), ("llama-tp2", LLAMA, 2), ("loopcoder", TINY / "loopcoder-tiny", 1)):
        assert main(["import", str(source), str(folder / name), "--tp", str(tp)]) == 0
    return folder


@pytest.fixture
def checkpoint(tmp_path, imported):
    """A fresh copy of the TP-1 llama checkpoint to tamper with (in tmp_path/ckpt)."""
    shutil.copytree(imported / "llama-tp1", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def write_metadata(state: Path, metadata) -> None:
    (state / safe_pickle.METADATA_FILE).write_bytes(pickle.dumps(metadata))


def replace_byte_item(state: Path, fqn_prefix: str, payload: bytes) -> None:
    """Make the byte item `fqn_prefix*` of a torch_dist folder hold `payload` (appended to its file)."""
    metadata = safe_pickle.read_metadata(state / safe_pickle.METADATA_FILE)
    [info] = [info for index, info in metadata.storage_data.items() if index.fqn.startswith(fqn_prefix)]
    file = state / info.relative_path
    info.offset, info.length = file.stat().st_size, len(payload)
    with open(file, "ab") as handle:
        handle.write(payload)
    write_metadata(state, metadata)


def torch_saved(value) -> bytes:
    buffer = __import__("io").BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


# --- crafted pickles ------------------------------------------------------------------------------------
def test_clean_checkpoints_written_at_tp1_and_tp2_pass_and_need_only_the_listed_classes(imported):
    for name in ("llama-tp1", "llama-tp2", "loopcoder"):
        metadata = safe_pickle.check_folder(imported / name / "release")
        assert "common_state/shard_0_1" in metadata.state_dict_metadata


def test_a_crafted_metadata_pickle_runs_nothing(capsys, tmp_path, checkpoint):
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "marker"
    write_metadata(checkpoint / "release", RunsCode(marker))
    with pytest.raises(Exception):
        FileSystemReader(str(checkpoint / "release")).read_metadata()  # torch's reader: a plain pickle.load
    assert marker.exists(), "the crafted file runs code through torch's own reader"
    marker.unlink()
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"],
                   r"release/\.metadata needs posix\.system, which a checkpoint may not contain", tmp_path, ["ckpt"])
    assert not marker.exists()


def test_a_correct_checkpoint_with_a_payload_in_its_metadata_is_refused(capsys, tmp_path, checkpoint):
    """Everything else right, so the conversion would succeed: the payload must not ride along unnoticed."""
    marker = tmp_path / "marker"
    state = checkpoint / "release"
    metadata = safe_pickle.read_metadata(state / safe_pickle.METADATA_FILE)
    metadata.planner_data = {"note": RunsCode(marker)}
    write_metadata(state, metadata)
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"], r"needs posix\.system", tmp_path, ["ckpt"])
    assert not marker.exists()


def test_a_dotted_name_cannot_reach_past_an_allowed_class(tmp_path, checkpoint):
    """Protocol 4 resolves `module` + `a.b.c` by attribute access: only exact allowed names are resolved."""
    def text(value: str) -> bytes:
        return b"\x8c" + bytes([len(value)]) + value.encode()

    path = tmp_path / "dotted.metadata"
    path.write_bytes(b"\x80\x04" + text("torch.distributed.checkpoint.metadata")
                     + text("Metadata.__init__.__globals__") + b"\x93.")  # STACK_GLOBAL, STOP
    assert isinstance(pickle.loads(path.read_bytes()), dict), "a plain unpickler hands out the module's globals"
    with pytest.raises(safe_pickle.UnsafeCheckpointError, match=r"Metadata\.__init__\.__globals__"):
        safe_pickle.read_metadata(path)


@pytest.mark.parametrize("where", ["common_state item", "legacy common.pt"])
def test_a_crafted_common_state_runs_nothing(capsys, tmp_path, checkpoint, where):
    from megatron.core import dist_checkpointing

    marker = tmp_path / "marker"
    state = checkpoint / "release"
    if where == "common_state item":
        replace_byte_item(state, "common_state", torch_saved(RunsCode(marker)))
        with pytest.raises(Exception):
            dist_checkpointing.load_common_state_dict(str(state))  # Megatron: torch.load(weights_only=False)
        assert marker.exists(), "the crafted item runs code through Megatron's own reader"
        marker.unlink()
        message = r"__0_0\.distcp: item common_state/shard_0_1 needs posix\.system"
    else:
        (state / "common.pt").write_bytes(torch_saved(RunsCode(marker)))
        message = r"release/common\.pt needs posix\.system"
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"], message, tmp_path, ["ckpt"])
    assert not marker.exists()


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    from modelzoo import build_provider, runtime
    from modelzoo.lora import LoRAConfig, adapter_parameters, apply_lora, save_training_checkpoint

    folder = tmp_path_factory.mktemp("lora") / "checkpoint"
    with runtime.parallel():
        provider = build_provider(LLAMA)
        model = provider.provide()
        apply_lora(model, provider, LoRAConfig(rank=2, alpha=4.0))
        optimizer = torch.optim.AdamW(adapter_parameters(model).values(), lr=1e-3)
        (-provider.token_logprobs(model, torch.randint(0, 256, (1, 8))).mean()).backward()
        optimizer.step()
        save_training_checkpoint(model, provider, folder, optimizer, step=1)
    return folder


@pytest.mark.parametrize("crafted", ["clean (control)", ".metadata", "rng_state item"])
def test_lora_checkpoints_load_and_a_crafted_one_runs_nothing(capsys, tmp_path, lora_checkpoint, crafted):
    checkpoint = tmp_path / "lora"
    shutil.copytree(lora_checkpoint, checkpoint)
    marker, state = tmp_path / "marker", checkpoint / "state"
    if crafted == ".metadata":
        write_metadata(state, RunsCode(marker))
    elif crafted == "rng_state item":
        replace_byte_item(state, "rng_state", torch_saved(RunsCode(marker)))
    argv = ["export-adapter", checkpoint, tmp_path / "adapter"]
    if crafted.startswith("clean"):
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
        return
    assert_refused(capsys, argv, r"needs posix\.system", tmp_path, ["lora"])
    assert not marker.exists()

    from modelzoo import build_provider, runtime
    from modelzoo.lora import LoRAConfig, apply_lora, resume_training

    with runtime.parallel():  # the library's resume path too
        provider = build_provider(LLAMA)
        model = provider.provide()
        apply_lora(model, provider, LoRAConfig(rank=2, alpha=4.0))
        with pytest.raises(safe_pickle.UnsafeCheckpointError, match=r"posix\.system"):
            resume_training(model, checkpoint)
    assert not marker.exists()


# --- damaged Megatron checkpoints ------------------------------------------------------------------------
def truncate_distcp(folder: Path) -> None:
    data = (folder / "release" / "__0_0.distcp").read_bytes()
    (folder / "release" / "__0_0.distcp").write_bytes(data[: len(data) * 2 // 3])


def item_outside_the_folder(folder: Path) -> None:
    state = folder / "release"
    metadata = safe_pickle.read_metadata(state / safe_pickle.METADATA_FILE)
    next(iter(metadata.storage_data.values())).relative_path = "../modelzoo.json"
    write_metadata(state, metadata)


def modelzoo_json(**changes):
    def edit(folder: Path) -> None:
        path = folder / megatron_ckpt.METADATA_FILE
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return edit


DAMAGED = {
    "truncated .distcp": (truncate_distcp, r"release/__0_0\.distcp is truncated: item .* spans bytes"),
    "missing .metadata": (lambda f: (f / "release" / ".metadata").unlink(), r"release/\.metadata does not exist"),
    "garbage .metadata": (lambda f: (f / "release" / ".metadata").write_bytes(b"\x80\x04garbage" * 9),
                          r"release/\.metadata is not torch_dist metadata"),
    "empty .metadata": (lambda f: (f / "release" / ".metadata").write_bytes(b""),
                        r"release/\.metadata is not torch_dist metadata"),
    "item outside the folder": (item_outside_the_folder, r"is in '\.\./modelzoo\.json', not a file of"),
    "garbage metadata.json": (lambda f: (f / "release" / "metadata.json").write_text("{oops"),
                              r"release/metadata\.json is not a JSON object"),
    "garbage modelzoo.json": (lambda f: (f / "modelzoo.json").write_text("[1, 2"), r"modelzoo\.json is not JSON"),
    "modelzoo.json without a dtype": (modelzoo_json(dtype=None), r"modelzoo\.json must name the architecture and a dtype"),
    "modelzoo.json's dtype against the data": (modelzoo_json(dtype="bfloat16"),
                                              r"tensor embedding\.word_embeddings\.weight is stored as torch\.float32, "
                                              r"the model \(modelzoo\.json's dtype bfloat16\) has torch\.bfloat16"),
    "tracker holding ../": (lambda f: (f / "latest_checkpointed_iteration.txt").write_text("../other"),
                            r"latest_checkpointed_iteration\.txt holds '\.\./other': an iteration number or 'release'"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_megatron_checkpoint_gets_one_line(capsys, tmp_path, checkpoint, case):
    damage, message = DAMAGED[case]
    damage(checkpoint)
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"], message, tmp_path, ["ckpt"])


def test_another_models_metadata_gets_one_line(capsys, tmp_path, checkpoint, imported):
    shutil.copy(imported / "loopcoder" / "release" / ".metadata", checkpoint / "release" / ".metadata")
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"], r"release/(\.metadata|__0_0\.distcp)",
                   tmp_path, ["ckpt"])


def test_a_bfloat16_import_exports_a_config_that_says_bfloat16(capsys, tmp_path):
    assert run_cli(capsys, "import", LLAMA, tmp_path / "megatron", "--dtype", "bfloat16")[0] == 0
    assert run_cli(capsys, "export", tmp_path / "megatron", tmp_path / "hf")[0] == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert {tensor.dtype for tensor in exported.values()} == {torch.bfloat16}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert {k: v for k, v in config.items() if k != "torch_dtype"} == {
        k: v for k, v in json.loads((LLAMA / "config.json").read_text()).items() if k != "torch_dtype"}
    original = load_file(LLAMA / "model.safetensors")
    assert all(torch.equal(exported[name], tensor.to(torch.bfloat16)) for name, tensor in original.items())


# --- safetensors headers and index ----------------------------------------------------------------------
def rewrite_header(path: Path, edit) -> None:
    """Edit the JSON header of a safetensors file in place (the data section kept as it is)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


def hf_copy(tmp_path: Path, source: Path = LLAMA) -> Path:
    shutil.copytree(source, tmp_path / "hf")
    return tmp_path / "hf"


EMBED = "model.embed_tokens.weight"


def negative_start(header):
    begin, end = header[EMBED]["data_offsets"]
    header[EMBED]["data_offsets"] = [-64, end - begin - 64]


def overlapping(header):
    begin = header[EMBED]["data_offsets"][0]  # the norm's bytes said to be the first of the embedding's
    header["model.norm.weight"]["data_offsets"] = [begin, begin + 4 * header["model.norm.weight"]["shape"][0]]


def as_integers(header):
    header[EMBED]["dtype"] = "I32"  # same size as F32: only the kind of dtype is wrong


def as_bytes(header):
    header[EMBED]["dtype"] = "I8"
    header[EMBED]["shape"] = [header[EMBED]["shape"][0], header[EMBED]["shape"][1] * 4]


def wrong_size(header):
    header[EMBED]["shape"] = [header[EMBED]["shape"][0] - 1, header[EMBED]["shape"][1]]


HEADERS = {
    "negative start offset": (negative_start, r"tensor model\.embed_tokens\.weight: its data_offsets \[-64, \d+\] are not a byte range"),
    "overlapping tensors": (overlapping, r"tensors .* and .* overlap"),
    "I32 for a float weight": (as_integers, r"tensor model\.embed_tokens\.weight is stored as torch\.int32, the model expects a floating-point tensor"),
    "I8 for a float weight": (as_bytes, r"tensor model\.embed_tokens\.weight is stored as torch\.int8"),
    "size not shape x dtype": (wrong_size, r"tensor model\.embed_tokens\.weight has 65536 bytes, its shape \[255, 64\] and dtype F32 need 65280"),
    "bytes of no tensor": (lambda h: h.pop("model.norm.weight"), r"bytes \d+ to \d+ of its data section belong to no tensor"),
    "offset as a string": (lambda h: h[EMBED].update(data_offsets=["0", "8"]), r"its data_offsets \['0', '8'\] are not two byte offsets"),
    "no shape": (lambda h: h[EMBED].pop("shape"), r"its entry must have a dtype, a shape and data_offsets"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_bad_safetensors_header_is_refused_naming_the_tensor(capsys, tmp_path, case):
    edit, message = HEADERS[case]
    folder = hf_copy(tmp_path)
    rewrite_header(folder / "model.safetensors", edit)
    assert_refused(capsys, ["import", folder, tmp_path / "out"], message, tmp_path, ["hf"])


def test_a_name_given_twice_in_a_header_is_refused(tmp_path):
    folder = hf_copy(tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + length].decode().rstrip()
    entry = json.dumps({EMBED: json.loads(header)[EMBED]})[1:-1]
    raw = ("{" + entry + "," + header[1:]).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])
    with pytest.raises(ValueError, match=r"its header names model\.embed_tokens\.weight twice"):
        CheckpointReader(folder)


def sharded(tmp_path: Path) -> Path:
    """llama-tiny as two shards and an index."""
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(LLAMA / "config.json", folder)
    tensors = load_file(LLAMA / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for number, part in enumerate((names[:5], names[5:])):
        file = f"model-0000{number + 1}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors", "link/x"])
def test_index_entries_outside_the_folder_are_refused(capsys, tmp_path, shard):
    folder = sharded(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(folder / "model-00001-of-00002.safetensors", tmp_path / "outside.safetensors")
    shutil.copy(folder / "model-00001-of-00002.safetensors", tmp_path / "elsewhere" / "x")
    (folder / "link").symlink_to(tmp_path / "elsewhere")  # a folder inside that leads outside
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: shard if file.startswith("model-00001") else file for name, file in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(capsys, ["import", folder, tmp_path / "out"], rf"lists '{re.escape(shard)}', which is not a file of",
                   tmp_path, ["sharded", "outside.safetensors", "elsewhere"])


def test_an_hf_cache_snapshot_of_links_to_blobs_imports(capsys, tmp_path):
    """The Hub's cache: snapshots/<rev>/<file> is a link to blobs/<hash>; the links lead outside the folder."""
    folder = sharded(tmp_path)
    blobs, snapshot = tmp_path / "cache" / "blobs", tmp_path / "cache" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted(folder.iterdir())):
        shutil.copy(file, blobs / f"blob{number}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{number}")
    code, _, err = run_cli(capsys, "import", snapshot, tmp_path / "out")
    assert code == 0, err
    assert run_cli(capsys, "export", tmp_path / "out", tmp_path / "back")[0] == 0
    original, back = load_file(LLAMA / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == original.keys() and all(torch.equal(back[n], t) for n, t in original.items())


# --- weights and config values --------------------------------------------------------------------------
def with_weights(tmp_path: Path, **values) -> Path:
    folder = hf_copy(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    for position, (name, value) in enumerate(values.items()):
        tensors[name.replace("__", ".")].view(-1)[7 + position] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


NAN_TENSOR = "model__layers__1__mlp__down_proj__weight"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("command", ["import", "logprobs-megatron", "logprobs-hf", "parity"])
def test_non_finite_weights_are_refused_naming_the_tensor(capsys, tmp_path, value, command):
    folder = with_weights(tmp_path, **{NAN_TENSOR: value})
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3, 4]]")
    argv = {"import": ["import", folder, tmp_path / "out"],
            "logprobs-megatron": ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out"],
            "logprobs-hf": ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out", "--backend", "hf"],
            "parity": ["parity", folder, "--seq-len", 8]}[command]
    assert_refused(capsys, argv, rf"model\.safetensors: tensor model\.layers\.1\.mlp\.down_proj\.weight holds {value} "
                   r"at element 7: .*--allow-non-finite", tmp_path, ["hf", "tokens.json"])


def test_a_rank_failing_mid_write_leaves_no_staging_folder(capsys, tmp_path):
    """At TP 2, rank 1 meets a NaN in its half of lm_head (the last tensor written) while rank 0 holds the
    staging folder: the run stops both, and the staging folder of the rank it killed goes too."""
    folder = hf_copy(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"][-1, -1] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert_refused(capsys, ["import", folder, tmp_path / "out", "--tp", 2],
                   r"tensor lm_head\.weight holds nan at element 16383", tmp_path, ["hf"])


def test_non_finite_weights_load_when_allowed_and_logprobs_stay_strict_json(capsys, tmp_path):
    folder = with_weights(tmp_path, **{NAN_TENSOR: float("nan")})
    code, _, err = run_cli(capsys, "import", folder, tmp_path / "megatron", "--allow-non-finite")
    assert code == 0, err
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3, 4]]")
    # the NaN reaches every log-prob after the first layer: an error, not `NaN` in the JSON
    assert_refused(capsys, ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out.json", "--allow-non-finite"],
                   r"sequence 0 of .*tokens\.json: the log-probability at position 0 is nan; nothing was written",
                   tmp_path, ["hf", "megatron", "tokens.json"])


def config_edit(**changes):
    return lambda config: config.update(changes)


CONFIGS = {
    "negative rms_norm_eps": ({"rms_norm_eps": -1e-5}, r"rms_norm_eps is -1e-05; it must be above 0"),
    "zero layers": ({"num_hidden_layers": 0}, r"num_hidden_layers is 0; it must be at least 1"),
    "negative layers": ({"num_hidden_layers": -2}, r"num_hidden_layers is -2; it must be at least 1"),
    "zero heads": ({"num_attention_heads": 0}, r"num_attention_heads is 0; it must be at least 1"),
    "negative kv heads": ({"num_key_value_heads": -2}, r"num_key_value_heads is -2; it must be at least 1"),
    "fractional hidden size": ({"hidden_size": 64.5}, r"hidden_size is 64\.5; it must be int"),
    "layers as a string": ({"num_hidden_layers": "2"}, r"num_hidden_layers is '2'; it must be int"),
    "layers as a boolean": ({"num_hidden_layers": True}, r"num_hidden_layers is True; it must be int"),
    "NaN rope_theta": ({"rope_theta": float("nan")}, r"rope_theta is nan; only finite numbers are allowed"),
    "negative rope_theta": ({"rope_theta": -10000.0}, r"rope_theta is -10000\.0; it must be above 0"),
    "rope_theta as a string": ({"rope_theta": "2"}, r"rope_theta is '2'; it must be (a number|float \| int)"),
    "a RoPE factor as a string": ({"rope_scaling": {"rope_type": "default", "factor": "4"}},
                                  r"rope_scaling\.factor is '4'; it must be a number"),
    "a boolean as a string": ({"tie_word_embeddings": "no"}, r"tie_word_embeddings is 'no'; it must be bool"),
    "more than 64 bits": ({"vocab_size": 2**64}, r"vocab_size is 18446744073709551616, more than a 64-bit integer holds"),
    "heads not a multiple of kv heads": ({"num_key_value_heads": 3},
                                         r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
@pytest.mark.parametrize("model", ["llama-tiny", "loopcoder-tiny", "deepseek-v4-tiny"])
def test_invalid_config_values_are_refused_naming_the_field_and_file(capsys, tmp_path, case, model):
    changes, message = CONFIGS[case]
    folder = hf_copy(tmp_path, TINY / model)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    assert_refused(capsys, ["import", folder, tmp_path / "out"], rf"hf/config\.json: {message}", tmp_path, ["hf"])


# --- the config against its checkpoint, before anything is built -----------------------------------------
OVERSIZED = {
    # 64k hidden x 256k intermediate x 2 layers + a 1M vocabulary: ~230 GB in float32
    "tens of GB": (dict(hidden_size=65536, intermediate_size=262144, vocab_size=1 << 20, head_dim=16384),
                   r"hf: its config\.json claims vocab_size 1048576, more than the 119104 weights of the checkpoint"),
    "a million layers": (dict(num_hidden_layers=10**6), r"hf: its config\.json claims 1000000 layers \(num_hidden_layers\), "
                         r"its weights hold 21 tensors in all"),
    "other shapes": (dict(intermediate_size=320), r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \[160, 64\], "
                     r"the model expects \[320, 64\]"),
}


@pytest.mark.parametrize("case", list(OVERSIZED))
@pytest.mark.parametrize("command", ["parity", "logprobs-megatron", "logprobs-hf"])
def test_a_config_that_does_not_fit_its_checkpoint_is_refused_before_a_model_is_built(capsys, tmp_path, monkeypatch,
                                                                                       command, case):
    from modelzoo import parity
    from modelzoo.provider import ModelProvider

    def never(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(ModelProvider, "provide", never)
    monkeypatch.setattr(parity, "load_hf_model", never)
    changes, message = OVERSIZED[case]
    folder = hf_copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3]]")
    argv = {"parity": ["parity", folder],
            "logprobs-megatron": ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out"],
            "logprobs-hf": ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out", "--backend", "hf"]}[command]
    assert_refused(capsys, argv, message, tmp_path, ["hf", "tokens.json"])


# --- arguments and token files --------------------------------------------------------------------------
ARGUMENTS = {
    "--tp 0": (["import", LLAMA, "OUT", "--tp", "0"], r"--tp 0: it must be at least 1"),
    "--ep 0": (["import", LLAMA, "OUT", "--ep", "0"], r"--ep 0: it must be at least 1"),
    "export --tp -1": (["export", "MISSING", "OUT", "--tp", "-1"], r"--tp -1: it must be at least 1"),
    "parity --seq-len 0": (["parity", LLAMA, "--seq-len", "0"], r"--seq-len 0: it must be at least 2"),
    "parity --batch 0": (["parity", LLAMA, "--batch", "0"], r"--batch 0: it must be at least 1"),
    "--max-shard-bytes 0": (["export", "MISSING", "OUT", "--max-shard-bytes", "0"], r"--max-shard-bytes 0"),
    "--tolerance nan": (["parity", LLAMA, "--tolerance", "nan"], r"--tolerance nan: it must be a finite number >= 0"),
}


@pytest.mark.parametrize("case", list(ARGUMENTS))
def test_out_of_range_arguments_get_one_line(capsys, tmp_path, case):
    argv, message = ARGUMENTS[case]
    argv = [tmp_path / "out" if a == "OUT" else tmp_path / "missing" if a == "MISSING" else a for a in argv]
    assert_refused(capsys, argv, message, tmp_path, [])


@pytest.mark.parametrize("tokens", ["[[1, true, 3]]", "[[1, 2.0, 3]]", "[[1, -1]]", "[[1, 256]]", "[[1]]", "{}"])
def test_bad_token_files_get_one_line(capsys, tmp_path, tokens):
    (tmp_path / "tokens.json").write_text(tokens)
    assert_refused(capsys, ["logprobs", LLAMA, "--tokens", tmp_path / "tokens.json", "--out", tmp_path / "out.json"],
                   r"token file .*tokens\.json", tmp_path, ["tokens.json"])


# --- outputs --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out", ["existing file", "existing folder", "missing folder"])
def test_logprobs_output_is_never_overwritten_nor_left_half_written(capsys, tmp_path, out):
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3]]")
    target = {"existing file": tmp_path / "out.json", "existing folder": tmp_path / "folder",
              "missing folder": tmp_path / "nowhere" / "out.json"}[out]
    if out == "existing file":
        target.write_text("mine")
    elif out == "existing folder":
        target.mkdir()
    expected = sorted(p.name for p in tmp_path.iterdir())
    message = r"output .* already exists" if out.startswith("existing") else r"its folder .*nowhere does not exist"
    assert_refused(capsys, ["logprobs", LLAMA, "--tokens", tokens, "--out", target], message, tmp_path, expected)
    if out == "existing file":
        assert target.read_text() == "mine"


def test_logprobs_writes_strict_json(capsys, tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3, 4]]")
    assert run_cli(capsys, "logprobs", LLAMA, "--tokens", tokens, "--out", tmp_path / "out.json")[0] == 0

    def refuse(constant):
        raise ValueError(constant)

    values = json.loads((tmp_path / "out.json").read_text(), parse_constant=refuse)["logprobs"]
    assert len(values[0]) == 3 and all(v < 0 for v in values[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "tokens.json"]


FULL_DISK = """
import errno, os, sys
from modelzoo.conversion import cli, torch_dist_streaming

class FillingFile:
    # the .distcp file, on a disk that is full after a few writes
    def __init__(self, file):
        self.file, self.writes = file, 0

    def write(self, data):
        self.writes += 1
        if self.writes > int(sys.argv[1]):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

real_init = torch_dist_streaming.CopyingStream.__init__
torch_dist_streaming.CopyingStream.__init__ = lambda self, file, copier: real_init(self, FillingFile(file), copier)
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("writes", [3, 40], ids=["in a byte item", "in a tensor"])
def test_a_full_disk_during_import_gets_one_line_and_exit_2(tmp_path, writes):
    """In a process of its own: the exit code is the process's (an error inside torch's writer once left
    objects that crashed CPython 3.12.1's garbage collector at exit: 139 after the right message)."""
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(writes), "import", str(LLAMA), str(tmp_path / "out")],
                          capture_output=True, cwd=ROOT, timeout=300)  # bytes: text mode turns \r into \n
    line = one_error_line(done.stderr.decode())
    assert done.returncode == 2, done.stderr.decode()[-2000:]
    assert re.fullmatch(r"modelzoo: error: no space left on device writing .*/out; nothing was written", line), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, number, words", [("import", errno.EROFS, "read-only file system"),
                                                     ("export", errno.EROFS, "read-only file system"),
                                                     ("export", errno.ENOSPC, "no space left on device")])
def test_a_read_only_output_or_a_full_disk_gets_one_line(capsys, tmp_path, monkeypatch, imported, command, number, words):
    """The folder cannot be made (read-only) or a write fails part way (a full disk): what the system said,
    naming the output, not a traceback."""
    import gc

    def fail(*args, **kwargs):
        raise OSError(number, os.strerror(number))

    where = "tempfile.mkdtemp" if number == errno.EROFS else "modelzoo.conversion.safetensors_io.RegionCopier.write"
    monkeypatch.setattr(where, fail)
    argv = ["import", LLAMA, tmp_path / "out"] if command == "import" else ["export", imported / "llama-tp1", tmp_path / "out"]
    assert_refused(capsys, argv, rf"{words} writing .*/out; nothing was written", tmp_path, [])
    gc.collect()  # what the failed write left is collectable


def test_what_dead_runs_staged_is_removed_and_nothing_else(capsys, tmp_path):
    from modelzoo.conversion.staging import remove_stale_staging, staging_prefix

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has ended
    ours = staging_prefix(tmp_path / "out.json")  # this host, this (living) process
    host = ours.split(".partial-")[1].rsplit("-", 2)[0]
    staged = {"dead file": tmp_path / f".out.json.partial-{host}-{dead_pid}-abc",
              "dead folder": tmp_path / f".out.json.partial-{host}-{dead_pid}-def",
              "living": tmp_path / f"{ours}ghi", "other host": tmp_path / f".out.json.partial-elsewhere-{dead_pid}-jkl",
              "other output": tmp_path / f".other.partial-{host}-{dead_pid}-mno"}
    for name, path in staged.items():
        path.mkdir() if "folder" in name else path.write_text("half")
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3]]")
    assert run_cli(capsys, "logprobs", LLAMA, "--tokens", tokens, "--out", tmp_path / "out.json")[0] == 0
    assert {name for name, path in staged.items() if path.exists()} == {"living", "other host", "other output"}
    assert remove_stale_staging(tmp_path / "out.json") == []


# --- files outside the checkpoint, and files that are not files ------------------------------------------
def lead_out(path: Path, outside: Path) -> None:
    """Make `path` a link to a file (or folder) of the same content outside its folder, at `outside`."""
    if path.exists():
        shutil.move(path, outside)
    else:
        outside.write_text('{"secret": "the content of a file elsewhere"}')
    path.symlink_to(outside)


def iteration_folder_leading_out(checkpoint: Path, outside: Path) -> None:
    """The tracker names iteration 1, whose folder is a link to a copy of the state outside the checkpoint."""
    shutil.move(checkpoint / "release", outside)
    (checkpoint / megatron_ckpt.TRACKER_FILE).write_text("1")
    (checkpoint / "iter_0000001").symlink_to(outside)


LEADING_OUT = {  # command -> files of its input folder made links out of it
    "import": ["tokenizer.json", "config.json", "model.safetensors"],
    "logprobs-hf": ["generation_config.json"],
    "export": ["hf", "hf/tokenizer.json", "hf/config.json", "modelzoo.json", "latest_checkpointed_iteration.txt", "release",
               "release/__0_0.distcp", "release/.metadata", "release/metadata.json", "iter_0000001"],
    "export-adapter": ["lora.json", "state", "state/.metadata"],
}


@pytest.mark.parametrize("command, name", [(c, n) for c, names in LEADING_OUT.items() for n in names])
def test_a_file_leading_out_of_its_checkpoint_is_refused(capsys, tmp_path, imported, lora_checkpoint, command, name):
    """Whoever hands over a checkpoint and gets the output back could read any file of the user's: a link
    out of the folder (a symlinked tokenizer, state folder, iteration folder) is refused, naming it."""
    source = {"import": LLAMA, "logprobs-hf": LLAMA, "export": imported / "llama-tp1",
              "export-adapter": lora_checkpoint}[command]
    folder = tmp_path / "in"
    shutil.copytree(source, folder)
    outside = tmp_path / "elsewhere"
    if name == "iter_0000001":
        iteration_folder_leading_out(folder, outside)
    else:
        lead_out(folder / name, outside)
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3]]")
    argv = {"import": ["import", folder, tmp_path / "out"], "export": ["export", folder, tmp_path / "out"],
            "logprobs-hf": ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out", "--backend", "hf"],
            "export-adapter": ["export-adapter", folder, tmp_path / "out"]}[command]
    root = re.escape(str(folder / Path(name).parent))
    assert_refused(capsys, argv, rf"in/{re.escape(name)} leads outside {root} \(to {re.escape(str(outside.resolve()))}\): "
                   r"a checkpoint's files must lie in its folder", tmp_path, ["in", "elsewhere", "tokens.json"])


NOT_FILES = {  # what is made, where, and the command that reads it
    "config.json a FIFO": ("fifo", "hf/config.json", "import"),
    "tokenizer.json a FIFO": ("fifo", "hf/tokenizer.json", "import"),
    "tokenizer.json a socket": ("socket", "hf/tokenizer.json", "import"),
    "model.safetensors a FIFO": ("fifo", "hf/model.safetensors", "import"),
    "tracker a FIFO": ("fifo", "megatron/latest_checkpointed_iteration.txt", "export"),
    "modelzoo.json a FIFO": ("fifo", "megatron/modelzoo.json", "export"),
    "hf/config.json a FIFO": ("fifo", "megatron/hf/config.json", "export"),
    "token file a FIFO": ("fifo", "tokens.json", "logprobs"),
    "token file /dev/zero": ("/dev/zero", "tokens.json", "logprobs"),
}


@pytest.mark.parametrize("case", list(NOT_FILES))
def test_fifos_sockets_and_devices_are_refused_before_opening(tmp_path, monkeypatch, imported, case):
    """In a process of its own, with a time limit: opening a FIFO for reading blocks until a writer comes (never),
    and /dev/zero never ends."""
    kind, name, command = NOT_FILES[case]
    shutil.copytree(LLAMA, tmp_path / "hf")
    shutil.copytree(imported / "llama-tp1", tmp_path / "megatron")
    path = tmp_path / name
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        import socket

        monkeypatch.chdir(path.parent)  # a socket's path is limited to ~100 characters: bound relative to here
        server = socket.socket(socket.AF_UNIX)
        server.bind(path.name)
    else:
        path.symlink_to(kind)
    argv = {"import": ["import", tmp_path / "hf", tmp_path / "out"],
            "export": ["export", tmp_path / "megatron", tmp_path / "out"],
            "logprobs": ["logprobs", tmp_path / "hf", "--tokens", tmp_path / "tokens.json", "--out", tmp_path / "out"]}
    done = subprocess.run([sys.executable, "-m", "modelzoo.conversion.cli", *map(str, argv[command])], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    line = one_error_line(done.stderr)
    what = {"fifo": "a FIFO", "socket": "a socket", "/dev/zero": "a character device"}[kind]
    assert done.returncode == 2 and re.search(rf"{re.escape(name)} is {what}, not a regular file: refused", line), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("file, size, limit", [("latest_checkpointed_iteration.txt", 65, 64),
                                                ("modelzoo.json", 64 * 2**20 + 1, 64 * 2**20),
                                                ("release/.metadata", 2**30 + 1, 2**30)])
def test_a_file_longer_than_it_can_be_is_read_no_further(capsys, tmp_path, checkpoint, file, size, limit):
    path = checkpoint / file
    with open(path, "r+b") as handle:  # sparse: no disk space taken
        handle.truncate(size)
    assert_refused(capsys, ["export", checkpoint, tmp_path / "out"],
                   rf"ckpt/{re.escape(file)} holds more than {limit} bytes", tmp_path, ["ckpt"])


def test_a_byte_item_larger_than_an_object_of_a_checkpoint_is_not_read(capsys, tmp_path, checkpoint):
    state = checkpoint / "release"
    metadata = safe_pickle.read_metadata(state / safe_pickle.METADATA_FILE)
    info = next(info for index, info in metadata.storage_data.items() if index.fqn.startswith("common_state"))
    with open(state / info.relative_path, "r+b") as handle:  # sparse: 300 MiB of zeros after the file
        info.offset, info.length = handle.seek(0, os.SEEK_END), 300 * 2**20
        handle.truncate(info.offset + info.length)
    write_metadata(state, metadata)
    assert_refused(capsys, ["export", checkpoint, tmp_path / "out"],
                   r"item common_state/shard_0_1 holds 314572800 bytes, more than the 268435456 an object of a "
                   r"checkpoint may", tmp_path, ["ckpt"])


# --- values that the model's dtype cannot hold, and values written -----------------------------------------
FINITE_AS_STORED = {  # (stored dtype, value, the model's dtype)
    "1e300 in F64, imported in float32": (torch.float64, 1e300, "float32", "inf in float32"),
    "3.4e38 in F32, imported in bfloat16": (torch.float32, 3.4e38, "bfloat16", "inf in bfloat16"),
    "-3.4e38 in F32, imported in bfloat16": (torch.float32, -3.4e38, "bfloat16", "-inf in bfloat16"),
}


@pytest.mark.parametrize("command", ["import", "logprobs-hf"])
@pytest.mark.parametrize("case", list(FINITE_AS_STORED))
def test_a_weight_finite_as_stored_but_not_in_the_models_dtype_is_refused(capsys, tmp_path, case, command):
    stored, value, dtype, becomes = FINITE_AS_STORED[case]
    folder = hf_copy(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = NAN_TENSOR.replace("__", ".")
    tensors[name] = tensors[name].to(stored)
    tensors[name].view(-1)[7] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3, 4]]")
    argv = {"import": ["import", folder, tmp_path / "out"],
            "logprobs-hf": ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out", "--backend", "hf"]}
    assert_refused(capsys, [*argv[command], "--dtype", dtype],
                   rf"model\.safetensors: tensor {re.escape(name)} holds {re.escape(repr(float(tensors[name].view(-1)[7])))} "
                   rf"at element 7, which is {becomes}, the model's dtype: .*--allow-non-finite",
                   tmp_path, ["hf", "tokens.json"])
    if command == "import":  # allowed, it loads
        assert run_cli(capsys, *argv[command], "--dtype", dtype, "--allow-non-finite")[0] == 0


def stored_tensor_data(state: Path, key: str) -> tuple[Path, int, int]:
    """(file, offset, bytes) of the data of the first chunk of tensor `key` in a torch_dist folder."""
    metadata = safe_pickle.read_metadata(state / safe_pickle.METADATA_FILE)
    _, info = min(((index, info) for index, info in metadata.storage_data.items() if index.fqn == key),
                  key=lambda pair: tuple(pair[0].offset))
    file = state / info.relative_path
    with open(file, "rb") as handle:
        handle.seek(info.offset)
        layout = torch.load(io.BytesIO(handle.read(info.length)), map_location="meta", weights_only=True)
    return file, info.offset + layout.untyped_storage()._checkpoint_offset, layout.untyped_storage().nbytes()


def overwrite_stored(state: Path, key: str, element: int, value: torch.Tensor) -> None:
    """Element `element` of the first chunk of stored tensor `key` set to `value` (a one-element tensor of its dtype)."""
    file, offset, _ = stored_tensor_data(state, key)
    raw = value.reshape(1).view(torch.uint8).numpy().tobytes()
    with open(file, "r+b") as handle:
        handle.seek(offset + element * len(raw))
        handle.write(raw)


def test_export_refuses_a_stored_nan_unless_allowed(capsys, tmp_path, checkpoint):
    overwrite_stored(checkpoint / "release", "decoder.layers.mlp.linear_fc2.weight", 7, torch.tensor(float("nan")))
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"],
                   r"tensor model\.layers\.0\.mlp\.down_proj\.weight holds nan at element 7: weights with NaN or "
                   r"infinite values are not written \(--allow-non-finite writes them\)", tmp_path, ["ckpt"])
    assert run_cli(capsys, "export", checkpoint, tmp_path / "hf", "--allow-non-finite")[0] == 0
    assert load_file(tmp_path / "hf" / "model.safetensors")["model.layers.0.mlp.down_proj.weight"].view(-1)[7].isnan()


def lora_copy(tmp_path: Path, lora_checkpoint: Path, **lora_changes) -> Path:
    checkpoint = tmp_path / "lora"
    shutil.copytree(lora_checkpoint, checkpoint)
    if lora_changes:
        path = checkpoint / "lora.json"
        metadata = json.loads(path.read_text())
        path.write_text(json.dumps({**metadata, "lora": {**metadata["lora"], **lora_changes}}))
    return checkpoint


LORA_ADAPTER = "decoder.layers.0.mlp.linear_fc2.lora.A"


def test_export_adapter_refuses_non_finite_adapters_unless_allowed(capsys, tmp_path, lora_checkpoint):
    checkpoint = lora_copy(tmp_path, lora_checkpoint)
    overwrite_stored(checkpoint / "state", LORA_ADAPTER, 3, torch.tensor(float("inf")))
    assert_refused(capsys, ["export-adapter", checkpoint, tmp_path / "adapter"],
                   r"tensor base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_A\.weight holds inf at element "
                   r"3: .*not written \(--allow-non-finite writes them\)", tmp_path, ["lora"])
    assert run_cli(capsys, "export-adapter", checkpoint, tmp_path / "adapter", "--allow-non-finite")[0] == 0


def refuse_constant(constant):
    raise ValueError(f"{constant} is not JSON")


LORA_SETTINGS = {  # lora.json's lora settings -> the reason given
    "alpha NaN": ({"alpha": float("nan")}, r"LoRA alpha must be a finite number, got nan"),
    "alpha Infinity": ({"alpha": float("inf")}, r"LoRA alpha must be a finite number, got inf"),
    "alpha a string": ({"alpha": "16"}, r"LoRA alpha must be a finite number, got '16'"),
    "rank a string": ({"rank": "2"}, r"LoRA rank must be an integer >= 1, got '2'"),
    "rank true": ({"rank": True}, r"LoRA rank must be an integer >= 1, got True"),
    "rank 2**40": ({"rank": 2**40}, r"adapter .*lora\.[AB] has shape \[\d+, \d+\], not of the rank 1099511627776 "
                                    r"that lora\.json records"),
    "dropout 2": ({"dropout": 2}, r"LoRA dropout must be a number in \[0, 1\), got 2"),
    "dropout NaN": ({"dropout": float("nan")}, r"LoRA dropout must be a number in \[0, 1\), got nan"),
    "targets a number": ({"targets": 5}, r"LoRA targets must be a name or a list of names, got 5"),
    "seed negative": ({"seed": -1}, r"LoRA seed must be an integer in \[0, 2\*\*63\), got -1"),
}


@pytest.mark.parametrize("case", list(LORA_SETTINGS))
def test_lora_settings_are_checked_before_anything_is_made_of_them(capsys, tmp_path, monkeypatch, lora_checkpoint,
                                                                   case):
    from modelzoo.lora import layers

    def never(*args, **kwargs):
        raise AssertionError("an adapter was made")

    monkeypatch.setattr(layers.LoRAAdapter, "__init__", never)
    changes, message = LORA_SETTINGS[case]
    checkpoint = lora_copy(tmp_path, lora_checkpoint, **changes)
    assert_refused(capsys, ["export-adapter", checkpoint, tmp_path / "adapter"], message, tmp_path, ["lora"])


def test_an_exported_adapter_config_is_strict_json(capsys, tmp_path, lora_checkpoint):
    assert run_cli(capsys, "export-adapter", lora_checkpoint, tmp_path / "adapter")[0] == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text(), parse_constant=refuse_constant)
    assert (config["r"], config["lora_alpha"]) == (2, 4.0)


LORA_JSON = {  # lora.json's own fields
    "step negative": ({"step": -1}, r"lora\.json: step is -1; it must be an integer of at least 0"),
    "world size true": ({"world_size": True}, r"lora\.json must be a JSON object with world_size"),
    "tensor parallel 0": ({"tensor_parallel": 0}, r"lora\.json: tensor_parallel is 0; it must be an integer of at least 1"),
    "base a number": ({"base": 5}, r"lora\.json: base must be a folder name or null"),
    "a list": ([], r"lora\.json must hold a JSON object, not a list"),
}


@pytest.mark.parametrize("case", list(LORA_JSON))
def test_lora_json_values_are_checked_by_type_and_range(capsys, tmp_path, lora_checkpoint, case):
    changes, message = LORA_JSON[case]
    checkpoint = lora_copy(tmp_path, lora_checkpoint)
    path = checkpoint / "lora.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes} if isinstance(changes, dict) else changes))
    assert_refused(capsys, ["export-adapter", checkpoint, tmp_path / "adapter"], message, tmp_path, ["lora"])


def test_an_adapter_of_another_shape_than_its_metadata_says_gets_one_line(capsys, tmp_path, lora_checkpoint):
    """The item's tensor is not the chunk the metadata describes (an AssertionError of torch's reader, before)."""
    checkpoint = lora_copy(tmp_path, lora_checkpoint)
    state = checkpoint / "state"
    metadata = safe_pickle.read_metadata(state / safe_pickle.METADATA_FILE)
    index, info = next((index, info) for index, info in metadata.storage_data.items() if index.fqn == LORA_ADAPTER)
    payload = torch_saved(torch.zeros(3, 160))  # A is [2, 160]
    with open(state / info.relative_path, "ab") as handle:
        info.offset, info.length = handle.tell(), len(payload)
        handle.write(payload)
    write_metadata(state, metadata)
    assert_refused(capsys, ["export-adapter", checkpoint, tmp_path / "adapter"],
                   rf"the item of {re.escape(LORA_ADAPTER)} holds torch\.float32 \[3, 160\], its chunk in the metadata "
                   r"is \[2, 160\]", tmp_path, ["lora"])


V4 = TINY / "deepseek-v4-tiny"
TID2EID = "model.layers.0.ffn.gate.tid2eid"


@pytest.mark.parametrize("expert", [-1, 8])
@pytest.mark.parametrize("command", ["import", "logprobs-hf"])
def test_a_hash_routing_table_naming_an_expert_that_does_not_exist_is_refused(capsys, tmp_path, command, expert):
    """-1 is "no expert" to Megatron's dispatcher, 8 of 8 is out of range: either would route tokens wrong."""
    folder = hf_copy(tmp_path, V4)
    tensors = load_file(folder / "model.safetensors")
    tensors[TID2EID].view(-1)[5] = expert
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3, 4]]")
    argv = {"import": ["import", folder, tmp_path / "out"],
            "logprobs-hf": ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out", "--backend", "hf"]}
    assert_refused(capsys, argv[command], rf"model\.safetensors: tensor {re.escape(TID2EID)} holds {expert} at element "
                   r"5: its values name routed experts, which lie in \[0, 8\)", tmp_path, ["hf", "tokens.json"])


def test_export_refuses_a_stored_hash_routing_table_naming_an_expert_that_does_not_exist(capsys, tmp_path):
    assert run_cli(capsys, "import", V4, tmp_path / "megatron")[0] == 0
    overwrite_stored(tmp_path / "megatron" / "release", "decoder.layers.0.mlp.router.tid2eid", 5, torch.tensor(8))
    assert_refused(capsys, ["export", tmp_path / "megatron", tmp_path / "hf"],
                   rf"tensor {re.escape(TID2EID)} holds 8 at element 5: its values name routed experts, which lie in "
                   r"\[0, 8\)", tmp_path, ["megatron"])


# --- config values that size or loop: checked before a model is built --------------------------------------
V4_CONFIGS = {
    "sliding_window 0": ({"sliding_window": 0}, r"sliding_window is 0; it must be at least 1"),
    "negative compress rate": ({"compress_rates": {"compressed_sparse_attention": -4, "heavily_compressed_attention": 16}},
                               r"compress_rates\['compressed_sparse_attention'\] is -4; it must be at least 1"),
    "compress rate as text": ({"compress_rates": {"compressed_sparse_attention": "4", "heavily_compressed_attention": 16}},
                              r"compress_rates\['compressed_sparse_attention'\] is '4'; it must be a number"),
    "fractional compress rate": ({"compress_rates": {"compressed_sparse_attention": 4.5,
                                                     "heavily_compressed_attention": 16}},
                                 r"compress_rates\['compressed_sparse_attention'\] is 4\.5; it must be an integer"),
    "no rate for a compressed layer type": ({"compress_rates": {"compressed_sparse_attention": 4}},
                                            r"compress_rates without a rate for \['heavily_compressed_attention'\]"),
    "a rate longer than the positions": ({"compress_rates": {"compressed_sparse_attention": 4,
                                                             "heavily_compressed_attention": 10**9}},
                                         r"compress_rates\['heavily_compressed_attention'\]=1000000000 \(more than the "
                                         r"128 positions"),
    "a negative YaRN rotation": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": -32,
                                                      "original_max_position_embeddings": 32}},
                                 r"rope_parameters\.beta_fast is -32; it must be above 0"),
    "negative partial_rotary_factor": ({"partial_rotary_factor": -0.25}, r"partial_rotary_factor is -0\.25; it must be "
                                       r"above 0"),
    "partial_rotary_factor above 1": ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor is 1\.5; it must be at "
                                      r"most 1"),
    "10**9 Sinkhorn iterations": ({"hc_sinkhorn_iters": 10**9}, r"hc_sinkhorn_iters is 1000000000; it must be at most "
                                  r"1000"),
    "no output groups": ({"o_groups": 0}, r"o_groups is 0; it must be at least 1"),
    "negative routed scaling": ({"routed_scaling_factor": -1.5}, r"routed_scaling_factor is -1\.5; it must be above 0"),
    "more experts per token than experts": ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 \(more than the 8 "
                                            r"routed experts\)"),
    "a window longer than the positions": ({"sliding_window": 10**12}, r"sliding_window=1000000000000 \(more than the "
                                           r"128 positions"),
    "10**9 experts": ({"n_routed_experts": 10**9}, r"claims n_routed_experts 1000000000, each with at least hidden_size "
                      r"x moe_intermediate_size = 2048 weights: more than the \d+ weights of the checkpoint"),
    "10**6 hyper-connection streams": ({"hc_mult": 10**6}, r"claims hc_mult 1000000, each with at least hidden_size"),
    "10**5 MTP layers": ({"num_nextn_predict_layers": 10**5}, r"claims num_nextn_predict_layers 100000"),
}


@pytest.mark.parametrize("case", list(V4_CONFIGS))
def test_deepseek_v4_config_values_are_checked_before_a_model_is_built(capsys, tmp_path, monkeypatch, case):
    from modelzoo.provider import ModelProvider

    def never(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(ModelProvider, "provide", never)
    monkeypatch.setattr(ModelProvider, "provide_skeleton", never)
    changes, message = V4_CONFIGS[case]
    folder = hf_copy(tmp_path, V4)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3, 4]]")
    assert_refused(capsys, ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out"], message, tmp_path,
                   ["hf", "tokens.json"])


def hf_side_config(checkpoint: Path, **changes) -> None:
    path = checkpoint / megatron_ckpt.HF_SUBDIR / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


MEGATRON_CONFIGS = {
    "100000 layers": (lambda c: hf_side_config(c, num_hidden_layers=100000),
                      r"ckpt: its config\.json claims num_hidden_layers 100000, each with at least hidden_size = 64 "
                      r"weights: more than the 119104 weights of the checkpoint"),
    "a vocabulary of 10**9": (lambda c: hf_side_config(c, vocab_size=10**9),
                              r"ckpt: its config\.json claims vocab_size 1000000000, more than the 119104 weights"),
    "a TransformerConfig field among the model options": (
        modelzoo_json(model_options={"num_layers": 100000}),
        r"modelzoo\.json: model option 'num_layers' is not one a llama checkpoint records"),
    "model options a list": (modelzoo_json(model_options=[]), r"modelzoo\.json: model_options must be a JSON object"),
    "written at TP '2'": (modelzoo_json(written_at_tp="2"), r"modelzoo\.json: written_at_tp is \"2\"; it must be an "
                          r"integer of at least 1"),
}


@pytest.mark.parametrize("case", list(MEGATRON_CONFIGS))
def test_an_export_checks_what_its_checkpoint_says_before_a_model_is_built(capsys, tmp_path, monkeypatch, checkpoint,
                                                                           case):
    from modelzoo.provider import ModelProvider

    def never(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(ModelProvider, "provide_skeleton", never)
    damage, message = MEGATRON_CONFIGS[case]
    damage(checkpoint)
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"], message, tmp_path, ["ckpt"])


def test_an_adapter_base_whose_config_does_not_fit_its_weights_is_refused(capsys, tmp_path, monkeypatch,
                                                                           lora_checkpoint):
    """A base of 10**9 words: its embedding would be 262 GB, and export-adapter does not even need it."""
    from modelzoo.provider import ModelProvider

    def never(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(ModelProvider, "provide", never)
    base = hf_copy(tmp_path)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "vocab_size": 10**9}))
    assert_refused(capsys, ["export-adapter", lora_checkpoint, tmp_path / "adapter", "--base", base],
                   r"hf: its config\.json claims vocab_size 1000000000, more than the 119104 weights", tmp_path, ["hf"])


def test_export_adapter_builds_no_base_weights(capsys, tmp_path, monkeypatch, lora_checkpoint):
    from modelzoo.provider import ModelProvider

    def never(*args, **kwargs):
        raise AssertionError("the base model was built with its weights")

    monkeypatch.setattr(ModelProvider, "provide", never)
    assert run_cli(capsys, "export-adapter", lora_checkpoint, tmp_path / "adapter")[0] == 0


# --- torch_dist metadata and items -------------------------------------------------------------------------
def chunked(state: Path, key: str, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Tensor `key`'s metadata entry given `chunks` (offsets, sizes), each with a place in the first file
    (its first bytes: a chunk's bytes are not read before its place is checked)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    metadata = safe_pickle.read_metadata(state / safe_pickle.METADATA_FILE)
    entry = metadata.state_dict_metadata[key]
    entry.chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in chunks]
    for offsets, sizes in chunks:  # a chunk at the offsets of one stored keeps its item
        length = max(1, math.prod(sizes)) * entry.properties.dtype.itemsize
        metadata.storage_data.setdefault(MetadataIndex(key, torch.Size(offsets)), _StorageInfo("__0_0.distcp", 0, length))
    write_metadata(state, metadata)


EMBEDDING = "embedding.word_embeddings.weight"  # [256, 64]


def test_thirty_thousand_zero_size_chunks_are_checked_in_linear_time(capsys, tmp_path, checkpoint):
    """Each pair of chunks compared, this took minutes; empty chunks hold nothing, and overlap nothing."""
    chunks = [((0, 0), (256, 64))] + [((n % 256, 0), (0, 64)) for n in range(30000)]
    chunked(checkpoint / "release", EMBEDDING, chunks)
    started = time.monotonic()
    code, _, err = run_cli(capsys, "export", checkpoint, tmp_path / "hf")
    assert time.monotonic() - started < 120
    assert code == 0 or (code == 2 and one_error_line(err)), err


def test_overlapping_chunks_among_sixteen_thousand_are_found_in_linear_time(capsys, tmp_path, checkpoint):
    """A chunk per element but the first, and one given twice, last: comparing each pair, that is found after
    most of 134 million comparisons."""
    chunks = [((row, column), (1, 1)) for row in range(256) for column in range(64)][1:]
    chunked(checkpoint / "release", EMBEDDING, chunks + [chunks[-2]])
    started = time.monotonic()
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"],
                   r"tensor embedding\.word_embeddings\.weight: (two of its chunks overlap|its 16384 chunks do not)",
                   tmp_path, ["ckpt"])
    assert time.monotonic() - started < 60


def test_chunks_off_a_grid_are_refused(capsys, tmp_path, checkpoint):
    """Staggered rows of every width: as many cells as chunks squared, not what torch_dist writes."""
    chunks, row = [], 0
    for width in range(1, 64):
        chunks += [((row, 0), (1, width)), ((row, width), (1, 64 - width))]
        row += 1
    chunks.append(((row, 0), (256 - row, 64)))
    chunked(checkpoint / "release", EMBEDDING, chunks)
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"],
                   r"its 127 chunks do not cut its shape \[256, 64\] into a grid", tmp_path, ["ckpt"])


def test_a_chunk_larger_than_its_item_is_refused_before_anything_is_allocated(capsys, tmp_path, lora_checkpoint):
    """lora.json's rank and the metadata's adapter shapes agree on 2**40 (half a TB per adapter): the items
    cannot hold that, which is found before any adapter is made."""
    checkpoint = lora_copy(tmp_path, lora_checkpoint, rank=2**40)
    state = checkpoint / "state"
    metadata = safe_pickle.read_metadata(state / safe_pickle.METADATA_FILE)
    for key, entry in metadata.state_dict_metadata.items():  # A [rank, in], B [out, rank]
        if key.endswith((".lora.A", ".lora.B")):
            axis = 0 if key.endswith(".A") else 1
            entry.size = torch.Size([2**40 if d == axis else n for d, n in enumerate(entry.size)])
            for chunk in entry.chunks:
                chunk.sizes = torch.Size([2**40 if d == axis else n for d, n in enumerate(chunk.sizes)])
    write_metadata(state, metadata)
    assert_refused(capsys, ["export-adapter", checkpoint, tmp_path / "adapter"],
                   r"item decoder\.layers\.\d+\..*lora\.A holds \d+ bytes, fewer than the \d+ of its chunk's elements",
                   tmp_path, ["lora"])


def with_negative_stride(payload: bytes) -> bytes:
    """A torch.save zip of a 1-D tensor with its pickled stride (1,) made (-1,) (torch.save writes none such)."""
    reader = torch._C.PyTorchFileReader(io.BytesIO(payload))
    record = reader.get_record("data.pkl")
    old, new = b"K\x01\x85", b"J\xff\xff\xff\xff\x85"  # BININT1 1, TUPLE1 -> BININT -1, TUPLE1
    assert record.count(old) == 1, record
    out = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(out)
    for name in reader.get_all_records():
        data = record.replace(old, new) if name == "data.pkl" else reader.get_record(name)
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return out.getvalue()


def test_a_stored_tensor_with_a_negative_stride_is_refused(capsys, tmp_path, checkpoint):
    """Loaded onto the meta device, such a tensor reports contiguous strides: it was read as contiguous."""
    state = checkpoint / "release"
    metadata = safe_pickle.read_metadata(state / safe_pickle.METADATA_FILE)
    index, info = next((i, info) for i, info in metadata.storage_data.items() if i.fqn == "decoder.final_layernorm.weight")
    with open(state / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        payload = with_negative_stride(handle.read(info.length))
    with open(state / info.relative_path, "ab") as handle:
        info.offset, info.length = handle.tell(), len(payload)
        handle.write(payload)
    write_metadata(state, metadata)
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"],
                   r"its tensor of sizes \[64\] has strides \[-1\] from element 0: not a layout on its storage",
                   tmp_path, ["ckpt"])


def deeply_nested_list(depth: int) -> bytes:
    """A torch.save zip of a list nested `depth` deep, written opcode by opcode (pickle itself recurses)."""
    record = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."  # EMPTY_LIST x depth, APPEND x depth-1, STOP
    template = torch._C.PyTorchFileReader(io.BytesIO(torch_saved([])))
    out = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(out)
    for name in template.get_all_records():
        data = record if name == "data.pkl" else template.get_record(name)
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return out.getvalue()


def billion_laughs() -> list:
    """30 levels of a list holding the level below 10 times: small to pickle, 10**30 items to walk."""
    level: list = []
    for _ in range(30):
        level = [level] * 10
    return level


COMMON_STATES = {
    "a string": (torch_saved("common"), r"holds str 'common': the common state must be a dict"),
    "a list of numbers": (torch_saved([1, 2]), r"holds list \[1, 2\]: the common state must be a dict"),
    "nested 200,000 deep": (deeply_nested_list(200_000), r"nests deeper than 100 levels"),
    "a billion laughs": (torch_saved([billion_laughs()]), r"holds more than 1000000 objects"),
}


@pytest.mark.parametrize("case", list(COMMON_STATES))
def test_a_common_state_that_megatron_could_not_merge_is_refused(capsys, tmp_path, checkpoint, case):
    payload, message = COMMON_STATES[case]
    replace_byte_item(checkpoint / "release", "common_state", payload)
    started = time.monotonic()
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf"], rf"item common_state/shard_0_1 {message}",
                   tmp_path, ["ckpt"])
    assert time.monotonic() - started < 120


# --- safetensors headers: as the safetensors library reads them, for both backends --------------------------
def with_header_bytes(tmp_path: Path, encode) -> Path:
    folder = hf_copy(tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    raw = encode(data[8:8 + length].decode())
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])
    return folder


HEADER_ENCODINGS = {
    "UTF-16": (lambda text: text.encode("utf-16"), r"its header is not UTF-8 \(byte 0\)"),
    "a byte-order mark": (lambda text: b"\xef\xbb\xbf" + text.encode(), r"its header starts with a byte-order mark"),
    "Latin-1 in a name": (lambda text: text.replace("model.norm.weight", "model.norm.weight\xe9").encode("latin-1"),
                          r"its header is not UTF-8"),
    "NaN in an entry": (lambda text: text.replace('"dtype":"F32"', '"dtype":NaN', 1).encode(),
                        r"its header is not JSON"),
}


@pytest.mark.parametrize("backend", ["megatron", "hf"])
@pytest.mark.parametrize("case", list(HEADER_ENCODINGS))
def test_a_header_the_safetensors_library_refuses_is_refused_by_both_backends(capsys, tmp_path, case, backend):
    encode, message = HEADER_ENCODINGS[case]
    folder = with_header_bytes(tmp_path, encode)
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3]]")
    with pytest.raises(Exception):
        load_file(folder / "model.safetensors")  # the library's verdict
    assert_refused(capsys, ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out", "--backend", backend],
                   rf"hf/model\.safetensors is not a safetensors file: {message}", tmp_path, ["hf", "tokens.json"])


def test_a_repeated_name_among_150001_is_found_in_linear_time(tmp_path):
    entries = ",".join(f'"t{n}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for n in range(150_000))
    raw = ("{" + entries + ',"t7":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}').encode()
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"its header names t7 twice"):
        CheckpointReader(folder)
    assert time.monotonic() - started < 30


# --- config and token files that are not what they must be ------------------------------------------------
NOT_JSON_OBJECTS = {
    "a list": (b"[1, 2]", r"must hold a JSON object, not a list"),
    "null": (b"null", r"must hold a JSON object, not null"),
    "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, r"nests deeper than 64 levels"),
    "nested 100 deep in an object": (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", r"nests deeper than 64 levels"),
    "not UTF-8": (b'{"model_type": "llama\xff"}', r"is not UTF-8 text \(byte 21\)"),
    "a byte-order mark": (b'\xef\xbb\xbf{"model_type": "llama"}', r"is not JSON: it starts with a byte-order mark"),
    "architectures 5": (json.dumps({"architectures": 5}).encode(), r": architectures is 5; it must be a list of strings"),
    "model_type 5": (json.dumps({"model_type": 5}).encode(), r": model_type is 5; it must be a string"),
}


@pytest.mark.parametrize("case", list(NOT_JSON_OBJECTS))
@pytest.mark.parametrize("command", ["import", "logprobs", "parity"])
def test_a_config_that_is_not_a_json_object_gets_one_line_naming_it(capsys, tmp_path, case, command):
    text, message = NOT_JSON_OBJECTS[case]
    folder = hf_copy(tmp_path)
    (folder / "config.json").write_bytes(text)
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[[1, 2, 3]]")
    argv = {"import": ["import", folder, tmp_path / "out"], "parity": ["parity", folder],
            "logprobs": ["logprobs", folder, "--tokens", tokens, "--out", tmp_path / "out"]}[command]
    assert_refused(capsys, argv, rf"hf/config\.json{message if message.startswith(':') else ' ' + message}", tmp_path,
                   ["hf", "tokens.json"])


@pytest.mark.parametrize("tokens, message", [
    (b"null", r"must hold a JSON list, not null"), (b"[" * 100_000 + b"]" * 100_000, r"nests deeper than 64 levels"),
    (b"[[1, 2, \xff]]", r"is not UTF-8 text"), (b"\xef\xbb\xbf[[1, 2]]", r"is not JSON: it starts with a byte-order mark"),
    (json.dumps([[1] * 257]).encode(), r": sequence 0 has 257 tokens, more than the 256 positions of the "
     r"model \(max_position_embeddings in .*llama-tiny/config\.json\)")])
def test_token_files_that_cannot_be_right_get_one_line_naming_the_file(capsys, tmp_path, tokens, message):
    (tmp_path / "tokens.json").write_bytes(tokens)
    assert_refused(capsys, ["logprobs", LLAMA, "--tokens", tmp_path / "tokens.json", "--out", tmp_path / "out.json"],
                   rf"token file .*tokens\.json ?{message}", tmp_path, ["tokens.json"])


def test_a_sequence_length_past_the_models_positions_gets_one_line(capsys, tmp_path):
    assert_refused(capsys, ["parity", LLAMA, "--seq-len", "257"],
                   r"--seq-len 257: more than the 256 positions of the model \(max_position_embeddings in "
                   r".*llama-tiny/config\.json\)", tmp_path, [])


# --- messages: one line, whatever a checkpoint names --------------------------------------------------------
def test_a_refused_pickle_at_tp_2_is_one_line(capsys, tmp_path, checkpoint):
    """The ranks' UnsafeCheckpointError is a CheckpointError: what it is, not its class's name, says so."""
    marker = tmp_path / "marker"
    write_metadata(checkpoint / "release", RunsCode(marker))
    assert_refused(capsys, ["export", checkpoint, tmp_path / "hf", "--tp", 2],
                   r"release/\.metadata needs posix\.system, which a checkpoint may not contain", tmp_path, ["ckpt"])
    assert not marker.exists()


@pytest.mark.parametrize("name", ["model.norm.bias\nmodelzoo: error: a second line", "model.norm.bias\r\x1b[2K",
                                  "model.norm.bias" + "x" * 5000])
def test_a_tensor_name_is_shown_on_one_line_of_bounded_length(capsys, tmp_path, name):
    folder = hf_copy(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors[name] = torch.zeros(1)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "import", folder, tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "\r" not in err and "\x1b" not in err, err
    assert err.startswith("modelzoo: error: ") and "unexpected tensors model.norm.bias" in err, err
    assert len(err) < 1100


@pytest.mark.parametrize("argv, message", [(["import", "--bogus"], r"unrecognized arguments: --bogus|required"),
                                           (["import", LLAMA, "OUT", "--tp", "two"], r"argument --tp: invalid int value"),
                                           (["fly"], r"argument command: invalid choice: 'fly'")])
def test_a_command_line_argparse_cannot_read_is_one_line(capsys, tmp_path, argv, message):
    argv = [tmp_path / "out" if a == "OUT" else a for a in argv]
    assert_refused(capsys, argv, message, tmp_path, [])


# --- signals and rank processes -------------------------------------------------------------------------
# started by every Python process of the run (the CLI and its spawned ranks): the rename that publishes a
# staging folder first announces itself (a file named after the process) and waits, so that the test can
# stop the run exactly there
SLOW_PUBLISH = '''
import os, time
_replace = os.replace

def replace(source, target, *args, **kwargs):
    if ".partial-" in os.fspath(source):
        open(os.path.join(os.environ["PUBLISH_WAIT"], f"publishing-{os.getpid()}"), "w").close()
        time.sleep(float(os.environ.get("PUBLISH_DELAY", "60")))
    return _replace(source, target, *args, **kwargs)

os.replace = replace
'''


def start_slow_import(tmp_path: Path, out: Path, tp: int, session: bool = False) -> tuple[subprocess.Popen, list[int]]:
    """`modelzoo import` in a subprocess (the leader of a process group of its own with `session`), stopped when
    about to publish; returns it and the publishing pid."""
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(SLOW_PUBLISH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), str(ROOT)]), "PUBLISH_WAIT": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-m", "modelzoo.conversion.cli", "import", str(LLAMA), str(out), "--tp", str(tp)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=session)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("publishing-*")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    return process, [int(p.name.split("-")[1]) for p in tmp_path.glob("publishing-*")]


def test_sigterm_of_a_tp2_import_unwinds_like_ctrl_c(tmp_path):
    out = tmp_path / "out"
    process, _ = start_slow_import(tmp_path, out, tp=2)
    assert list(tmp_path.glob(".out.partial-*")), "rank 0 is about to publish its staging folder"
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "modelzoo: terminated; nothing was written"
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kill test reads /proc")
def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has ended, but for its parent's wait
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_killing_the_parent_kills_its_ranks_and_the_next_run_removes_their_staging_folder(capsys, tmp_path):
    out = tmp_path / "out"
    process, [publishing_rank] = start_slow_import(tmp_path, out, tp=2)
    process.kill()  # SIGKILL: nothing of the parent runs
    process.communicate()
    deadline = time.monotonic() + 10
    while alive(publishing_rank):
        assert time.monotonic() < deadline, "a rank outlived its parent"
        time.sleep(0.1)
    [stale] = tmp_path.glob(".out.partial-*")
    assert not out.exists(), "the rank never published"
    code, _, err = run_cli(capsys, "import", LLAMA, out)
    assert code == 0, err
    assert not stale.exists() and out.is_dir()


@pytest.mark.parametrize("whom", ["the command", "its process group"])
def test_two_sigterms_50_ms_apart_leave_no_staging_folder(tmp_path, whom):
    """The second arrives while the first unwinds: it may not cut short the removal of what was staged."""
    out = tmp_path / "out"
    process, _ = start_slow_import(tmp_path, out, tp=2, session=True)
    for _ in range(2):
        os.killpg(process.pid, signal.SIGTERM) if whom == "its process group" else process.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip().splitlines()[-1] == "modelzoo: terminated; nothing was written", err[-3000:]
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


# the publish is the first SIGTERM's moment, the removal of what was staged the second's
SIGNALLED_TWICE = '''
import os, shutil, signal
_replace, _rmtree = os.replace, shutil.rmtree


def replace(source, target, *args, **kwargs):
    if ".partial-" in os.fspath(source):
        os.kill(os.getpid(), signal.SIGTERM)
    return _replace(source, target, *args, **kwargs)


def rmtree(path, *args, **kwargs):
    if ".partial-" in os.fspath(path):
        os.kill(os.getpid(), signal.SIGTERM)
    return _rmtree(path, *args, **kwargs)


os.replace, shutil.rmtree = replace, rmtree
'''


def test_a_second_sigterm_during_the_clean_up_of_the_first_does_not_cut_it_short(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SIGNALLED_TWICE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "modelzoo.conversion.cli", "import", str(LLAMA), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == "modelzoo: terminated; nothing was written"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


# in the first process of the run that imports modelzoo.conversion.engine (after the command's signal handlers are in
# place), a SIGTERM arrives and its exception is swallowed, as a library's broad `except` around an import would
SWALLOWING = '''
import importlib.abc, os, signal, sys, time


class Swallowing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "modelzoo.conversion.engine":
            try:
                os.close(os.open(os.path.join(os.environ["SWALLOWED"], "swallowed"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return None
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(2)
            except BaseException:
                pass
        return None


sys.meta_path.insert(0, Swallowing())
'''


@pytest.mark.parametrize("tp", [1, 2])
def test_a_sigterm_whose_exception_is_swallowed_still_stops_the_command(tmp_path, tp):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SWALLOWING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), str(ROOT)]), "SWALLOWED": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "modelzoo.conversion.cli", "import", str(LLAMA), str(tmp_path / "out"),
                           "--tp", str(tp)], env=env, capture_output=True, text=True, timeout=300)
    assert (tmp_path / "swallowed").exists(), "the signal came"
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == "modelzoo: terminated; nothing was written"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_a_rank_killed_from_outside_is_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    process, [publishing_rank] = start_slow_import(tmp_path, out, tp=2)
    os.kill(publishing_rank, signal.SIGKILL)  # the OOM killer's way
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert re.fullmatch(r"modelzoo: rank \d was killed by signal 9; nothing was written", err.strip().splitlines()[-1])
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))
