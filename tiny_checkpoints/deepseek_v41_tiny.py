"""The tiny random DeepSeek-V4.1 checkpoint in transformers main's naming, byte for byte reproducible.

    write_deepseek_v41_tiny(folder)          # config.json + model.safetensors + tokenizer.json
    write_deepseek_v41_tiny(folder, config)  # the same generator at another config (benchmarks/bench_deepseek_v41.py)
    write_deepseek_v41_tiny_native(folder)   # the release layout: native names, FP8 / FP4, sharded

Every layer role is present at a test-sized scale (hidden 64, 10 backbone layers, 3 DSpark layers):

    layer  ratio  role                                         extra
    0      0      sliding window only
    1      0      sliding window only                          Engram
    2      2      KV + index source (pairs pooled)
    3      2      reuse
    4      2      KV + index source (replaces layer 2's K/V)    Engram
    5      2      reuse
    6      1      KV + index source, candidate source
    7      1      reuse                                        DSpark target
    8      1      re-index (own queries, inside the candidates) DSpark target
    9      1      reuse                                        DSpark target
    mtp.0-2  0    DSpark draft layers (block of 3)

A sliding window of 8 and an index top-k of 8 sit well below a 64-token row; the candidate budget (3 blocks of 4
latents) is exceeded by rows longer than 12 tokens, so the candidate restriction acts. The vocabulary has 250
tokens (not a multiple of 128) and its tokenizer.json (a WordLevel model the `tokenizers` library reads, no
remote code) holds case, accent, full-width and whitespace variants that the Engram normalisation merges into
`engram_compressed_vocab_size` classes. Head and latent widths are multiples of 32 so the opt-in FP8 / FP4 fake
quantisation applies. The vision tower is not built by the text model: its config is there so the checkpoint
parses, and the three image delimiter tensors stand in for what a text-only import must carry through.

The config is written by hand; every tensor is drawn from a generator seeded by zlib.crc32(name), like
make_tiny.py, so the bytes do not depend on library versions or on the order in which tensors are made.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<bos>", "<eos>", "<pad>", "<unk>", "<image>", "<draft>"]
WORDS = ["the", "of", "and", "to", "in", "is", "it", "on", "model", "token", "layer", "expert", "cache", "block",
         "river", "stone", "light", "music", "north", "deep", "seek", "zoo", "data", "code", "test", "memory",
         "paris", "hello", "world", "green"]
ACCENTED = {"cafe": "café", "naive": "naïve", "resume": "résumé", "eleve": "élève", "uber": "über"}
FULL_WIDTH = {"the": "ｔｈｅ", "code": "ｃｏｄｅ", "zoo": "ｚｏｏ"}
WHITESPACE = [" ", "  ", "\t", "\n", " \n"]
PUNCTUATION = [".", ",", "!", "?", ":", ";", "(", ")", "-", "'"]


def tiny_vocabulary(size: int = 250) -> list[str]:
    """`size` distinct tokens (at least 200); many normalise alike (case, accents, full width, a leading space,
    whitespace). The fillers that make up the size are classes of their own (`engram_classes`)."""
    tokens = list(SPECIAL_TOKENS)
    for word in WORDS:
        tokens += [word, word.capitalize(), word.upper(), " " + word]
    for plain, accented in ACCENTED.items():
        tokens += [plain, accented, accented.capitalize(), " " + accented]
    tokens += list(FULL_WIDTH.values()) + WHITESPACE + PUNCTUATION
    tokens += [str(digit) for digit in range(10)]
    tokens += [chr(code) for code in range(ord("a"), ord("z") + 1) if chr(code) not in tokens]
    tokens += [f"x{index:02d}" for index in range(size - len(tokens))]  # distinct fillers up to `size`
    assert len(tokens) == len(set(tokens)) == size
    return tokens


def tokenizer_json(size: int = 250) -> dict:
    """A tokenizer.json in the `tokenizers` format: WordLevel over `tiny_vocabulary(size)`, whitespace-split."""
    tokens = tiny_vocabulary(size)
    added = [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, token in enumerate(SPECIAL_TOKENS)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {token: i for i, token in enumerate(tokens)},
                      "unk_token": "<unk>"}}


DEEPSEEK_V41_TINY_TEXT = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 250,
    "hidden_size": 64,
    "num_hidden_layers": 10,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "o_groups": 2,
    "o_lora_rank": 16,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 256,
    "sliding_window": 8,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 4, 6, 8],
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 4,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 8,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "gate_temp": 2.0,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "topk_method": "noaux_tc",
    "swiglu_limit": 1.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 4],
    "engram_vocab_size": 50,
    "engram_num_embeddings": [240, 306],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_id": 2,
    "engram_compressed_vocab_size": 138,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 3,
    "dspark_noise_token_id": 5,
    "dspark_target_layer_ids": [7, 8, 9],
    "dspark_markov_rank": 8,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-20,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}

DEEPSEEK_V41_TINY = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "image_token_id": 4,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "text_config": DEEPSEEK_V41_TINY_TEXT,
    "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 32, "intermediate_size": 64,
                      "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 14, "downsample_ratio": 3},
}


def engram_classes(size: int) -> int:
    """The number of classes the Engram normalisation merges `tiny_vocabulary(size)` into (its
    `engram_compressed_vocab_size`): the tiny checkpoint's, plus one per filler token past its 250."""
    return DEEPSEEK_V41_TINY_TEXT["engram_compressed_vocab_size"] + size - DEEPSEEK_V41_TINY_TEXT["vocab_size"]


