"""The lazy reader and the atomic sharded writer."""

import errno
import gc
import json
import os

import numpy
import pytest
import torch
from safetensors.torch import save_file

from modelzoo.conversion import safetensors_io
from modelzoo.conversion.safetensors_io import INDEX_FILE, MAP_MIN_BYTES, CheckpointError, CheckpointReader, ShardedWriter


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


# --- tensors whose bytes are a file's are copied from the file (os.copy_file_range) --------------
def mapped_source(folder):
    """A checkpoint of mapped tensors (>= MAP_MIN_BYTES) between read ones, with a reader of it."""
    generator = torch.Generator().manual_seed(0)
    source = {"a.small": torch.randn(5, generator=generator),
              "b.large": torch.randn(MAP_MIN_BYTES // 4 + 3, generator=generator),  # starts and ends inside a page
              "c.small": torch.arange(7, dtype=torch.int64),
              "d.bf16": torch.randn(1024, 1024, generator=generator).to(torch.bfloat16),
              "e.large": torch.randn(512, 1024, generator=generator)}
    save_file(source, folder / "model.safetensors")
    return source, CheckpointReader(folder)


def copies(monkeypatch, limit=None, fail=None):
    """The bytes each call of os.copy_file_range copies, 0 for a failed one; `limit` copies at most
    that many per call, `fail` is an errno raised from the second call on (the first copies some)."""
    copy, copied = os.copy_file_range, []

    def counting(src, dst, count, offset_src=None, offset_dst=None):
        if fail is not None and copied:
            copied.append(0)
            raise OSError(fail, os.strerror(fail))
        done = copy(src, dst, min(count, limit or count), offset_src, offset_dst)
        copied.append(done)
        return done

    monkeypatch.setattr(os, "copy_file_range", counting)
    return copied


def write(folder, tensors, max_shard_bytes=6 * MAP_MIN_BYTES):
    with ShardedWriter(folder, max_shard_bytes=max_shard_bytes) as writer:
        for name, tensor in tensors.items():
            writer.add(name, tensor)
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def written_plainly(folder, tensors, monkeypatch):
    with monkeypatch.context() as patch:
        patch.delattr(os, "copy_file_range")
        return write(folder, tensors)


def test_mapped_tensors_are_copied_from_their_file_and_the_files_are_the_same(tmp_path, monkeypatch):
    source, reader = mapped_source(tmp_path)
    got = {name: reader.get(name) for name in source}
    tensors = got | {"f.rows": got["e.large"][100:400],  # part of a map: a region of the file too
                     "g.columns": got["e.large"][:, 8:1000],  # strided: copied together by the writer
                     "h.fresh": got["d.bf16"] * 1}
    copied = copies(monkeypatch, limit=300_001)  # short copies: the writer goes on where each ended
    files = write(tmp_path / "copied", tensors)
    assert len(files) > 2, "the bound should have produced several shards"
    assert sum(copied) == sum(tensors[name].nbytes for name in ("b.large", "d.bf16", "e.large", "f.rows"))
    assert files == written_plainly(tmp_path / "plain", tensors, monkeypatch)
    written = CheckpointReader(tmp_path / "copied")
    assert all(torch.equal(written.get(name), tensor) for name, tensor in tensors.items())


def test_a_mapped_tensor_changed_in_place_is_written_as_changed(tmp_path, monkeypatch):
    # the maps are copy-on-write: its file has the old bytes, so they must not be copied from there
    source, reader = mapped_source(tmp_path)
    changed, read = reader.get("b.large"), reader.get("e.large")
    changed[-1] = 42.0
    read.sum()  # read (its pages mapped in), not written: still the file's bytes
    copied = copies(monkeypatch)
    files = write(tmp_path / "out", {"b.large": changed, "e.large": read})
    assert sum(copied) == read.nbytes
    assert files == written_plainly(tmp_path / "plain", {"b.large": changed, "e.large": read}, monkeypatch)
    assert CheckpointReader(tmp_path / "out").get("b.large")[-1] == 42.0


LYING_PAGEMAPS = {"unreadable": lambda address, size: None,
                  "showing no page present": lambda address, size: numpy.zeros(size // 4096 + 2, dtype="<u8")}


@pytest.mark.parametrize("pagemap", list(LYING_PAGEMAPS))
def test_where_pagemap_cannot_tell_what_was_written_tensors_are_written_from_memory(tmp_path, monkeypatch, pagemap):
    source, reader = mapped_source(tmp_path)
    tensors = {name: reader.get(name) for name in source}
    plain = written_plainly(tmp_path / "plain", tensors, monkeypatch)
    copied = copies(monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(safetensors_io, "_pagemap", LYING_PAGEMAPS[pagemap])
        safetensors_io._pagemap_shows_writes.cache_clear()  # probes the patched pagemap...
        try:
            files = write(tmp_path / "out", tensors)
        finally:
            safetensors_io._pagemap_shows_writes.cache_clear()  # ...and the real one from now on
    assert copied == [] and files == plain


@pytest.mark.parametrize("error", [errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP], ids=errno.errorcode.get)
def test_writer_writes_from_memory_where_the_files_cannot_be_copied_between(tmp_path, monkeypatch, error):
    source, reader = mapped_source(tmp_path)
    tensors = {name: reader.get(name) for name in source}
    copied = copies(monkeypatch, limit=MAP_MIN_BYTES // 2, fail=error)  # fails halfway through b.large
    files = write(tmp_path / "out", tensors)
    assert copied == [MAP_MIN_BYTES // 2, 0], "one failure, then no more tries"
    assert files == written_plainly(tmp_path / "plain", tensors, monkeypatch)


def test_other_copy_errors_and_a_file_ending_early_are_raised(tmp_path, monkeypatch):
    source, reader = mapped_source(tmp_path)
    tensor = reader.get("b.large")

    def failing(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "copy_file_range", failing)
    with pytest.raises(OSError, match="Input/output error"):
        write(tmp_path / "failed", {"b.large": tensor})
    monkeypatch.setattr(os, "copy_file_range", lambda *args: 0)
    with pytest.raises(CheckpointError, match=r"tensor b.large: .*model.safetensors ends before byte \d+"):
        write(tmp_path / "short", {"b.large": tensor})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.safetensors"]


def test_tensors_are_copied_after_the_reader_is_closed_and_leave_no_descriptors(tmp_path, monkeypatch):
    source, reader = mapped_source(tmp_path)
    gc.collect()  # what earlier tests left behind goes now, not while counting
    descriptors = len(os.listdir("/proc/self/fd"))
    tensors = {name: reader.get(name) for name in source}
    reader.close()  # the maps' file stays open for the copy
    copied = copies(monkeypatch)
    write(tmp_path / "out", tensors)
    assert sum(copied) == sum(tensors[name].nbytes for name in ("b.large", "d.bf16", "e.large"))
    written = CheckpointReader(tmp_path / "out")
    assert all(torch.equal(written.get(name), tensor) for name, tensor in source.items())
    written.close()
    del tensors
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == descriptors


@pytest.mark.parametrize("error", [errno.EXDEV, errno.EIO], ids=errno.errorcode.get)
def test_a_copy_on_the_worker_that_cannot_copy_writes_and_one_that_fails_is_raised(tmp_path, monkeypatch, error):
    """After the first copy (made in the caller's thread, which tells whether the files can be copied
    between), copies run on the writer's worker thread. One that finds these files cannot be copied
    between writes the bytes itself; any other error is raised by the writer, and nothing is left."""
    source, reader = mapped_source(tmp_path)
    tensors = {name: reader.get(name) for name in source}
    copied = copies(monkeypatch, fail=error)  # the first copy succeeds, every later one fails
    if error == errno.EXDEV:
        files = write(tmp_path / "out", tensors)
        assert copied == [tensors["b.large"].nbytes, 0, 0]  # d.bf16 and e.large: tried, then written
        assert files == written_plainly(tmp_path / "plain", tensors, monkeypatch)
    else:
        with pytest.raises(OSError, match=os.strerror(error)):
            write(tmp_path / "out", tensors)
        assert sorted(path.name for path in tmp_path.iterdir()) == ["model.safetensors"]


class EndsWhileLookedAt:
    """A copy (or check) that ends between two looks at it: `done()` is False the first time, True after."""

    def __init__(self):
        self.looks = 0

    def done(self) -> bool:
        self.looks += 1
        return self.looks > 1

    def exception(self) -> OSError:
        return OSError(errno.EIO, "the copy failed")

    def result(self):
        raise self.exception()


def test_an_error_of_a_copy_ending_while_the_pending_ones_are_looked_at_is_not_lost():
    copier = safetensors_io.RegionCopier()
    copier._pending = [(EndsWhileLookedAt(), 0)]
    copier._raise_failed()  # sorts the pending ones into done and running
    with pytest.raises(OSError, match="the copy failed"):
        copier.finish()


def test_a_writer_refuses_non_finite_values_unless_allowed(tmp_path):
    """Read on the checking thread beside the copies; the error is raised before the shard is closed."""
    from modelzoo.conversion import validation

    tensor = torch.ones(1000)
    tensor[517] = float("inf")
    with pytest.raises(CheckpointError, match=r"tensor w holds inf at element 517: .*not written"):
        with ShardedWriter(tmp_path / "out") as writer:
            writer.add("w", tensor)
    assert list(tmp_path.iterdir()) == []
    with validation.non_finite_allowed(), ShardedWriter(tmp_path / "out") as writer:
        writer.add("w", tensor)
    assert (tmp_path / "out" / "model.safetensors").exists()
