"""DeepSeek-V4 release checkpoints: native tensor names, FP8 block-scaled and MXFP4 weights.

The release (deepseek-ai's own layout, what transformers' conversion_mapping "deepseek_v4" renames on
load) differs from the HF names of mapping.py in two ways:
  names      `embed.weight`, `layers.N.*`, `norm.weight`, `hc_head_{fn,base,scale}`, `layers.N.attn.kv_norm`
             against mapping.py's `model.embed_tokens.weight`, `model.layers.N.*`, `model.norm.weight`,
             `model.hc_head.hc_*`, `model.layers.N.attn.norm`; `head.weight` and `mtp.K.*` are the same.
  precision  attention and shared-expert matrices FP8 E4M3 with a scale per 128x128 block (`<x>.scale`,
             E8M0 or F32); routed experts MXFP4 (post-trained Flash) or FP8 (base). Everything else
             (embeddings, head, norms, hyper-connections, router, compressors) stays unquantised.
Both tables below are data; `NAMES` maps native <-> bridge HF, `RELEASE_FP8` / `RELEASE_EXPERTS` say
which native weights are quantised when we write the release layout. Reading does not use the
precision table: any weight that has a scale is dequantised.

    view = checkpoint_view(folder, dtype)            # a CheckpointReader over native or HF names
    save(provider, model, out_dir, naming="native", quantize="fp8")

The machinery takes the release it reads or writes as a `ReleaseFormat` (names, precision table, FP8 block,
scales the model holds itself): DeepSeek-V4's is `DEEPSEEK_V4`, DeepSeek-V4.1's is in modelzoo/deepseek_v41/release.py.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from modelzoo.conversion.files import confined, read_json
from modelzoo.conversion.safetensors_io import CheckpointError, CheckpointReader
from modelzoo.deepseek_v4.release import quantization as q
from modelzoo.deepseek_v4.release.quantization import Block
from modelzoo.deepseek_v4.release.view import KEPT_SCALES_DIR, CheckpointView, KeptScales, quantize_stream

# native -> bridge HF, whole names (checked first), then prefixes; MTP names are the same in both
NAMES_EXACT = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
NAMES_LAYER = [  # (native regex, HF template) for main-stack layers
    (r"^layers\.(\d+)\.attn\.kv_norm\.weight$", r"model.layers.\1.attn.norm.weight"),
    (r"^layers\.(\d+)\.(.+)$", r"model.layers.\1.\2"),
]
HF_LAYER = [
    (r"^model\.layers\.(\d+)\.attn\.norm\.weight$", r"layers.\1.attn.kv_norm.weight"),
    (r"^model\.layers\.(\d+)\.(.+)$", r"layers.\1.\2"),
]

# which native weights the release stores quantised (leaf patterns, after `layers.N.` or `mtp.K.`)
RELEASE_FP8 = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                         r"|ffn\.shared_experts\.w[123])\.weight$")
RELEASE_EXPERTS = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [q.FP8_BLOCK, q.FP8_BLOCK],
                       "activation_scheme": "dynamic"}
SCALE_FORMATS = {"e8m0": q.E8M0, "ue8m0": q.E8M0, "f32": torch.float32, "float32": torch.float32}


def _rename(name: str, exact: dict[str, str], layer_rules: list[tuple[str, str]], naming: str) -> str:
    if name in exact:
        return exact[name]
    for pattern, template in layer_rules:
        if re.match(pattern, name):
            return re.sub(pattern, template, name)
    if name.startswith("mtp."):
        return name
    raise CheckpointError(f"{name}: not a DeepSeek-V4 {naming} tensor name")


_HF_EXACT = {hf: native for native, hf in NAMES_EXACT.items()}


def native_to_hf(name: str) -> str:
    return _rename(name, NAMES_EXACT, NAMES_LAYER, "native")


def hf_to_native(name: str) -> str:
    return _rename(name, _HF_EXACT, HF_LAYER, "HF")


def _base_name(name: str) -> str:
    """The weight a (native or HF) name belongs to, scales mapped to their weight."""
    for suffix in (".scale", ".weight_scale_inv"):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return name


def is_native(names) -> bool:
    """Native naming: the release's top-level names (`embed.weight`, `layers.N.*`), not `model.*`."""
    names = list(names)
    native = any(n == "embed.weight" or n.startswith("layers.") for n in names)
    hf = any(n.startswith("model.") for n in names)
    if native and hf:
        raise CheckpointError("the checkpoint mixes native names (embed.weight, layers.N.*) and HF names (model.*)")
    return native


def release_format(native_name: str, experts: str = "mxfp4") -> str | None:
    """'fp8' | 'mxfp4' | None: how the release stores this native weight (`experts`: 'mxfp4' | 'fp8')."""
    if RELEASE_FP8.match(native_name):
        return "fp8"
    if RELEASE_EXPERTS.match(native_name):
        return experts
    return None