def _block_shapes(c: dict, prefix: str, layer: int, experts: int) -> dict[str, tuple[int, ...]]:
    hidden, heads, head_dim, hc = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["hc_mult"]
    inter, groups, o_rank = c["moe_intermediate_size"], c["o_groups"], c["o_lora_rank"]
    shapes = {f"{prefix}.hc_{site}_{part}": shape for site in ("attn", "ffn")
              for part, shape in (("fn", ((2 + hc) * hc, hc * hidden)), ("base", ((2 + hc) * hc,)), ("scale", (3,)))}
    shapes |= {
        f"{prefix}.attn_norm.weight": (hidden,),
        f"{prefix}.ffn_norm.weight": (hidden,),
        f"{prefix}.attn.wq_a.weight": (c["q_lora_rank"], hidden),
        f"{prefix}.attn.q_norm.weight": (c["q_lora_rank"],),
        f"{prefix}.attn.wq_b.weight": (heads * head_dim, c["q_lora_rank"]),
        f"{prefix}.attn.wkv.weight": (head_dim, hidden),
        f"{prefix}.attn.kv_norm.weight": (head_dim,),
        f"{prefix}.attn.wo_a.weight": (groups * o_rank, heads * head_dim // groups),
        f"{prefix}.attn.wo_b.weight": (hidden, groups * o_rank),
        f"{prefix}.attn.attn_sink": (heads,),
        f"{prefix}.ffn.gate.weight": (experts, hidden),
        f"{prefix}.ffn.gate.bias": (experts,),
        f"{prefix}.ffn.gate.bias_vl": (experts,),
    }
    for expert in [*(f"experts.{e}" for e in range(experts)), "shared_experts"]:
        shapes |= {f"{prefix}.ffn.{expert}.w1.weight": (inter, hidden),
                   f"{prefix}.ffn.{expert}.w3.weight": (inter, hidden),
                   f"{prefix}.ffn.{expert}.w2.weight": (hidden, inter)}
    if layer < c["num_hidden_layers"]:
        ratio = c["compress_ratios"][layer]
        if layer in c["kv_source_layer_ids"]:
            shapes |= {f"{prefix}.attn.compressor.wkv.weight": (head_dim, hidden),
                       f"{prefix}.attn.compressor.norm.weight": (head_dim,)}
            if ratio > 1:
                shapes[f"{prefix}.attn.compressor.wgate.weight"] = (head_dim, hidden)
            shapes |= {f"{prefix}.attn.indexer.wk.weight": (c["index_head_dim"], head_dim),
                       f"{prefix}.attn.indexer.k_norm.weight": (c["index_head_dim"],)}
        if layer in c["index_source_layer_ids"]:
            index_width = c["index_n_heads"] * c["index_head_dim"]
            shapes |= {f"{prefix}.attn.indexer.wq_b.weight": (index_width, c["q_lora_rank"]),
                       f"{prefix}.attn.indexer.weights_proj.weight": (c["index_n_heads"], hidden)}
        if layer in c["engram_layer_ids"]:
            rows = c["engram_num_embeddings"][c["engram_layer_ids"].index(layer)]
            columns = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"] * c["engram_head_dim"]
            shapes |= {f"{prefix}.engram.embed.weight": (rows, c["engram_head_dim"]),
                       f"{prefix}.engram.embed.scale": (rows, c["engram_head_dim"] // 32),
                       f"{prefix}.engram.wkv.weight": (hidden * (hc + 1), columns),
                       f"{prefix}.engram.q_weight": (hc, hidden),
                       f"{prefix}.engram.k_weight": (hc, hidden)}
    return shapes


def deepseek_v41_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    c = config["text_config"]
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    shapes = {"model.embed.weight": (vocab, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for layer in range(c["num_hidden_layers"]):
        shapes |= _block_shapes(c, f"model.layers.{layer}", layer, c["n_routed_experts"])
    stages = c["num_nextn_predict_layers"]
    for stage in range(stages):
        shapes |= _block_shapes(c, f"mtp.{stage}", c["num_hidden_layers"] + stage, c["dspark_n_routed_experts"])
    if stages:
        shapes |= {"mtp.0.main_proj.weight": (hidden, hidden * len(c["dspark_target_layer_ids"])),
                   "mtp.0.main_norm.weight": (hidden,),
                   f"mtp.{stages - 1}.norm.weight": (hidden,),
                   f"mtp.{stages - 1}.markov_head.embed.weight": (vocab, c["dspark_markov_rank"]),
                   f"mtp.{stages - 1}.markov_head.head.weight": (vocab, c["dspark_markov_rank"]),
                   f"mtp.{stages - 1}.confidence_head.proj.weight": (1, hidden + c["dspark_markov_rank"])}
    shapes |= {f"image_{name}": (hidden,) for name in ("start", "end", "newline")}
    return shapes


def deepseek_v41_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith(("norm.weight", "_scale", "q_weight", "k_weight")):
        return 1.0 + 0.1 * values                    # norms, hc scales, Engram gate weights around 1
    if name.endswith("engram.embed.scale"):
        return torch.ones(shape)                     # a float table is used as it is; the FP8 scales are 1
    if name.endswith(("attn_sink", "_base")):
        return 0.5 * values                          # sink logits and hc biases with real spread
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.1 * values                          # selection biases, text and image apart
    if name.endswith("_fn"):
        return 0.05 * values                         # hc mappings read hc_mult * hidden normalised inputs
    if name.endswith("engram.embed.weight") or len(shape) == 1:
        return values                                # table rows and image delimiters: unit variance
    return values * shape[-1] ** -0.5                # matrices: unit-variance outputs for unit inputs


def write_deepseek_v41_tiny(folder: str | Path, config: dict = DEEPSEEK_V41_TINY) -> None:
    """Write the DeepSeek-V4.1 checkpoint of `config` (default: the tiny one) into `folder`: config.json,
    model.safetensors of this module's random tensors, and the tokenizer.json of `tiny_vocabulary` at its vocab_size
    (its Engram classes: `engram_classes`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: deepseek_v41_tensor(name, shape) for name, shape in sorted(deepseek_v41_shapes(config).items())}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer = tokenizer_json(config["text_config"]["vocab_size"])
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2, ensure_ascii=False) + "\n",
                                           encoding="utf-8")


# --- the release layout (tiny_checkpoints/deepseek-v41-tiny-native) ---------------------------------------
# tensors a text-only import carries through (vision tower, aligner) in the release's bf16, besides image_*
CARRIED_VISION = {"vision.patch_embed.weight": (32, 3 * 14 * 14), "vision.norm.weight": (32,),
                  "aligner.proj.weight": (64, 32 * 9)}


def native_tiny_config() -> dict:
    """The tiny config with widths that are not multiples of the 32-blocks: q_lora_rank 48 (wq_a ends in a partial
    row block, wq_b and indexer.wq_b in a partial column block) and moe_intermediate_size 48 (the routed w1 / w3 end in a
    partial FP4 row, the shared ones in a partial FP8 row block, w2 in partial column blocks)."""
    return {**DEEPSEEK_V41_TINY, "text_config": {**DEEPSEEK_V41_TINY_TEXT, "q_lora_rank": 48,
                                                  "moe_intermediate_size": 48}}


def tiny_native_tensors(config: dict) -> dict[str, torch.Tensor]:
    """The tiny tensors of `config` in the release's names and precision (modelzoo/deepseek_v41/release.py), E8M0
    scales; the Engram tables quantised with their own scales (1 x 32 blocks), the rest kept in float32."""
    from modelzoo.deepseek_v4.release import quantization as q
    from modelzoo.deepseek_v41.release import ENGRAM_TABLE_BLOCK, FP8_BLOCK, hf_to_native, is_engram_table, \
        release_format

    out = {}
    for hf_name, shape in sorted(deepseek_v41_shapes(config).items()):
        name, tensor = hf_to_native(hf_name), deepseek_v41_tensor(hf_name, shape)
        if hf_name.endswith("engram.embed.scale"):
            continue  # written with its table
        if is_engram_table(hf_name):
            out[name], out[name.removesuffix(".weight") + ".scale"] = q.quantize_fp8(
                tensor, q.E8M0, name=name, block=ENGRAM_TABLE_BLOCK)
        elif (fmt := release_format(name)) is not None:
            out[name], out[name.removesuffix(".weight") + ".scale"] = q.quantize(tensor, fmt, q.E8M0, name,
                                                                                 block=FP8_BLOCK)
        else:
            out[name] = tensor
    for name, shape in CARRIED_VISION.items():
        out[name] = deepseek_v41_tensor(name, shape).to(torch.bfloat16)
    return dict(sorted(out.items()))


def write_deepseek_v41_tiny_native(folder: str | Path, shard_bytes: int = 256 * 1024) -> None:
    """Write tiny_checkpoints/deepseek-v41-tiny-native: the tiny model (native_tiny_config) drawn by this module's
    generator, in the release's names and precision, sharded into several files (so imports read across shards),
    with the tiny tokenizer.json and a vision tower and aligner to carry through."""
    from modelzoo.deepseek_v4.release.checkpoint import export_config
    from modelzoo.deepseek_v41.release import DEEPSEEK_V41
    from tiny_checkpoints.deepseek_v4_tiny import write_shards

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = native_tiny_config()
    write_shards(folder, tiny_native_tensors(config), shard_bytes)
    (folder / "config.json").write_text(json.dumps(export_config(config, "fp8", "mxfp4", "e8m0", DEEPSEEK_V41),
                                                   indent=2, sort_keys=True) + "\n")
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(), indent=2, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
