"""The tiny random DeepSeek-V4 checkpoint, byte for byte reproducible.

    write_deepseek_v4_tiny(folder)          # config.json + model.safetensors
    write_deepseek_v4_tiny_native(folder)   # the release layout: native names, FP8 / MXFP4, sharded

The config is written by hand and covers every code path at a test-sized scale: all three
attention types (sliding, CSA with the indexer, HCA), hash-routed and learned-routed MoE layers,
hc_mult=4 streams (with 2 streams a doubly-stochastic mixer is symmetric and a transposed `comb`
would go unnoticed), a sliding window (16) and compression rates (4, 16) below a 64-token test
sequence, an indexer top-k (4) below the 16 compressed entries, a YaRN "compress" RoPE, a
swiglu_limit (1.0) that actually clamps, a vocabulary (250) that Megatron pads, and one MTP layer.
Tensor names are those transformers' `save_pretrained` writes (see mapping.py), plus `mtp.0.*`.
Every tensor is drawn from a generator seeded by zlib.crc32(name), like tiny_checkpoints/make_tiny.py.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from modelzoo.conversion.safetensors_io import INDEX_FILE
from modelzoo.deepseek_v4.release import quantization as q
from modelzoo.deepseek_v4.release.checkpoint import SCALE_FORMATS, export_config, hf_to_native, release_format

DEEPSEEK_V4_TINY = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 250,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 16,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 1.0,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                        "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def _layer_shapes(c: dict, prefix: str, layer_type: str, mlp_type: str, kv_norm: str) -> dict[str, tuple[int, ...]]:
    hidden, heads, d, hc = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["hc_mult"]
    experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    shapes = {f"{prefix}.hc_{m}_{p}": s for m in ("attn", "ffn")
              for p, s in (("fn", ((2 + hc) * hc, hc * hidden)), ("base", ((2 + hc) * hc,)), ("scale", (3,)))}
    shapes |= {
        f"{prefix}.attn_norm.weight": (hidden,),
        f"{prefix}.ffn_norm.weight": (hidden,),
        f"{prefix}.attn.wq_a.weight": (c["q_lora_rank"], hidden),
        f"{prefix}.attn.q_norm.weight": (c["q_lora_rank"],),
        f"{prefix}.attn.wq_b.weight": (heads * d, c["q_lora_rank"]),
        f"{prefix}.attn.wkv.weight": (d, hidden),
        f"{prefix}.attn.{kv_norm}.weight": (d,),
        f"{prefix}.attn.wo_a.weight": (c["o_groups"] * c["o_lora_rank"], heads * d // c["o_groups"]),
        f"{prefix}.attn.wo_b.weight": (hidden, c["o_groups"] * c["o_lora_rank"]),
        f"{prefix}.attn.attn_sink": (heads,),
        f"{prefix}.ffn.gate.weight": (experts, hidden),
        f"{prefix}.ffn.shared_experts.w1.weight": (inter, hidden),
        f"{prefix}.ffn.shared_experts.w3.weight": (inter, hidden),
        f"{prefix}.ffn.shared_experts.w2.weight": (hidden, inter),
    }
    for e in range(experts):
        shapes |= {f"{prefix}.ffn.experts.{e}.w1.weight": (inter, hidden), f"{prefix}.ffn.experts.{e}.w3.weight": (inter, hidden),
                   f"{prefix}.ffn.experts.{e}.w2.weight": (hidden, inter)}
    shapes[f"{prefix}.ffn.gate.tid2eid" if mlp_type == "hash_moe" else f"{prefix}.ffn.gate.bias"] = (
        (c["vocab_size"], c["num_experts_per_tok"]) if mlp_type == "hash_moe" else (experts,))
    if layer_type != "sliding_attention":
        csa = layer_type == "compressed_sparse_attention"
        ratio, width = c["compress_rates"][layer_type], (2 if csa else 1) * d
        shapes |= {f"{prefix}.attn.compressor.wkv.weight": (width, hidden),
                   f"{prefix}.attn.compressor.wgate.weight": (width, hidden),
                   f"{prefix}.attn.compressor.ape": (ratio, width),
                   f"{prefix}.attn.compressor.norm.weight": (d,)}
        if csa:
            ih, idim = c["index_n_heads"], c["index_head_dim"]
            shapes |= {f"{prefix}.attn.indexer.compressor.wkv.weight": (2 * idim, hidden),
                       f"{prefix}.attn.indexer.compressor.wgate.weight": (2 * idim, hidden),
                       f"{prefix}.attn.indexer.compressor.ape": (ratio, 2 * idim),
                       f"{prefix}.attn.indexer.compressor.norm.weight": (idim,),
                       f"{prefix}.attn.indexer.wq_b.weight": (ih * idim, c["q_lora_rank"]),
                       f"{prefix}.attn.indexer.weights_proj.weight": (ih, hidden)}
    return shapes


def deepseek_v4_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    hidden, hc, vocab = c["hidden_size"], c["hc_mult"], c["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "model.hc_head.hc_fn": (hc, hc * hidden), "model.hc_head.hc_base": (hc,), "model.hc_head.hc_scale": (1,)}
    if not c.get("tie_word_embeddings"):  # tied: the head is the embedding matrix, not stored
        shapes["head.weight"] = (vocab, hidden)
    for layer, (layer_type, mlp_type) in enumerate(zip(c["layer_types"], c["mlp_layer_types"])):
        shapes |= _layer_shapes(c, f"model.layers.{layer}", layer_type, mlp_type, kv_norm="norm")
    for k in range(c.get("num_nextn_predict_layers", 0)):
        prefix = f"mtp.{k}"
        shapes |= _layer_shapes(c, prefix, "sliding_attention", "moe", kv_norm="kv_norm")
        shapes |= {f"{prefix}.{n}.weight": (hidden,) for n in ("enorm", "hnorm", "norm")}
        shapes |= {f"{prefix}.{n}.weight": (hidden, hidden) for n in ("e_proj", "h_proj")}
        shapes |= {f"{prefix}.hc_head_fn": (hc, hc * hidden), f"{prefix}.hc_head_base": (hc,), f"{prefix}.hc_head_scale": (1,)}
    return shapes


def deepseek_v4_tensor(name: str, shape: tuple[int, ...], config: dict) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith("tid2eid"):  # distinct experts per token, uniformly drawn
        scores = torch.rand((shape[0], config["n_routed_experts"]), generator=generator)
        return scores.argsort(dim=-1)[:, : shape[1]].contiguous().to(torch.int64)
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("norm.weight") or "scale" in name.rsplit(".", 1)[-1]:
        return 1.0 + 0.1 * values                    # norms and hyper-connection scales around 1
    if name.endswith(("attn_sink", ".ape", "_base", "hc_base")):
        return 0.5 * values                          # sink logits, pooling biases, hc biases with real spread
    if name.endswith("gate.bias"):
        return 0.1 * values                          # router correction bias
    if name.endswith(("_fn", "hc_fn")):
        return 0.05 * values                         # hc mappings read hc_mult * hidden normalised inputs
    return values * shape[-1] ** -0.5                # matrices: unit-variance outputs for unit inputs


def write_deepseek_v4_tiny(folder: str | Path, config: dict | None = None) -> None:
    """Write the tiny DeepSeek-V4 checkpoint (config.json + model.safetensors) into `folder`."""
    folder = Path(folder)
    config = dict(DEEPSEEK_V4_TINY if config is None else config)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: deepseek_v4_tensor(name, shape, config) for name, shape in sorted(deepseek_v4_shapes(config).items())}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# --- the release layout (tiny_checkpoints/deepseek-v4-tiny-native) ---------------------------------------
def native_tiny_config() -> dict:
    """The tiny config with dims that are not multiples of the block sizes: q_lora_rank 144 = 128 + 16
    (wq_a has a partial second row block, wq_b and indexer.wq_b a partial second column block) and
    moe_intermediate_size 48 = 32 + 16 (expert w2 rows end in a partial MXFP4 block); every other FP8
    matrix is one partial 128x128 block."""
    return {**DEEPSEEK_V4_TINY, "q_lora_rank": 144, "moe_intermediate_size": 48}


def tiny_native_tensors(config: dict, scale_format: str = "e8m0") -> dict[str, torch.Tensor]:
    out = {}
    for hf_name, shape in sorted(deepseek_v4_shapes(config).items()):
        name = hf_to_native(hf_name)
        tensor = deepseek_v4_tensor(hf_name, shape, config)
        fmt = release_format(name)
        if fmt is None:
            out[name] = tensor
        else:
            out[name], out[name[: -len(".weight")] + ".scale"] = q.quantize(tensor, fmt, SCALE_FORMATS[scale_format], name)
    return out


def write_shards(folder: Path, tensors: dict[str, torch.Tensor], shard_bytes: int) -> None:
    """`tensors` (in their order) in model-0000k-of-0000n.safetensors files of at most `shard_bytes` (a tensor
    larger than that alone), with their index; older model*.safetensors in `folder` removed."""
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():  # sorted by name; deterministic
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    for stale in folder.glob("model*.safetensors"):
        stale.unlink()
    weight_map = {}
    for number, shard in enumerate(shards):
        file = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2, sort_keys=True) + "\n")


def write_deepseek_v4_tiny_native(folder, scale_format: str = "e8m0", shard_bytes: int = 256 * 1024) -> None:
    """Write tiny_checkpoints/deepseek-v4-tiny-native: the tiny model (native_tiny_config) drawn by
    write_deepseek_v4_tiny's generator, quantised into the release layout by modelzoo/deepseek_v4/release/quantization.py, in native names, sharded
    into several files (model-0000k-of-0000n.safetensors + index) so that imports read across shards.
    Non-quantised tensors keep the tiny's float32."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = native_tiny_config()
    tensors = tiny_native_tensors(config, scale_format)
    write_shards(folder, tensors, shard_bytes)
    (folder / "config.json").write_text(json.dumps(export_config(config, "fp8", "mxfp4", scale_format),
                                                   indent=2, sort_keys=True) + "\n")
