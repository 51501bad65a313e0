"""DeepSeek-V4.1 (`deepseek_v41`, `DeepseekV41ForCausalLM`): the provider `build_provider` picks from config.json.

    config.py    the HF config (composite: text_config, vision_config) and its Megatron translation
    model/       attention (CSA2 roles), engram, moe, model (single-pass mHC, DSpark)
    mapping.py   the HF <-> Megatron name table
    lora.py      LoRA targets; sync.py: the update groups of a weight sync
    release.py   the release checkpoint format: native names, FP8 / FP4 weights (DeepSeek-V4's release machinery)
    hf_model.py  our reference, the parity oracle

The text model is built; the vision tower, aligner and image delimiters are not used by it: whatever of them the
checkpoint holds is carried in the model as frozen buffers (in the checkpoint's dtype) and exported unchanged. The Engram hashes run over the normalised vocabulary built from
the checkpoint folder's own tokenizer.json (read as data, no remote code).
"""

from __future__ import annotations

from pathlib import Path

import torch

from modelzoo.deepseek_v41 import config as v41_config
from modelzoo.deepseek_v41.config import DeepseekV41Args, DeepseekV41Config
from modelzoo.deepseek_v41.mapping import CARRIED_PREFIXES, deepseek_v41_mapping
from modelzoo.provider import ModelProvider
from modelzoo.registry import register


class _ModelNamings:
    """`sync_namings()` of the provider: on a provider, its model's namings (the compressor pairs sit at the pooling
    KV sources of its config: `sync.NAMINGS(text_config)`); on the class, which has no config, the groups every
    V4.1 model has."""

    def __get__(self, provider, cls):
        def sync_namings():
            from modelzoo.deepseek_v41.sync import NAMINGS

            return NAMINGS(None if provider is None else provider.hf_config)

        return sync_namings


