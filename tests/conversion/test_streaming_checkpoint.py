"""Streaming conversion (conversion/torch_dist_streaming.py): Megatron's exact torch_dist files, memory of a
few tensors, not of the model."""

import errno
import gc
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from modelzoo.conversion import engine, megatron_ckpt
from modelzoo.conversion.safetensors_io import MAP_MIN_BYTES, CheckpointReader, RegionCopier
from modelzoo.conversion.torch_dist_streaming import without_crc32
from modelzoo.conversion.transforms import RowBlocks
from modelzoo import runtime
from modelzoo.registry import build_provider
from conftest import ROOT, TINY

# LoopCoder-shaped, bf16, 16 layers: ~140 MB in 5 shards; the largest tensor (embedding, output) is 8 MB
CONFIG = {
    "architectures": ["IQuestLoopCoderForCausalLM"], "model_type": "iquestloopcoder", "vocab_size": 8192,
    "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "loop_num": 2, "loop_window_size": 64, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MiB = 2**20

# In a fresh process: convert the shipped tiny checkpoint first (imports, lazy module loading and
# allocator set-up happen there), then report the peak RSS the measured conversion adds.
CHILD = """
import resource, sys, torch
from pathlib import Path
from modelzoo.conversion import engine, megatron_ckpt
from modelzoo import runtime
from modelzoo.registry import build_provider

def import_hf(source, out):
    provider = build_provider(source, params_dtype=torch.bfloat16)
    skeleton = provider.provide_skeleton()
    reader = provider.checkpoint_reader(Path(source))
    megatron_ckpt.save(skeleton, out, {"dtype": "bfloat16"}, [Path(source) / "config.json"],
                       weights=engine.hf_weights(skeleton, provider.mapping(), reader), progress=False)

def export_hf(source, out, group_bytes):
    provider = build_provider(Path(source) / "hf", params_dtype=torch.bfloat16)
    weights = megatron_ckpt.stream_weights(provider.provide_skeleton(), source, group_bytes=group_bytes)
    provider.save_hf(weights, out, max_shard_bytes=group_bytes, source_dir=Path(source) / "hf")

if __name__ == "__main__":
    tiny, work, group_bytes = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    with runtime.parallel():
        import_hf(tiny, work / "warm-megatron")
        export_hf(work / "warm-megatron", work / "warm-hf", group_bytes)
        for step, run in (("import", lambda: import_hf(work / "hf", work / "megatron")),
                          ("export", lambda: export_hf(work / "megatron", work / "exported", group_bytes))):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            run()
            print(step, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, make_tiny) -> tuple[Path, int, int]:
    """(folder, total bytes, largest tensor bytes) of a multi-shard LoopCoder-shaped bf16 checkpoint."""
    folder = tmp_path_factory.mktemp("streaming") / "hf"
    return folder, *make_tiny.write_sharded_loopcoder(folder, CONFIG, max_shard_bytes=32 * MiB)


def test_import_and_export_memory_is_a_few_tensors_not_the_model(synthetic):
    folder, total, largest = synthetic
    group_bytes = 16 * MiB
    done = subprocess.run([sys.executable, "-c", CHILD, str(TINY / "loopcoder-tiny"), str(folder.parent), str(group_bytes)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    added = dict(line.split() for line in done.stdout.splitlines() if line.startswith(("import ", "export ")))
    # import holds a tensor's sources, its Megatron form and the piece being written; export one group
    # of tensors, one gathered and converted tensor and one being written. Slack: allocator, DCP metadata.
    import_bound = 3 * largest + 24 * MiB
    export_bound = group_bytes + 3 * largest + 24 * MiB
    assert total > 2 * export_bound, "the checkpoint must be large enough for the bounds to mean streaming"
    assert int(added["import"]) <= import_bound, (int(added["import"]) / MiB, import_bound / MiB)
    assert int(added["export"]) <= export_bound, (int(added["export"]) / MiB, export_bound / MiB)
    original, exported = CheckpointReader(folder), CheckpointReader(folder.parent / "exported")
    assert sorted(exported.names()) == sorted(original.names())
    assert all(torch.equal(exported.get(name), original.get(name)) for name in original.names())


def test_streamed_import_writes_the_files_megatron_writes(tmp_path):
    """Same DCP metadata and byte-identical data file as dist_checkpointing.save of the loaded model
    with torch.save's CRC-32 off, as the streaming writer saves."""
    from megatron.core import dist_checkpointing

    source = TINY / "loopcoder-tiny"
    with runtime.parallel():
        provider = build_provider(source, perform_initialization=False)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        reference = tmp_path / "reference"
        reference.mkdir()
        with without_crc32():
            dist_checkpointing.save({"model": model.sharded_state_dict(), "checkpoint_version": 3.0,
                                     "iteration": 0}, str(reference))
        skeleton = provider.provide_skeleton()
        reader = provider.checkpoint_reader(source)
        megatron_ckpt.save(skeleton, tmp_path / "streamed", {}, [], progress=False,
                           weights=engine.hf_weights(skeleton, provider.mapping(), reader))
    streamed = tmp_path / "streamed" / megatron_ckpt.RELEASE
    assert sorted(p.name for p in streamed.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert json.loads((streamed / "metadata.json").read_text()) == json.loads((reference / "metadata.json").read_text())
    ours, megatrons = FileSystemReader(str(streamed)).read_metadata(), FileSystemReader(str(reference)).read_metadata()
    assert ours.state_dict_metadata == megatrons.state_dict_metadata
    assert ours.storage_data == megatrons.storage_data
    assert ours.all_local_plans == megatrons.all_local_plans
    for data_file in reference.glob("*.distcp"):
        assert (streamed / data_file.name).read_bytes() == data_file.read_bytes()


def test_megatron_loads_a_streamed_import_bit_identically(tmp_path):
    """Megatron's own loader (torch's reader, torch.load) reads the tensors the checkpoint was made from,
    though the zips' CRC-32 fields are 0; torch.save computes them again afterwards."""
    from megatron.core import dist_checkpointing

    source = TINY / "loopcoder-tiny"
    with runtime.parallel():
        provider = build_provider(source, perform_initialization=False)
        skeleton = provider.provide_skeleton()
        reader = provider.checkpoint_reader(source)
        megatron_ckpt.save(skeleton, tmp_path / "streamed", {}, [], progress=False,
                           weights=engine.hf_weights(skeleton, provider.mapping(), reader))
        assert torch.serialization.get_crc32_options()
        folder = tmp_path / "streamed" / megatron_ckpt.RELEASE
        expected = provider.provide()
        provider.load_hf_weights(expected, progress=False)
        model = provider.provide()
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(folder))["model"]
        tensors = engine.megatron_tensors(expected)
        assert loaded.keys() >= tensors.keys()
        assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


def test_fc1_is_exported_from_its_halves_as_read(tmp_path, monkeypatch):
    """A SwiGLU fc1 read back comes as its [gate; up] halves, each on its map of the file, with no
    factory merge (Megatron's concatenation), and exports to the source's gate and up tensors, each
    one of those halves itself: nothing copied."""
    import megatron.core.transformer.mlp as mlp

    merges = []
    concatenate = mlp.cat_with_oom_fallback
    monkeypatch.setattr(mlp, "cat_with_oom_fallback", lambda pieces: merges.append(pieces) or concatenate(pieces))
    source = TINY / "loopcoder-tiny"
    with runtime.parallel():
        provider = build_provider(source)
        skeleton = provider.provide_skeleton()
        reader = provider.checkpoint_reader(source)
        megatron_ckpt.save(skeleton, tmp_path / "megatron", {}, [], progress=False,
                           weights=engine.hf_weights(skeleton, provider.mapping(), reader))
        streamed = dict(megatron_ckpt.stream_weights(provider.provide_skeleton(), tmp_path / "megatron"))
        fc1 = [name for name in streamed if name.endswith("linear_fc1.weight")]
        assert fc1 and all(isinstance(streamed[name], RowBlocks) and len(streamed[name].blocks) == 2 for name in fc1)
        assert not merges
        exported = dict(engine.export_hf_weights(iter(streamed.items()), provider.mapping()))
    original = CheckpointReader(source)
    assert exported.keys() == set(original.names())
    assert all(torch.equal(exported[name], original.get(name)) for name in original.names())
    blocks = {block.data_ptr() for name in fc1 for block in streamed[name].blocks}
    halves = [name for name in exported if name.endswith(("gate_proj.weight", "up_proj.weight"))]
    assert halves and all(exported[name].data_ptr() in blocks for name in halves)


# q, k and v of at least MAP_MIN_BYTES each: maps of the source files, and the QKV read back a map too
QKV_MAPPED = {"hidden_size": 1024, "head_dim": 128, "num_key_value_heads": 4}


@pytest.mark.parametrize("overrides", [{}, QKV_MAPPED], ids=["qkv-read", "qkv-mapped"])
def test_export_copies_the_tensors_it_writes_as_read_from_the_checkpoint_file(tmp_path, make_tiny, monkeypatch, overrides):
    """At TP 1 the tensors of at least MAP_MIN_BYTES are exported as read: maps of the .distcp file,
    which the writer copies from that file (os.copy_file_range); a fused QKV's q, k and v as their rows
    of each group, each copied, never concatenated. The files are those the plain writes make, and
    nothing stays open."""
    source = tmp_path / "hf"
    make_tiny.write_sharded_loopcoder(source, {**CONFIG, "num_hidden_layers": 2, **overrides}, max_shard_bytes=8 * MiB)
    copy, copied = os.copy_file_range, []
    with runtime.parallel():
        provider = build_provider(source, params_dtype=torch.bfloat16)
        skeleton = provider.provide_skeleton()
        megatron_ckpt.save(skeleton, tmp_path / "megatron", {}, [], progress=False,
                           weights=engine.hf_weights(skeleton, provider.mapping(), provider.checkpoint_reader(source)))

        def export(out):
            weights = megatron_ckpt.stream_weights(provider.provide_skeleton(), tmp_path / "megatron", 8 * MiB)
            provider.save_hf(weights, out, max_shard_bytes=8 * MiB, source_dir=source)
            return {path.name: path.read_bytes() for path in sorted(out.iterdir())}

        with monkeypatch.context() as patch:
            patch.delattr(os, "copy_file_range")
            plain = export(tmp_path / "plain")
        gc.collect()
        descriptors = len(os.listdir("/proc/self/fd"))
        monkeypatch.setattr(os, "copy_file_range", lambda *args: copied.append(copy(*args)) or copied[-1])
        assert export(tmp_path / "copied") == plain
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == descriptors
    original, exported = CheckpointReader(source), CheckpointReader(tmp_path / "copied")
    expected = {name: original.get(name) for name in original.names()}
    qkv_mapped = all(tensor.nbytes >= MAP_MIN_BYTES for name, tensor in expected.items() if name.endswith("k_proj.weight"))
    assert qkv_mapped == bool(overrides)
    assert sum(copied) == sum(tensor.nbytes for tensor in expected.values() if tensor.nbytes >= MAP_MIN_BYTES)
    assert len(plain) > 2, "config.json and several shards"
    assert all(torch.equal(exported.get(name), tensor) for name, tensor in expected.items())


@pytest.mark.parametrize("error", [None, errno.EXDEV])
def test_import_copies_the_tensors_it_saves_as_read_from_the_source_files(tmp_path, make_tiny, monkeypatch, error):
    """At TP 1 the tensors of at least MAP_MIN_BYTES are saved as read: maps of the source safetensors
    files, which the .distcp writer copies from them (os.copy_file_range) inside torch.save's zip
    records; a fused QKV as its q, k and v row blocks, each copied, never concatenated. The files are
    those the plain writes make, byte for byte, and nothing stays open; where the files cannot be copied
    between (EXDEV), they are written plainly."""
    source = tmp_path / "hf"
    make_tiny.write_sharded_loopcoder(source, {**CONFIG, "num_hidden_layers": 2, **QKV_MAPPED}, max_shard_bytes=8 * MiB)
    copy, copied = os.copy_file_range, []

    def counting(*args):
        if error is not None:
            copied.append(0)
            raise OSError(error, os.strerror(error))
        copied.append(copy(*args))
        return copied[-1]

    with runtime.parallel():
        provider = build_provider(source, params_dtype=torch.bfloat16)

        def import_(out):
            skeleton = provider.provide_skeleton()
            megatron_ckpt.save(skeleton, out, {}, [], progress=False,
                               weights=engine.hf_weights(skeleton, provider.mapping(), provider.checkpoint_reader(source)))
            folder = out / megatron_ckpt.RELEASE
            files = {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.name != ".metadata"}
            metadata = FileSystemReader(str(folder)).read_metadata()  # its checkpoint_id is the (staging) path
            return files, metadata.state_dict_metadata, metadata.storage_data

        with monkeypatch.context() as patch:
            patch.delattr(os, "copy_file_range")
            plain = import_(tmp_path / "plain")
        gc.collect()
        descriptors = len(os.listdir("/proc/self/fd"))
        monkeypatch.setattr(os, "copy_file_range", counting)
        assert import_(tmp_path / "copied") == plain
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == descriptors
        assert any(name.endswith(".distcp") for name in plain[0])
        streamed = dict(megatron_ckpt.stream_weights(provider.provide_skeleton(), tmp_path / "copied"))
    original = CheckpointReader(source)
    if error is None:
        assert all(original.get(name).nbytes >= MAP_MIN_BYTES for name in original.names() if name.endswith("k_proj.weight"))
        assert sum(copied) == sum(tensor.nbytes for tensor in map(original.get, original.names())
                                  if tensor.nbytes >= MAP_MIN_BYTES) > 0
    else:
        assert copied == [0]  # tried once, then every tensor written from memory
    megatron = {name: tensor.tensor() if isinstance(tensor, RowBlocks) else tensor for name, tensor in streamed.items()}
    with runtime.parallel():
        exported = dict(engine.export_hf_weights(iter(megatron.items()), provider.mapping()))
    assert exported.keys() == set(original.names())
    assert all(torch.equal(exported[name], original.get(name)) for name in original.names())


def test_a_view_is_saved_as_its_clone_without_copying():
    from modelzoo.conversion.torch_dist_streaming import with_own_storage

    base = torch.arange(24, dtype=torch.bfloat16).reshape(6, 4)
    for view in (base[2:5], base[:, 1:3]):
        own = with_own_storage(view)
        assert own.untyped_storage().nbytes() == view.nbytes
        ours, clone = io.BytesIO(), io.BytesIO()
        torch.save(own, ours)
        torch.save(view.clone(), clone)
        assert ours.getvalue() == clone.getvalue()
    assert with_own_storage(base[2:5]).data_ptr() == base[2:5].data_ptr()  # contiguous: no copy


@pytest.mark.parametrize("tp", [1, 2])
def test_streamed_reading_gives_what_megatron_loads(tmp_path, tp):
    """stream_weights (the mapped reader, one piece handed over or pieces copied together) against
    dist_checkpointing.load of the whole model with Megatron's own strategy, written at TP 2."""
    source = TINY / "loopcoder-tiny"
    saved = tmp_path / "megatron"
    runtime.run(_save_tiny, 2, str(source), str(saved))
    assert all(runtime.run(_compare_streamed_with_megatron, tp, str(source), str(saved), tp))


def test_streamed_reading_unpickles_its_metadata_once(tmp_path, monkeypatch):
    """One load per group; `.metadata` is unpickled once, by the restricted unpickler, and the reader of
    every group takes that (Megatron's load of the common state reads it with a reader of its own)."""
    from modelzoo.conversion import safe_pickle

    source = TINY / "loopcoder-tiny"
    _save_tiny(0, str(source), str(tmp_path / "megatron"), tp=1)
    read_metadata, reads, restricted_reads = FileSystemReader.read_metadata, [], []

    def counted(reader, *args, **kwargs):
        reads.append(type(reader).__name__)
        return read_metadata(reader, *args, **kwargs)

    def counted_restricted(path):
        restricted_reads.append(path)
        return restricted_read(path)

    restricted_read = safe_pickle.read_metadata
    monkeypatch.setattr(FileSystemReader, "read_metadata", counted)
    monkeypatch.setattr(safe_pickle, "read_metadata", counted_restricted)
    with runtime.parallel():
        provider = build_provider(source)
        streamed = dict(megatron_ckpt.stream_weights(provider.provide_skeleton(), tmp_path / "megatron", group_bytes=4096))
    assert len(streamed) > 2 and len(restricted_reads) == 1 and "MappedReader" not in reads
    assert reads.count("FileSystemReader") > 2


def _save_tiny(rank, source, out, tp=2):
    with runtime.parallel(tp=tp):
        provider = build_provider(source)
        skeleton = provider.provide_skeleton()
        reader = provider.checkpoint_reader(Path(source))
        megatron_ckpt.save(skeleton, out, {}, [], progress=False,
                           weights=engine.hf_weights(skeleton, provider.mapping(), reader))


def _compare_streamed_with_megatron(rank, source, folder, tp):
    from megatron.core import dist_checkpointing

    with runtime.parallel(tp=tp):
        provider = build_provider(source, perform_initialization=False)
        model = provider.provide()
        expected = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder + "/release")["model"]
        streamed = dict(megatron_ckpt.stream_weights(provider.provide_skeleton(), folder, group_bytes=4096))
        return streamed.keys() == engine.megatron_tensors(model).keys() and all(
            torch.equal(tensor.tensor() if isinstance(tensor, RowBlocks) else tensor, expected[name])
            for name, tensor in streamed.items())


