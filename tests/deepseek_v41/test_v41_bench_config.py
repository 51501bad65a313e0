"""benchmarks/bench_deepseek_v41.py's configs (no model is built): our config validation accepts them, `large` has
about 1B active parameters and the release's layer roles at 12 layers, and the generated tokenizer has the Engram
classes the config declares."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from modelzoo.deepseek_v41 import DeepseekV41Config, build_engram_token_map
from modelzoo.deepseek_v41.config import DeepseekV41TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_deepseek_v41 as bench  # noqa: E402


def release_pattern_breaks(text) -> list[str]:
    """How the layer roles of `text` depart from the release's pattern (empty: they follow it): two window-only
    layers, a ratio-2 half whose KV sources (at least two: a later one replaces the earlier's K/V) each lead a run of
    reuse layers, then a ratio-1 half led by its one KV source, which is the candidate source, with re-index and reuse
    layers after it."""
    n = text.num_hidden_layers
    ratios = text.compress_ratios[:n]
    kv, index, candidate = text.kv_source_layer_ids, text.index_source_layer_ids, text.candidate_source_layer_id
    encoder = [i for i in range(n) if ratios[i] == 2]
    decoder = [i for i in range(n) if ratios[i] == 1]
    breaks = []
    if ratios[:2] != [0, 0] or sorted(encoder + decoder) != list(range(2, n)) or encoder[-1] > decoder[0]:
        breaks.append(f"not 2 window-only layers, then ratio 2, then ratio 1: {ratios}")
    encoder_sources = [i for i in kv if ratios[i] == 2]
    if len(encoder_sources) < 2 or encoder_sources[0] != encoder[0] or set(encoder) <= set(index):
        breaks.append(f"ratio-2 half {encoder}: KV sources {encoder_sources}, index sources {index}")
    reindex = [i for i in index if i not in kv]
    reuse = [i for i in decoder if i not in index]
    if [i for i in kv if ratios[i] == 1] != [decoder[0]] or candidate != decoder[0]:
        breaks.append(f"ratio-1 half {decoder}: KV sources {kv}, candidate source {candidate}")
    if not reindex or reindex[0] <= candidate or not reuse or set(reindex) - set(decoder):
        breaks.append(f"ratio-1 half {decoder}: re-index layers {reindex}, reuse layers {reuse}")
    return breaks


def test_the_release_follows_its_own_pattern_and_the_configs_keep_its_values():
    release = DeepseekV41TextConfig()
    assert release_pattern_breaks(release) == []
    assert bench.RELEASE == {field: getattr(release, field) for field in bench.RELEASE}


@pytest.mark.parametrize("name", sorted(bench.CONFIGS))
def test_configs_are_valid_and_have_no_dspark(name):
    text = DeepseekV41Config(**bench.model_config(name, 4096)).text_config
    assert text.num_nextn_predict_layers == 0 and text.engram_layer_ids
    assert text.max_position_embeddings >= 4096
    assert bench.model_config(name, 2**21)["text_config"]["max_position_embeddings"] == 2**21


def test_large_has_about_1b_active_parameters_and_the_release_roles():
    config = bench.model_config("large", 4096)
    text = DeepseekV41Config(**config).text_config
    assert 0.8e9 <= bench.active_parameters(config["text_config"]) <= 1.3e9
    assert release_pattern_breaks(text) == []
    assert text.engram_layer_ids[0] == 1 and text.engram_layer_ids[1] in text.kv_source_layer_ids  # the release: 1, 14


def test_the_written_tokenizer_has_the_engram_classes_of_the_config(tmp_path):
    from tiny_checkpoints.deepseek_v41_tiny import tokenizer_json

    text = bench.model_config("large", 4096)["text_config"]
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps(tokenizer_json(text["vocab_size"]), ensure_ascii=False), encoding="utf-8")
    token_map, classes = build_engram_token_map(tokenizer)
    assert (len(token_map), classes) == (text["vocab_size"], text["engram_compressed_vocab_size"])
