"""DeepseekV41Config: the released defaults, the tiny checkpoint's config, and refusals that name the field."""

import json

import pytest
from dsv41_helpers import V41_TINY

from modelzoo.deepseek_v41 import DeepseekV41Config, DeepseekV41TextConfig
from modelzoo.deepseek_v41.config import engram_bucket_primes


def test_defaults_are_the_released_schedule():
    config = DeepseekV41TextConfig(engram_layer_ids=[1, 14])
    assert config.compress_ratios == [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    assert config.kv_source_layer_ids == [2, 8, 14, 20]
    assert config.index_source_layer_ids == [2, 8, 14, 20, 24, 28, 32, 36]
    assert config.candidate_source_layer_id == 20
    assert config.dspark_target_layer_ids == [37, 38, 39]
    # the table sizes of the release are the sums of each layer's 24 bucket primes above 16e6
    assert config.engram_num_embeddings == [384006168, 384016682]
    assert config.layer_types[:3] == ["sliding_attention", "sliding_attention", "shared_compressed_attention"]


def test_bucket_primes_are_distinct_primes_in_order():
    config = DeepseekV41TextConfig(engram_layer_ids=[1, 4], engram_vocab_size=50, engram_max_ngram_size=3,
                                   engram_n_heads=2, engram_head_dim=32)
    assert engram_bucket_primes(config) == [[[53, 59], [61, 67]], [[71, 73], [79, 83]]]


def test_the_tiny_checkpoint_config_parses_and_round_trips():
    config = DeepseekV41Config.from_pretrained(V41_TINY)
    text = config.text_config
    assert (config.model_type, text.model_type, config.vision_config.model_type) == (
        "deepseek_v41", "deepseek_v41_text", "deepseek_v41_vision")
    assert config.architectures == ["DeepseekV41ForCausalLM"]
    assert text.rope_parameters["compress"]["rope_type"] == "yarn"
    assert text.rope_parameters["main"]["rope_type"] == "default"
    again = DeepseekV41Config.from_dict(config.to_dict())
    assert again.text_config.to_dict() == text.to_dict()


def test_auto_classes_resolve_deepseek_v41():
    from transformers import AutoConfig

    from modelzoo.deepseek_v41.config import TRANSFORMERS_HAS_DEEPSEEK_V41

    config = AutoConfig.from_pretrained(V41_TINY)
    if not TRANSFORMERS_HAS_DEEPSEEK_V41:  # registered by us only when transformers has none
        assert isinstance(config, DeepseekV41Config)


TINY_TEXT = {k: v for k, v in json.loads((V41_TINY / "config.json").read_text())["text_config"].items()
             if k != "model_type"}

BAD_VALUES = [
    ({"hidden_size": 0}, "hidden_size"),
    ({"hidden_size": 64.0}, "hidden_size"),
    ({"index_topk": True}, "index_topk"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"head_dim": 8}, "head_dim"),
    ({"o_groups": 3}, "o_groups"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"gate_temp": 0.0}, "gate_temp"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1]}, "compress_ratios"),            # one entry short
    ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 2]}, "compress_ratios"),  # a draft layer compressing
    ({"compress_ratios": [0, 0, 2, 2, 2, -1, 1, 1, 1, 1]}, "compress_ratios"),
    ({"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1]}, "compress_ratios"),  # layer 5 reads a ratio-2 source
    ({"kv_source_layer_ids": [2, 4, 6, 10]}, "kv_source_layer_ids"),  # out of range
    ({"kv_source_layer_ids": [1, 4, 6]}, "kv_source_layer_ids"),      # a ratio-0 layer
    ({"kv_source_layer_ids": [4, 2, 6]}, "kv_source_layer_ids"),      # not increasing
    ({"kv_source_layer_ids": [4, 6], "index_source_layer_ids": [4, 6, 8]}, "kv_source_layer_ids"),  # 2, 3 sourceless
    ({"index_source_layer_ids": [2, 6, 8]}, "index_source_layer_ids"),  # KV source 4 not re-indexed
    ({"index_source_layer_ids": [1, 2, 4, 6]}, "index_source_layer_ids"),
    ({"candidate_source_layer_id": 7}, "candidate_source_layer_id"),  # not an index source
    ({"candidate_source_layer_id": 4}, "candidate_source_layer_id"),  # KV source 6 follows it
    ({"candidate_source_layer_id": -2}, "candidate_source_layer_id"),
    ({"candidate_topk_blocks": 2}, "candidate_topk_blocks"),  # (2 - 1) * 4 + 1 < index_topk 8
    ({"engram_layer_ids": [1, 10]}, "engram_layer_ids"),
    ({"engram_num_embeddings": [240]}, "engram_num_embeddings"),
    ({"engram_num_embeddings": [240, 305]}, "engram_num_embeddings"),  # below the sum of the primes
    ({"engram_head_dim": 48}, "engram_head_dim"),
    ({"engram_max_ngram_size": 1}, "engram_max_ngram_size"),
    ({"engram_pad_id": 250}, "engram_pad_id"),
    ({"engram_compressed_vocab_size": 251}, "engram_compressed_vocab_size"),
    ({"dspark_target_layer_ids": []}, "dspark_target_layer_ids"),
    ({"dspark_target_layer_ids": [7, 12]}, "dspark_target_layer_ids"),
    ({"dspark_noise_token_id": 250}, "dspark_noise_token_id"),
    ({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok"),
    ({"layer_types": ["sliding_attention"] * 10}, "layer_types"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0}}, "rope_parameters"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2}}, "rope_parameters"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_parameters"),
]


@pytest.mark.parametrize(("changes", "field"), BAD_VALUES, ids=[f"{field}-{i}" for i, (_, field) in
                                                                 enumerate(BAD_VALUES)])
def test_a_bad_value_is_refused_naming_its_field(changes, field):
    with pytest.raises(ValueError, match=rf"^DeepseekV41TextConfig\.{field} = .*: "):
        DeepseekV41TextConfig(**{**TINY_TEXT, **changes})


def test_the_tiny_values_themselves_are_accepted():
    DeepseekV41TextConfig(**TINY_TEXT)


def test_composite_refusals_name_the_field():
    with pytest.raises(ValueError, match=r"^DeepseekV41Config\.image_token_id = 250: "):
        DeepseekV41Config(text_config=TINY_TEXT, image_token_id=250)
    with pytest.raises(ValueError, match=r"^DeepseekV41TextConfig\.o_groups = 3: "):
        DeepseekV41Config(text_config={**TINY_TEXT, "o_groups": 3})