def test_a_stand_in_is_written_as_the_blocks_it_stands_for(tmp_path):
    """What the .distcp writer writes for a tensor that stands in for row blocks (a fused QKV): the
    blocks, in order, when torch.save hands over its storage whole; an error when it does not."""
    from modelzoo.conversion.torch_dist_streaming import CopyingStream

    blocks = [torch.arange(16.0).reshape(2, 8), torch.full((1, 8), -1.0), torch.ones(3, 8)]
    stand_in = torch.empty(6, 8)
    with open(tmp_path / "whole", "wb") as file:
        stream = CopyingStream(file, RegionCopier())
        stream.write(b"head")
        with stream.saving("qkv", stand_in, blocks):
            assert stream.write(memoryview(stand_in.numpy()).cast("B")) == stand_in.nbytes
        stream.write(b"tail")
    assert (tmp_path / "whole").read_bytes() == b"head" + torch.cat(blocks).numpy().tobytes() + b"tail"
    with open(tmp_path / "piecewise", "wb") as file:
        stream = CopyingStream(file, RegionCopier())
        with pytest.raises(RuntimeError, match="tensor qkv: torch.save did not write its storage in one piece"):
            with stream.saving("qkv", stand_in, blocks):
                stream.write(memoryview(stand_in.numpy()).cast("B")[: stand_in.nbytes // 2])
