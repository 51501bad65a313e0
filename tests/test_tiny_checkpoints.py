"""The shipped tiny checkpoints are exactly what the generator script makes."""

from conftest import TINY


def test_regenerating_gives_identical_bytes(tmp_path, make_tiny):
    make_tiny.main(tmp_path)
    for name in make_tiny.CHECKPOINTS:
        shipped = sorted(path.name for path in (TINY / name).iterdir())
        assert sorted(path.name for path in (tmp_path / name).iterdir()) == shipped, name
        for file in shipped:
            assert (tmp_path / name / file).read_bytes() == (TINY / name / file).read_bytes(), f"{name}/{file}"


def test_llama_tiny_is_small_gqa_untied(llama_tiny):
    import json

    config = json.loads((llama_tiny / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"] is False
    assert (llama_tiny / "model.safetensors").stat().st_size < 2 * 2**20


def test_engine_tiny_checkpoints_fit_vllms_cpu_engine(make_tiny):
    # vLLM's CPU attention needs head_dim >= 32; its LoopCoder takes head_dim as hidden / heads
    for config in (make_tiny.LLAMA_ENGINE_TINY, make_tiny.LOOPCODER_ENGINE_TINY):
        assert config["head_dim"] >= 32
        assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
        assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA, as the shipped tiny ones