def _no_own_scales(name: str) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class ReleaseFormat:
    """A vendor release's names and precision beside the HF names of an architecture's mapping.py."""

    native_to_hf: Callable[[str], str]
    hf_to_native: Callable[[str], str]
    is_native: Callable[[Iterable[str]], bool]              # whether a checkpoint's tensor names are native
    release_format: Callable[[str, str], str | None]        # (native name, experts) -> 'fp8' | 'mxfp4' | None
    routed_experts: re.Pattern                              # native names of routed-expert weights
    weight_block_size: Block = q.FP8_BLOCK_2D               # the FP8 block (quantization_config.weight_block_size)
    fp8_blocks: tuple[tuple[re.Pattern, Block], ...] = ()   # HF names whose FP8 block is another one
    # whether a stored weight's `.scale` is a tensor of the model (both shown, re-quantised as a pair)
    own_scale: Callable[[str], bool] = _no_own_scales

    def fp8_block(self, hf_name: str) -> Block:
        return next((block for pattern, block in self.fp8_blocks if pattern.match(hf_name)), self.weight_block_size)


def checkpoint_view(folder_or_reader, dtype: torch.dtype = torch.float32, naming: str | None = None,
                    release: ReleaseFormat | None = None) -> CheckpointView:
    """The checkpoint under mapping.py's HF names, dequantised into `dtype` on read.

    `naming`: 'native' | 'hf' | None (detected from the tensor names). `release`: DeepSeek-V4's by default.
    """
    release = release or DEEPSEEK_V4
    reader = folder_or_reader if isinstance(folder_or_reader, CheckpointReader) else CheckpointReader(folder_or_reader)
    if naming is None:
        naming = "native" if release.is_native(reader.names()) else "hf"
    if naming not in ("native", "hf"):
        raise ValueError(f"naming={naming!r} is not 'native' or 'hf'")
    return CheckpointView(reader, rename=release.native_to_hf if naming == "native" else None, dtype=dtype,
                          fp8_block=release.fp8_block, own_scale=release.own_scale)