@register
class DeepseekV41Provider(ModelProvider):
    """`attention`: "exact" (dense masks, the parity path) or "fast" (each query over its window keys and picked
    latents: DeepSeek-V4's window attention and sparse kernels, model/attention.py). `train_engram_tables=True`: the
    Engram tables train (frozen by default, as in the release's fine-tuning).
    `fake_quant=True`: every forward rounds the window K/V to FP8 and the compressed K/V and indexer queries and keys
    to FP4, as the release's inference stores them, with straight-through gradients (model/attention.py); the parity
    oracle then runs our reference with `fake_quant=True`."""

    name = "deepseek_v41"
    hf_model_types = ("deepseek_v41",)
    hf_architectures = ("DeepseekV41ForCausalLM",)
    has_experts = True
    supports_context_parallel = True
    engine_naming = "native"  # vLLM and SGLang load V4.1 by its release names (sync.py)

    recorded_options = {"carried": dict}
    checkpoint_formats = {"native": "the release checkpoint's names, FP8 / FP4 weights (dequantised on import)"}
    cli_options = {
        "--quantize": {"commands": ("export",), "passed_to": "save", "choices": ("none", "fp8"), "default": "none",
                       "help": "fp8: re-quantise to the release layout (FP8 32x32 blocks, FP4 routed experts, FP8 "
                               "Engram tables)"},
        "--experts": {"commands": ("export",), "passed_to": "save", "choices": ("mxfp4", "fp8"), "default": None,
                      "help": "routed-expert format with --quantize"},
        "--scale-format": {"commands": ("export",), "passed_to": "save", "choices": ("keep", "e8m0", "f32"),
                           "default": "keep", "help": "FP8 scale format (keep: the source checkpoint's)"},
        "--fake-quant": {"commands": ("logprobs", "parity"), "passed_to": "provider", "action": "store_true",
                         "default": False,
                         "help": "round the window K/V to FP8 and the compressed K/V and indexer queries and keys to "
                                 "FP4 in every forward, as the release's inference does (parity: against the "
                                 "reference doing the same)"},
    }

    def __init__(self, hf_config, hf_dir=None, attention: str = "exact", params_dtype: torch.dtype = torch.float32,
                 train_engram_tables: bool = False, fake_quant: bool = False, carried: dict | None = None,
                 **config_overrides):
        """`carried`: {name: [shape, dtype name]} of the tensors carried for the export, as a Megatron checkpoint
        records them (its HF side has no weights to read them from); default: the checkpoint folder's."""
        self.train_engram_tables, self.fake_quant = train_engram_tables, fake_quant
        self._carried = None if carried is None else carried_from_record(carried, hf_dir)
        # the composite config.json (text_config, vision_config); `hf_config` is its text config, whose fields
        # (vocab_size, max_position_embeddings, num_hidden_layers) the generic code reads
        self.checkpoint_config = hf_config
        super().__init__(hf_config.get_text_config(), hf_dir=hf_dir, attention=attention, params_dtype=params_dtype,
                         **config_overrides)

    @classmethod
    def hf_config_class(cls):
        return DeepseekV41Config

    def hf_model_class(self):
        from modelzoo.deepseek_v41.hf_model import DeepseekV41ForCausalLM

        return DeepseekV41ForCausalLM

    def check_supported(self) -> None:
        v41_config.check_supported(self.hf_config, self.config_source)
        if self.hf_dir is not None:  # a checkpoint folder: its tokenizer checked before anything is read or written
            self._token_map = self.engram_token_map()
        text = self.hf_config
        if self.fake_quant and (text.head_dim % 32 or text.index_head_dim % 32):
            raise ValueError(f"deepseek_v41: fake_quant=True needs head_dim ({text.head_dim}) and index_head_dim "
                             f"({text.index_head_dim}) of {self.config_source} to be multiples of 32, the channels "
                             "of one FP8 / FP4 scale")

    def check_parallel_layout(self, tp: int, ep: int = 1, cp: int = 1, pp: int = 1) -> None:
        super().check_parallel_layout(tp, ep, cp, pp)
        v41_config.check_parallel(self.hf_config, tp, ep)

    @property
    def args(self) -> DeepseekV41Args:
        return DeepseekV41Args.from_hf(self.hf_config)

    def transformer_config_fields(self) -> dict:
        return v41_config.transformer_config_fields(self.hf_config)

    def engram_token_map(self) -> torch.Tensor | None:
        """The normalised vocabulary of the checkpoint folder's tokenizer.json; None without Engram layers. Refused
        by name when the file is missing or gives another number of classes than the config."""
        from modelzoo.deepseek_v41.hf_model import build_engram_token_map

        text = self.hf_config
        if not text.engram_layer_ids:
            return None
        if getattr(self, "_token_map", None) is not None:
            return self._token_map
        tokenizer = Path(self.hf_dir) / "tokenizer.json" if self.hf_dir is not None else None
        if tokenizer is None or not tokenizer.is_file():
            raise ValueError(f"deepseek_v41: {tokenizer or 'this provider (built from a config dict)'} has no "
                             "tokenizer.json: the Engram layers hash token ids over the normalised vocabulary built "
                             "from the checkpoint's own tokenizer")
        token_map, classes = build_engram_token_map(tokenizer)
        if classes != text.engram_compressed_vocab_size or len(token_map) > text.vocab_size:
            raise ValueError(f"deepseek_v41: {tokenizer} normalises {len(token_map)} tokens into {classes} classes, "
                             f"but {self.config_source} has engram_compressed_vocab_size "
                             f"{text.engram_compressed_vocab_size} and vocab_size {text.vocab_size}")
        return torch.tensor(token_map)

    def carried_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of the checkpoint's tensors the text model does not use (`CARRIED_PREFIXES`):
        as recorded (`carried`), else read from the folder's weights; none for a config without weights."""
        from modelzoo.conversion.safetensors_io import INDEX_FILE, SINGLE_FILE

        folder = self.hf_dir
        if self._carried is not None:
            return self._carried
        if folder is None or not ((folder / SINGLE_FILE).exists() or (folder / INDEX_FILE).exists()):
            return {}
        reader = self.checkpoint_reader(folder)  # as the import reads them: a quantised one dequantised
        try:
            self._carried = {name: (tuple(reader.tensors[name].shape), reader.tensors[name].dtype)
                             for name in reader.names() if name.startswith(CARRIED_PREFIXES)}
        finally:
            reader.close()
        return self._carried

    def model_options(self) -> dict:
        carried = self.carried_tensors()
        if not carried:
            return {}
        return {"carried": {name: [list(shape), str(dtype).removeprefix("torch.")]
                            for name, (shape, dtype) in carried.items()}}

    @classmethod
    def lora_targets(cls):
        from modelzoo.deepseek_v41.lora import LORA_TARGETS  # imports modelzoo.lora (Megatron-Core): not for reading a config

        return LORA_TARGETS

    sync_namings = _ModelNamings()

    def checkpoint_reader(self, folder, naming=None):
        # release checkpoints: native names, FP8 / FP4 weights dequantised on read (release.py)
        from modelzoo.deepseek_v4.release.checkpoint import checkpoint_view
        from modelzoo.deepseek_v41.release import DEEPSEEK_V41

        return checkpoint_view(folder, self.params_dtype, naming, release=DEEPSEEK_V41)

    def keep_source_files(self, reader, folder):
        from modelzoo.deepseek_v4.release.view import keep_source_scales

        keep_source_scales(reader, folder)

    def save_checkpoint(self, model, out_dir, format="hf", quantize=None, **options):
        from modelzoo.deepseek_v4.release import checkpoint as release
        from modelzoo.deepseek_v41.release import DEEPSEEK_V41

        return release.save(self, model, out_dir, naming=format, quantize=quantize, release=DEEPSEEK_V41, **options)

    def build_model(self, config):
        from modelzoo.deepseek_v41.model.model import DeepseekV41Model

        token_map = None if config.init_model_with_meta_device else self.engram_token_map()
        return DeepseekV41Model(config, self.args, self.padded_vocab_size(), token_map, self.carried_tensors(),
                                self.train_engram_tables, self.fake_quant, self.attention, **self.pipeline_stage())

    def oracle_forward_kwargs(self) -> dict:
        return {"fake_quant": True} if self.fake_quant else {}

    def pipeline_seq_length(self, seq_length: int) -> int:
        # streams, pre, the CSA2 state and the token ids travel between stages (model/pipeline.py); the schedules
        # divide this by the CP size, and by the TP size under sequence parallelism, where every TP rank sends what
        # a whole row would
        from megatron.core import parallel_state

        from modelzoo.deepseek_v41.model.pipeline import boundary_length

        cp = parallel_state.get_context_parallel_world_size()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        split = cp * (tp if self.config_overrides.get("sequence_parallel") else 1)
        return boundary_length(self.args, seq_length, self.params_dtype, cp, self.attention == "fast") * split

    def mapping(self):
        return deepseek_v41_mapping(self.hf_config, self.carried_tensors())


def carried_from_record(record: dict, where) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`model_options["carried"]` as a Megatron checkpoint records it, checked: {name: [shape, dtype name]}."""
    carried = {}
    for name, entry in record.items():
        shape, dtype = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
        if not (isinstance(name, str) and name.startswith(CARRIED_PREFIXES) and isinstance(shape, list)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
                and isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)):
            raise ValueError(f"{where}: model option carried[{name!r}] is {entry!r}; it must be [shape, dtype name] "
                             f"of a tensor named {' / '.join(CARRIED_PREFIXES)}...")
        carried[name] = (tuple(shape), getattr(torch, dtype))
    return carried
