"""`build_provider` entry for DeepSeek-V4 (`model_type` "deepseek_v4")."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path

import torch
from transformers import DeepseekV4Config

from modelzoo.conversion import engine
from modelzoo.conversion.files import read_json
from modelzoo.conversion.safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointReader, ShardedWriter
from modelzoo.deepseek_v4 import config as v4_config
from modelzoo.deepseek_v4.mapping import deepseek_v4_mapping
from modelzoo.provider import ModelProvider
from modelzoo.registry import register

logger = logging.getLogger(__name__)


def checkpoint_lacks_mtp(folder: str | Path) -> bool:
    """Whether the checkpoint in `folder` holds no `mtp.*` tensor (native and HF names both start so); False for a
    folder without weights (the config-only HF side of a Megatron checkpoint)."""
    folder = Path(folder)
    if not ((folder / SINGLE_FILE).exists() or (folder / INDEX_FILE).exists()):
        return False
    reader = CheckpointReader(folder)
    try:
        return not any(name.startswith("mtp.") for name in reader.names())
    finally:
        reader.close()


@register
class DeepseekV4Provider(ModelProvider):
    """`attention`: "exact" (eager, the parity path) or "fast" (dense blocks of GEMMs, model/window_attention.py).
    `mtp_loss_scale`: weight of the MTP loss in `loss()` (0 = off); `build_mtp=False` drops the MTP layers.

    A checkpoint written by transformers' `save_pretrained` has no `mtp.*` tensors (transformers builds no MTP)
    while its config keeps `num_nextn_predict_layers`: its model is built without MTP layers, and reading its
    weights says so in one warning. `require_mtp=True` builds them anyway, so such a checkpoint is refused
    (missing tensors).

    `keep_attention_output=True` (with `attention="fast"` and `recompute_granularity="full"`): each recomputed
    layer keeps its attention kernels' output and log-sum-exp from the forward (at head_dim 512 x 16 heads in bf16,
    16 KiB per token and layer), so the backward's recompute does not run them again."""

    name = "deepseek_v4"
    hf_model_types = ("deepseek_v4",)
    hf_architectures = ("DeepseekV4ForCausalLM",)
    has_experts = True
    supports_context_parallel = True
    engine_naming = "native"  # vLLM and SGLang load V4 by its release names (hc_head, attn.norm, ... included)
    config_bounds = v4_config.CONFIG_BOUNDS
    weights_per_unit = v4_config.WEIGHTS_PER_UNIT
    recorded_options = {"build_mtp": bool}
    checkpoint_formats = {"native": "the release checkpoint's names, FP8 / MXFP4 weights (dequantised on import)"}
    cli_options = {
        "--require-mtp": {"commands": ("import", "logprobs", "parity"), "passed_to": "provider",
                          "action": "store_true", "default": False,
                          "help": "refuse a checkpoint without the MTP layers its config describes (default: load "
                                  "it without them, with a warning)"},
        "--quantize": {"commands": ("export",), "passed_to": "save", "choices": ("none", "fp8"), "default": "none",
                       "help": "fp8: re-quantise to the release layout (FP8 128x128 blocks, MXFP4 routed experts)"},
        "--experts": {"commands": ("export",), "passed_to": "save", "choices": ("mxfp4", "fp8"), "default": None,
                      "help": "routed-expert format with --quantize"},
        "--scale-format": {"commands": ("export",), "passed_to": "save", "choices": ("keep", "e8m0", "f32"),
                           "default": "keep", "help": "FP8 scale format (keep: the source checkpoint's)"},
    }

    def __init__(self, hf_config, hf_dir=None, attention: str = "exact", params_dtype: torch.dtype = torch.float32,
                 mtp_loss_scale: float = 0.0, build_mtp: bool = True, require_mtp: bool = False,
                 keep_attention_output: bool = False, **config_overrides):
        self.mtp_loss_scale, self.keep_attention_output = mtp_loss_scale, keep_attention_output
        self.mtp_not_in_checkpoint = bool(build_mtp and not require_mtp and hf_config.num_nextn_predict_layers
                                          and hf_dir is not None and checkpoint_lacks_mtp(hf_dir))
        self.build_mtp = build_mtp and not self.mtp_not_in_checkpoint
        self._mtp_warning_given = False
        super().__init__(hf_config, hf_dir=hf_dir, attention=attention, params_dtype=params_dtype, **config_overrides)

    @classmethod
    def hf_config_class(cls):
        return DeepseekV4Config

    def hf_model_class(self):
        from transformers import DeepseekV4ForCausalLM  # transformers' modeling code: for the parity oracle only

        return DeepseekV4ForCausalLM

    @contextlib.contextmanager
    def oracle_checkpoint(self):
        """transformers' loader takes a quantised weight's block size from its scale grid (144 rows over 2 scale
        rows: blocks of 72), which misreads a partial last block (128 + 16 rows: the native tiny's). Such a
        release is given to it dequantised under HF names, by the reader `import` uses."""
        from modelzoo.deepseek_v4.release.checkpoint import checkpoint_view

        view = checkpoint_view(self.hf_dir)
        try:
            if not view.partial_blocks():
                yield self.hf_dir
                return
            with tempfile.TemporaryDirectory(prefix="modelzoo-oracle-") as scratch:
                folder = Path(scratch) / "dequantised"
                with ShardedWriter(folder) as writer:
                    for name in view.names():
                        writer.add(name, view.get(name))
                    config = read_json(self.hf_dir / "config.json")
                    config.pop("quantization_config", None)
                    writer.write_json("config.json", config)
                yield folder
        finally:
            view.close()

    def check_supported(self) -> None:
        v4_config.check_supported(self.hf_config, self.config_source)
        if self.mtp_loss_scale and self.mtp_not_in_checkpoint:
            raise ValueError(f"DeepSeek-V4: mtp_loss_scale > 0 needs MTP layers, and {self.hf_dir} has no mtp.* tensors")
        if self.mtp_loss_scale and not (self.build_mtp and self.hf_config.num_nextn_predict_layers):
            raise ValueError("DeepSeek-V4: mtp_loss_scale > 0 needs MTP layers (num_nextn_predict_layers > 0, build_mtp=True)")
        full = self.config_overrides.get("recompute_granularity") == "full"
        if self.keep_attention_output and not (full and self.attention == "fast"):
            raise ValueError("DeepSeek-V4: keep_attention_output=True keeps the fast attention's output across a full "
                             "recompute: it needs attention='fast' and recompute_granularity='full'")

    def model_options(self) -> dict:
        return {"build_mtp": False} if self.hf_config.num_nextn_predict_layers and not self.build_mtp else {}

    @property
    def args(self) -> v4_config.DeepseekV4Args:
        return v4_config.DeepseekV4Args.from_hf(self.hf_config)

    def check_parallel_layout(self, tp: int, ep: int = 1, cp: int = 1, pp: int = 1) -> None:
        super().check_parallel_layout(tp, ep, cp, pp)
        v4_config.check_parallel(self.hf_config, tp, ep)

    def transformer_config_fields(self) -> dict:
        # what trainers read of the MTP: slime asserts mtp_num_layers before MTP training, Megatron's schedules scale
        # the MTP loss by it and finalize_model_grads all-reduces the last stage's embedding for it
        mtp_layers = self.hf_config.num_nextn_predict_layers if self.build_mtp else 0
        return v4_config.transformer_config_fields(self.hf_config) | dict(
            mtp_num_layers=mtp_layers or None, mtp_loss_scaling_factor=self.mtp_loss_scale)

    def build_model(self, config):
        from modelzoo.deepseek_v4.model.model import DeepseekV4Model

        return DeepseekV4Model(config, self.args, self.padded_vocab_size(), self.attention, self.build_mtp,
                               self.mtp_loss_scale, keep_attention_output=self.keep_attention_output,
                               **self.pipeline_stage())

    def pipeline_seq_length(self, seq_length: int) -> int:
        return seq_length * self.hf_config.hc_mult  # the hyper-connection streams travel between stages

    def checkpoint_reader(self, folder, naming=None):
        # release checkpoints: native names, FP8 / MXFP4 weights dequantised on read (docs/deepseek_v4.md)
        from modelzoo.deepseek_v4.release.checkpoint import checkpoint_view

        view = checkpoint_view(folder, self.params_dtype, naming)
        if self.mtp_not_in_checkpoint and not self._mtp_warning_given and engine.rank() == 0:
            self._mtp_warning_given = True  # once per provider: a checked load opens the checkpoint twice
            logger.warning(f"deepseek_v4: {self.hf_dir} has no mtp.* tensors although its config.json sets "
                           f"num_nextn_predict_layers={self.hf_config.num_nextn_predict_layers} (as transformers' "
                           f"save_pretrained writes it): loading it without MTP layers (require_mtp=True, or "
                           f"--require-mtp, refuses it)")
        return view

    def keep_source_files(self, reader, folder):
        from modelzoo.deepseek_v4.release.view import keep_source_scales

        keep_source_scales(reader, folder)

    def save_checkpoint(self, model, out_dir, format="hf", quantize=None, **options):
        from modelzoo.deepseek_v4.release import checkpoint as native

        return native.save(self, model, out_dir, naming=format, quantize=quantize, **options)

    @classmethod
    def lora_targets(cls):
        from modelzoo.deepseek_v4.lora import LORA_TARGETS  # imports modelzoo.lora (Megatron-Core): not for reading a config

        return LORA_TARGETS

    @classmethod
    def sync_namings(cls):
        from modelzoo.deepseek_v4.sync import NAMINGS

        return NAMINGS

    def mapping(self):
        return deepseek_v4_mapping(self.hf_config.vocab_size, self.hf_config.n_routed_experts)

    def loss(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token CE over plain rows, plus mtp_loss_scale x the MTP loss when switched on.
        (Packed or padded batches: the model's GPTModel call with `labels`, which adds the MTP loss the same way.)"""
        from modelzoo.deepseek_v4.model.mtp import mtp_loss, shifted_cross_entropy

        outputs = model(input_ids, return_mtp=bool(self.mtp_loss_scale))
        logits, mtp_logits = outputs if self.mtp_loss_scale else (outputs, None)
        per_token, has_target = shifted_cross_entropy(logits, input_ids, 1, self.vocab_size)
        main = per_token[has_target].mean()
        if not self.mtp_loss_scale:
            return main
        return main + self.mtp_loss_scale * mtp_loss(mtp_logits, input_ids, self.vocab_size)