def _own_scale_pairs(tensors: Iterable[tuple[str, torch.Tensor]], release: ReleaseFormat, quantize: str | None,
                     scale_dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Weights whose scale the model holds (`release.own_scale`, HF names `<x>.weight` + `<x>.scale`): with
    `quantize`, each pair re-quantised together into FP8 codes and a `scale_dtype` scale, the model's own scale
    kept wherever it still encodes the values exactly (so an untrained pair comes back bit for bit)."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        weight = name[: -len(".scale")] + ".weight" if name.endswith(".scale") else name
        if not (quantize and release.own_scale(weight)):
            yield name, tensor
            continue
        pair = waiting.setdefault(weight, {})
        pair["scale" if name != weight else "weight"] = tensor
        if len(pair) < 2:
            continue
        del waiting[weight]
        block = release.fp8_block(weight)
        values = q.apply_block_scale(pair["weight"].to(torch.float32, copy=True), pair["scale"], block)  # in place
        own = pair["scale"].to(torch.float32)
        keep = own if scale_dtype == torch.float32 else q.e8m0_rounded_down(own, scale_dtype)
        codes, scale = q.quantize_fp8(values, scale_dtype, name=weight, keep_scale=keep, block=block)
        yield weight, codes
        yield weight[: -len(".weight")] + ".scale", scale
    if waiting:
        raise CheckpointError(f"{sorted(waiting)[0]}: its weight and .scale did not both reach the export")


def export_weights(provider, model, naming: str = "native", quantize: str | None = None, experts: str | None = None,
                   scale_format: str = "e8m0", dtype: torch.dtype | None = None,
                   kept: KeptScales | None = None,
                   release: ReleaseFormat | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(name, tensor)` in `naming` ('native' | 'hf'); `quantize='fp8'` writes the release precision:
    FP8 blocks (the release's: V4 128x128) with scales in `scale_format`, routed experts in `experts` ('mxfp4' |
    'fp8'; None: as the source stored them, else mxfp4). With `kept` (the source's KeptScales) the weights the source
    quantised are the ones quantised, in its formats, with its scales wherever they still encode a weight
    exactly; without, the release table decides (`release`: DeepSeek-V4's by default)."""
    release = release or DEEPSEEK_V4
    if naming not in ("native", "hf"):
        raise ValueError(f"naming={naming!r} is not 'native' or 'hf'")
    if quantize not in (None, "fp8"):
        raise ValueError(f"quantize={quantize!r} is not None or 'fp8'")
    if experts not in (None, "mxfp4", "fp8"):
        raise ValueError(f"experts={experts!r} is not 'mxfp4' or 'fp8'")
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format={scale_format!r} is not one of {sorted(SCALE_FORMATS)}")
    rename = release.hf_to_native if naming == "native" else (lambda name: name)

    def fmt_of(name: str) -> str | None:
        if not quantize or release.own_scale(name[: -len(".scale")] + ".weight" if name.endswith(".scale") else name):
            return None  # own-scale pairs: quantised by _own_scale_pairs
        native_name = release.hf_to_native(name)
        if kept is None:
            return release.release_format(native_name, experts or "mxfp4")
        fmt = kept.format(name)
        return experts if fmt is not None and experts is not None and release.routed_experts.match(native_name) else fmt

    scale_dtype = SCALE_FORMATS[scale_format]
    tensors = _own_scale_pairs(provider.export_hf_weights(model), release, quantize, scale_dtype)
    return quantize_stream(tensors, rename, fmt_of, naming, scale_dtype, dtype, kept, fp8_block=release.fp8_block)


def _expert_format(kept: KeptScales | None, release: ReleaseFormat) -> str:
    """How the source stored its routed experts ('mxfp4' if it kept no scales for them)."""
    formats = kept.formats if kept is not None else {}
    return next((fmt for name, fmt in formats.items() if release.routed_experts.match(release.hf_to_native(name))),
                "mxfp4")


def source_scale_format(folder) -> str:
    """The source's FP8 scale format: config.json's quantization_config.scale_fmt ('ue8m0' -> 'e8m0'; an FP8
    quantization_config without it is DeepSeek-V3 style, 'f32'), else the dtype of its first FP8 scale
    tensor, else 'e8m0'. (A Megatron checkpoint keeps the source config.json in hf/, so export sees it.)"""
    folder = Path(folder)
    config_file = folder / "config.json"
    if config_file.exists():
        qc = read_json(config_file, folder).get("quantization_config") or {}
        if qc.get("quant_method") == "fp8":
            return "e8m0" if str(qc.get("scale_fmt", "float32")).lower() in ("ue8m0", "e8m0") else "f32"
    if not any(folder.glob("*.safetensors")):
        return "e8m0"
    reader = CheckpointReader(folder)
    for name, info in reader.tensors.items():
        if name.endswith((".scale", ".weight_scale_inv")) and reader.tensors[_base_name(name)].dtype == torch.float8_e4m3fn:
            return "f32" if info.dtype == torch.float32 else "e8m0"
    return "e8m0"


def export_config(config: dict, quantize: str | None, experts: str, scale_format: str,
                  release: ReleaseFormat | None = None) -> dict:
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if quantize:
        block = list((release or DEEPSEEK_V4).weight_block_size)
        config["quantization_config"] = {**QUANTIZATION_CONFIG, "weight_block_size": block,
                                         "scale_fmt": "ue8m0" if SCALE_FORMATS[scale_format] != torch.float32 else "float32",
                                         "expert_dtype": "fp4" if experts == "mxfp4" else "fp8"}
    return config


def save(provider, model, out_dir, naming: str = "native", quantize: str | None = None, experts: str | None = None,
         scale_format: str | None = None, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
         source_dir=None, release: ReleaseFormat | None = None) -> int:
    """Write a checkpoint folder atomically (rank 0; collective like provider.save_hf). Returns bytes written.

    `scale_format=None` keeps the source checkpoint's FP8 scale format (F32 or E8M0; E8M0 if it had none).
    `release`: DeepSeek-V4's by default.
    """
    release = release or DEEPSEEK_V4
    import torch.distributed as dist

    from modelzoo.conversion.safetensors_io import ShardedWriter
    from modelzoo.provider import TOKENIZER_FILES

    source = Path(source_dir) if source_dir is not None else provider.hf_dir
    if scale_format is None:
        scale_format = source_scale_format(source) if source is not None else "e8m0"
    kept_folder = source / KEPT_SCALES_DIR if source is not None else None
    kept = KeptScales(confined(kept_folder, source, folder=True), release.fp8_block) \
        if quantize and kept_folder is not None and kept_folder.is_dir() else None
    experts = experts or _expert_format(kept, release)
    try:
        tensors = export_weights(provider, model, naming, quantize, experts, scale_format, dtype, kept, release)
        if dist.is_initialized() and dist.get_rank() != 0:
            for _ in tensors:
                pass
            return 0
        config = read_json(source / "config.json", source) \
            if source is not None and (source / "config.json").exists() else provider.hf_config.to_dict()
        with ShardedWriter(out_dir, max_shard_bytes) as writer:
            for name, tensor in tensors:
                writer.add(name, tensor)
            writer.write_json("config.json", export_config(config, quantize, experts, scale_format, release))
            for file_name in TOKENIZER_FILES:
                if source is not None and (source / file_name).exists():
                    writer.copy_file(source / file_name, source)
        return writer.total_bytes
    finally:
        if kept is not None:
            kept.close()


DEEPSEEK_V4 = ReleaseFormat(native_to_hf=native_to_hf, hf_to_native=hf_to_native, is_native=is_native,
                            release_format=release_format, routed_experts=RELEASE_EXPERTS)
