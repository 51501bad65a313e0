"""DeepSeek-V4.1's release checkpoint: its native names and precision, read and written by DeepSeek-V4's release
machinery (modelzoo/deepseek_v4/release/), described here as a `ReleaseFormat`.

names      the release's names are transformers main's (mapping.py) without `model.`, with `head` for `lm_head`:
           `embed.weight`, `layers.N.*`, `norm.weight`, `head.weight`; `mtp.K.*`, `vision.*`, `aligner.*` and
           `image_*` are the same in both.
precision  config.json's quantization_config: fp8, `weight_block_size` [32, 32], ue8m0 scales, `expert_dtype` fp4.
           FP8 E4M3, one E8M0 scale per 32 x 32 block: the attention's wq_a, wq_b, wkv, wo_a, wo_b, the indexer's
           wq_b, the shared expert's w1, w2, w3 and the Engram's wkv (backbone and DSpark layers);
           FP4 (E2M1, two per int8 byte), one E8M0 scale per 32 elements of a row: the routed experts;
           the Engram tables FP8, one E8M0 scale per 32 channels of a row (a 1 x 32 block): a scale the model holds
           itself (`engram.embed.scale`, multiplied in at the lookup), so both are read as tensors of their own;
           everything else unquantised (embeddings, head, norms, hyper-connections, router and its biases,
           compressors, the indexer's wk and weights_proj, Engram q / k weights, DSpark heads, vision tower).
Reading does not use the precision table: any weight with a scale is dequantised (an Engram table is read as its
codes and its scale). Writing with `--quantize fp8` quantises what the source quantised, with its scales
wherever they still encode the weights exactly (an import keeps them), else what the table above says.
"""

from __future__ import annotations

import re

from modelzoo.conversion.safetensors_io import CheckpointError
from modelzoo.deepseek_v4.release.checkpoint import RELEASE_EXPERTS, ReleaseFormat, is_native
from modelzoo.deepseek_v41.config import ENGRAM_SCALE_BLOCK

FP8_BLOCK = (32, 32)
ENGRAM_TABLE_BLOCK = (1, ENGRAM_SCALE_BLOCK)
RELEASE_FP8 = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                         r"|ffn\.shared_experts\.w[123]|engram\.wkv)\.weight$")
ENGRAM_TABLE = re.compile(r"^(model\.)?layers\.\d+\.engram\.embed\.weight$")  # either naming
_NATIVE_UNDER_MODEL = ("embed.", "norm.", "layers.")
_NATIVE_AS_HF = ("mtp.", "vision.", "aligner.", "image_")  # the same name in both namings


def hf_to_native(name: str) -> str:
    """A transformers main name (mapping.py's) -> the release's."""
    return "head.weight" if name == "lm_head.weight" else name.removeprefix("model.")


def native_to_hf(name: str) -> str:
    if name == "head.weight":
        return "lm_head.weight"
    if name.startswith(_NATIVE_UNDER_MODEL):
        return f"model.{name}"
    if name.startswith(_NATIVE_AS_HF):
        return name
    raise CheckpointError(f"{name}: not a DeepSeek-V4.1 native tensor name (the release's names are embed.*, "
                          f"layers.N.*, norm.*, head.weight, mtp.K.*, vision.*, aligner.*, image_*)")


def release_format(native_name: str, experts: str = "mxfp4") -> str | None:
    """'fp8' | 'mxfp4' | None: how the release stores this native weight (`experts`: 'mxfp4' | 'fp8'). The
    Engram tables are quantised as a pair with the scale the model holds (`ReleaseFormat.own_scale`)."""
    if RELEASE_FP8.match(native_name):
        return "fp8"
    if RELEASE_EXPERTS.match(native_name):
        return experts
    return None


def is_engram_table(name: str) -> bool:
    return ENGRAM_TABLE.match(name) is not None


DEEPSEEK_V41 = ReleaseFormat(native_to_hf=native_to_hf, hf_to_native=hf_to_native, is_native=is_native,
                             release_format=release_format, routed_experts=RELEASE_EXPERTS,
                             weight_block_size=FP8_BLOCK, fp8_blocks=((ENGRAM_TABLE, ENGRAM_TABLE_BLOCK),),
                             own_scale=is_engram_table)
