"""A provider's weights in and out: checkpoint readers, streamed loads, exports and checkpoint writes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from modelzoo.conversion import engine
from modelzoo.conversion.safetensors_io import CheckpointReader, ShardedWriter

# files carried from an HF checkpoint folder to an exported one besides config.json and the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "chat_template.jinja")


class WeightsIO:
    """`ModelProvider`'s weight movement, through the architecture's `mapping()` table."""

    def checkpoint_reader(self, folder: Path, naming: str | None = None):
        """How this architecture reads a checkpoint folder; one with formats of its own overrides it."""
        if naming not in (None, "hf"):
            raise ValueError(f"{self.name} checkpoints have only the 'hf' naming, not {naming!r}")
        return CheckpointReader(folder)

    def keep_source_files(self, reader, folder: Path) -> None:
        """At import: write into `folder` (the Megatron checkpoint's HF side) what an export needs of the source
        beyond its weights and config; `reader` is `checkpoint_reader`'s (a quantised release keeps its scales)."""

    def load_hf_weights(self, model: torch.nn.Module, hf_dir: str | Path | None = None, progress: bool = True,
                        naming: str | None = None) -> None:
        """Stream a checkpoint into `model`; `naming` picks the layout (None: the architecture detects it)."""
        folder = Path(hf_dir) if hf_dir is not None else self.hf_dir
        if folder is None:
            raise ValueError("load_hf_weights needs hf_dir: this provider was built from a config, not a folder")
        reader = self.checkpoint_reader(folder, naming)
        try:
            engine.load_hf_weights(model, self.mapping(), reader, progress=progress)
        finally:
            reader.close()

    def export_hf_weights(self, model) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream `(hf_name, full tensor)`; every TP rank must iterate (gathers are collective).

        `model` (here and in `save_hf`, `save_checkpoint`): the Megatron model, or its tensors streamed
        from a Megatron checkpoint (`modelzoo.conversion.megatron_ckpt.stream_weights`)."""
        return engine.export_hf_weights(model, self.mapping())

    def save_hf(self, model: torch.nn.Module, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30,
                source_dir: str | Path | None = None) -> int:
        """Write an HF checkpoint folder atomically; returns bytes of weights written.

        Collective: every rank calls it, rank 0 writes. Tokenizer files are copied from
        `source_dir` (default: the folder this provider was built from) when present.
        """
        source = Path(source_dir) if source_dir is not None else self.hf_dir
        # a fused tensor's HF tensors as runs of its rows: the writer copies each from the checkpoint's file
        tensors = engine.export_hf_weights(model, self.mapping(), row_blocks=True)
        if engine.rank() != 0:
            for _ in tensors:  # take part in the gathers
                pass
            return 0
        with ShardedWriter(out_dir, max_shard_bytes) as writer:
            for name, tensor in tqdm(tensors, desc="export", unit="tensor", leave=False):
                writer.add(name, tensor)
            if source is None or not (source / "config.json").exists():
                writer.write_json("config.json", self.hf_config.to_dict())
            for file_name in ("config.json", *TOKENIZER_FILES):
                if source is not None and (source / file_name).exists():
                    writer.copy_file(source / file_name, source)
        return writer.total_bytes

    def save_checkpoint(self, model: torch.nn.Module, out_dir: str | Path, format: str = "hf",
                        quantize: str | None = None, **options) -> int:
        """`save_hf`, or a format of the architecture's own (`checkpoint_formats`), e.g. quantised."""
        if format != "hf" or quantize is not None:
            raise ValueError(f"{self.name} checkpoints are written only in the 'hf' format without quantisation")
        return self.save_hf(model, out_dir, **options)
