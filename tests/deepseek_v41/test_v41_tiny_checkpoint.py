"""deepseek-v41-tiny: reproducible bytes, every layer role, a tokenizer whose Engram normalisation merges ids."""

import json

from dsv41_helpers import V41_TINY, tiny_generator
from safetensors import safe_open

from modelzoo.deepseek_v41 import DeepseekV41Config, build_engram_token_map


def test_regenerating_gives_identical_bytes(tmp_path):
    tiny_generator().write_deepseek_v41_tiny(tmp_path)
    shipped = sorted(path.name for path in V41_TINY.iterdir())
    assert sorted(path.name for path in tmp_path.iterdir()) == shipped == [
        "config.json", "model.safetensors", "tokenizer.json"]
    for name in shipped:
        assert (tmp_path / name).read_bytes() == (V41_TINY / name).read_bytes(), name


def test_make_tiny_writes_it(tmp_path, make_tiny):
    make_tiny.main(tmp_path)
    assert (tmp_path / "deepseek-v41-tiny" / "model.safetensors").read_bytes() == (
        V41_TINY / "model.safetensors").read_bytes()


def test_every_layer_role_is_present():
    text = DeepseekV41Config.from_pretrained(V41_TINY).text_config
    ratios, n = text.compress_ratios, text.num_hidden_layers
    kv, index = text.kv_source_layer_ids, text.index_source_layer_ids
    sliding_only = [i for i in range(n) if ratios[i] == 0]
    reuse = [i for i in range(n) if ratios[i] and i not in index]
    reindex = [i for i in index if i not in kv]
    assert sliding_only and reuse and reindex
    assert {ratios[i] for i in kv} == {1, 2}
    assert sum(ratios[i] == 2 for i in kv) >= 2  # a second ratio-2 source replaces the first one's K/V
    assert text.candidate_source_layer_id in kv and reindex[0] > text.candidate_source_layer_id
    assert len(text.engram_layer_ids) == 2 and text.num_nextn_predict_layers >= 2
    assert text.vocab_size % 128 != 0
    # rows of 64 tokens exceed the candidate budget, the window and the top-k
    budget = text.candidate_topk_blocks * text.candidate_block_size
    assert budget < 64 and text.sliding_window < 64 and text.index_topk < 64 // 2


def test_tensor_names_are_the_ones_our_model_loads_and_nothing_is_missing():
    from dsv41_helpers import load_tiny

    with safe_open(V41_TINY / "model.safetensors", "pt") as checkpoint:
        names = set(checkpoint.keys())
    model_names = set(load_tiny().state_dict())
    assert model_names <= names
    assert names - model_names == {"image_start", "image_end", "image_newline"}  # carried by a text-only import
    assert any(name.startswith("mtp.2.markov_head.") for name in names)
    assert (V41_TINY / "model.safetensors").stat().st_size < 4 * 2**20


def test_tokenizer_loads_without_remote_code_and_its_normalisation_merges_ids():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(V41_TINY / "tokenizer.json"))
    text = json.loads((V41_TINY / "config.json").read_text())["text_config"]
    assert tokenizer.get_vocab_size(with_added_tokens=True) == text["vocab_size"]
    token_map, classes = build_engram_token_map(V41_TINY / "tokenizer.json")
    assert classes == text["engram_compressed_vocab_size"] < text["vocab_size"]
    same = {tuple(tokenizer.token_to_id(t) for t in group) for group in (
        ("the", "The", "THE", " the", "ｔｈｅ"), ("cafe", "café", "Café", " café"), (" ", "  ", "\t", "\n"))}
    for ids in same:
        assert len({token_map[i] for i in ids}) == 1, ids
    assert token_map[tokenizer.token_to_id("the")] != token_map[tokenizer.token_to_id("of")]
