"""The tiny DeepSeek-V4 checkpoint and the name table.

The tiny file must be exactly what transformers reads and writes: `from_pretrained` consumes every
tensor (MTP aside, which transformers skips on purpose), and `save_pretrained` of the loaded model
writes back the same names with the same bytes. So the mapping's HF names are transformers' names.
"""

import pytest
import torch
from dsv4_helpers import provider_for, write_tiny
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM

from modelzoo.conversion.mapping import MappingError
from modelzoo import runtime


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("dsv4") / "deepseek-v4-tiny")


def test_generator_is_deterministic(tiny, tmp_path):
    again = write_tiny(tmp_path / "again")
    for name in ("model.safetensors", "config.json"):
        assert (tiny / name).read_bytes() == (again / name).read_bytes()


def test_transformers_reads_and_writes_the_same_names(tiny, tmp_path):
    model, info = DeepseekV4ForCausalLM.from_pretrained(tiny, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    model.save_pretrained(tmp_path / "resaved")
    ours, resaved = load_file(tiny / "model.safetensors"), load_file(tmp_path / "resaved" / "model.safetensors")
    assert sorted(resaved) == sorted(name for name in ours if not name.startswith("mtp."))
    for name, tensor in resaved.items():
        assert torch.equal(tensor, ours[name]), name
    assert any(name.startswith("mtp.0.") for name in ours)
    assert model.model.layers[0].mlp.gate.tid2eid.abs().sum() > 0  # the hash table was loaded, not left at zeros


def test_a_missing_tensor_is_named(tiny, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(tiny / "model.safetensors")
    del tensors["model.layers.1.attn.indexer.wq_b.weight"]
    save_file(tensors, broken / "model.safetensors")
    (broken / "config.json").write_bytes((tiny / "config.json").read_bytes())
    with runtime.parallel():
        provider = provider_for(broken)
        model = provider.provide()
        with pytest.raises(MappingError, match=r"missing tensors model\.layers\.1\.attn\.indexer\.wq_b\.weight"):
            provider.load_hf_weights(model, progress=False)


def test_unsupported_configs_are_refused(tiny):
    with pytest.raises(ValueError, match="scoring_func 'softmax'"):
        provider_for(write_tiny(tiny.parent / "softmax", scoring_func="softmax"))
