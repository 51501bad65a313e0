"""Make the tiny random checkpoints in this folder, byte for byte reproducibly.

    python -m tiny_checkpoints.make_tiny [OUT_DIR]        # from the repository root; default: this folder

Configs are written by hand (not by a transformers version's `to_dict`) and every tensor is drawn
from its own generator seeded by its name, so the bytes do not depend on library versions or on
the order in which tensors are made. Norm weights are drawn around 1 and LoopCoder's gates around 0
with real spread, so a mapping that swaps or drops a tensor changes the logits.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from modelzoo.conversion.safetensors_io import ShardedWriter
from tiny_checkpoints.deepseek_v41_tiny import write_deepseek_v41_tiny, write_deepseek_v41_tiny_native
from tiny_checkpoints.deepseek_v4_tiny import write_deepseek_v4_tiny, write_deepseek_v4_tiny_native

HERE = Path(__file__).resolve().parent

LLAMA_TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

LOOPCODER_TINY = {
    **LLAMA_TINY,
    "architectures": ["IQuestLoopCoderForCausalLM"],
    "model_type": "iquestloopcoder",
    "loop_num": 2,
    "loop_window_size": 8,
    "rope_theta": 500000.0,
}


# vLLM's CPU attention needs head_dim >= 32, and its LoopCoder takes head_dim as hidden / heads: the engine tests
# (tests/engine) run these, with hidden = heads x head_dim. Their tensors have the tiny ones' names and sizes, so they
# hold the same values, read as 2 heads of 32
LLAMA_ENGINE_TINY = {**LLAMA_TINY, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
LOOPCODER_ENGINE_TINY = {**LOOPCODER_TINY, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_rows, kv_rows = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:  # tied: the head is the embedding matrix, not stored
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (q_rows, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_rows, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_rows, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, q_rows),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
            f"{prefix}.mlp.up_proj.weight": (inter, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inter),
        }
    return shapes


def loopcoder_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    shapes = llama_shapes(config)
    for layer in range(config["num_hidden_layers"]):
        shapes[f"model.gate_projections.{layer}.weight"] = (heads, head_dim)
        shapes[f"model.gate_projections.{layer}.bias"] = (heads,)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * values
    if "gate_projections" in name:
        return 0.5 * values  # gates spread around sigmoid(0) = 0.5, not stuck at upstream's zero init
    return 0.05 * values


def write_checkpoint(folder: Path, config: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: random_tensor(name, shape) for name, shape in sorted(shapes.items())}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_sharded_loopcoder(folder: Path, config: dict, max_shard_bytes: int) -> tuple[int, int]:
    """A large LoopCoder-shaped bf16 checkpoint in several shards (the streaming tests, the conversion
    benchmark): random weights from one seeded generator. Returns (total bytes, largest tensor's bytes)."""
    generator = torch.Generator().manual_seed(0)
    largest = 0
    with ShardedWriter(folder, max_shard_bytes=max_shard_bytes) as writer:
        for name, shape in sorted(loopcoder_shapes(config).items()):
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            largest = max(largest, tensor.nbytes)
            writer.add(name, tensor)
        writer.write_json("config.json", config)
    return writer.total_bytes, largest


CHECKPOINTS = {
    "llama-tiny": lambda folder: write_checkpoint(folder, LLAMA_TINY, llama_shapes(LLAMA_TINY)),
    "loopcoder-tiny": lambda folder: write_checkpoint(folder, LOOPCODER_TINY, loopcoder_shapes(LOOPCODER_TINY)),
    "llama-engine-tiny": lambda folder: write_checkpoint(folder, LLAMA_ENGINE_TINY, llama_shapes(LLAMA_ENGINE_TINY)),
    "loopcoder-engine-tiny": lambda folder: write_checkpoint(folder, LOOPCODER_ENGINE_TINY,
                                                             loopcoder_shapes(LOOPCODER_ENGINE_TINY)),
    "deepseek-v4-tiny": write_deepseek_v4_tiny,
    "deepseek-v4-tiny-native": write_deepseek_v4_tiny_native,
    "deepseek-v41-tiny": write_deepseek_v41_tiny,
    "deepseek-v41-tiny-native": write_deepseek_v41_tiny_native,
}


def main(out_dir: Path = HERE) -> None:
    for name, write in CHECKPOINTS.items():
        write(out_dir / name)
        print(f"wrote {out_dir / name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
