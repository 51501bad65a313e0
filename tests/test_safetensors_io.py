"""The lazy reader and the atomic sharded writer."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from conversion.safetensors_io import INDEX_FILE, MAP_MIN_BYTES, CheckpointError, CheckpointReader, ShardedWriter


def tensors():
    return {f"layer.{i}.weight": torch.randn(16, 8) for i in range(6)} | {"ids": torch.arange(5)}


def test_sharded_write_then_read_is_exact(tmp_path):
    source = tensors()
    with ShardedWriter(tmp_path / "out", max_shard_bytes=1200) as writer:
        for name, tensor in source.items():
            writer.add(name, tensor)
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1, "the bound should have produced several shards"
    reader = CheckpointReader(tmp_path / "out")
    assert sorted(reader.names()) == sorted(source)
    for name, tensor in source.items():
        assert reader.shape(name) == tuple(tensor.shape)
        got = reader.get(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor)


def test_read_tensors_map_the_file_and_writing_to_them_leaves_it_alone(tmp_path):
    # "a.small" first, so that the mapped tensor starts inside a page; both sizes: mapped and read
    source = {"a.small": torch.randn(5), "b.large": torch.randn(MAP_MIN_BYTES // 4 + 3)}
    save_file(source, tmp_path / "model.safetensors")
    before = (tmp_path / "model.safetensors").read_bytes()
    reader = CheckpointReader(tmp_path)
    for name in source:
        got = reader.get(name)
        assert got.untyped_storage().nbytes() == got.nbytes  # its own bytes, not the file's
        got.zero_()
        assert (tmp_path / "model.safetensors").read_bytes() == before
        assert torch.equal(reader.get(name), source[name])
    reader.close()


def test_small_tensors_held_at_once_hold_no_file_descriptors(tmp_path):
    # each memory map holds a descriptor while its tensor lives: a group of thousands of small tensors
    # (an export's) would run out of them, so tensors under MAP_MIN_BYTES are read instead
    small = {f"norm.{i}": torch.full((64,), float(i)) for i in range(2000)}
    large = torch.arange(MAP_MIN_BYTES // 4, dtype=torch.float32)
    save_file({**small, "large": large}, tmp_path / "model.safetensors")
    reader = CheckpointReader(tmp_path)
    held = [reader.get("norm.0")]  # opens the file
    descriptors = len(os.listdir("/proc/self/fd"))
    held += [reader.get(name) for name in list(small)[1:]]
    assert len(os.listdir("/proc/self/fd")) == descriptors
    assert all(torch.equal(got, small[name]) for got, name in zip(held, small))
    assert torch.equal(reader.get("large"), large)
    reader.close()


def test_writer_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with ShardedWriter(tmp_path / "out", max_shard_bytes=100) as writer:
            for name, tensor in tensors().items():
                writer.add(name, tensor)
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_existing_output(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match=r"output folder .*out already exists"):
        with ShardedWriter(tmp_path / "out"):
            pass


def test_truncated_file_is_named(tmp_path):
    save_file(tensors(), tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated: tensor .* ends at byte"):
        CheckpointReader(tmp_path)


def test_garbage_file_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(CheckpointError, match="model.safetensors is not a safetensors file: its header is not JSON"):
        CheckpointReader(tmp_path)


def test_index_listing_a_missing_shard_is_named(tmp_path):
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="lists model-00001-of-00002.safetensors, which does not exist"):
        CheckpointReader(tmp_path)


def test_folder_without_weights_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=f"has neither model.safetensors nor {INDEX_FILE}"):
        CheckpointReader(tmp_path)
