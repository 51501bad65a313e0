"""The `modelzoo` command: import, export, logprobs, parity, list.

`--tp N --ep M --pp P` runs N x M x P ranks (`logprobs` and `parity` also take `--cp C`: N x M x C x P ranks):
gloo processes on a CPU machine (GPUs with nccl on a GPU machine). `export` reads a checkpoint written at any of
these layouts (pipeline stages included) at its own `--tp` / `--ep`.
A bad input ends with one line on stderr naming what and where, exit code 2, and no output left.

torch, Megatron-Core and transformers' modeling code are imported by the commands that use them, after
the checks that need none of them: help, `list`, argument errors and most refused inputs answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

# Megatron-Core announces every optional library it did not find (Transformer Engine, Apex, absl) and
# deprecations of APIs modelzoo does not call; a CLI user acts on none of it. Errors still show.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core\..*")
# torch's distributed checkpoint announces that it loads in one process and that its API will change: the same
warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint\..*")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint\..*")
logging.getLogger("megatron.core").setLevel(logging.ERROR)
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

from modelzoo.conversion.errors import CheckpointError, MappingError, one_line  # noqa: E402
from modelzoo.conversion.files import confined, read_json  # noqa: E402
from modelzoo.conversion.staging import remove_stale_staging, staging_prefix, write_failure  # noqa: E402
from modelzoo.processes import RankDied, RankFailed, check_not_interrupted, signals_interrupt  # noqa: E402
from modelzoo.registry import BUILTIN_ARCHITECTURES, build_provider, list_architectures  # noqa: E402

# Errors that describe the user's input: reported as one line, not as a traceback.
USER_ERRORS = (MappingError, CheckpointError, ValueError, FileNotFoundError, FileExistsError)
# the --dtype choices, by their names in torch
DTYPES = ("bfloat16", "float32")
# the most a token file may hold (about 40 million token ids)
MAX_TOKEN_FILE_BYTES = 256 * 2**20


class ParityFailed(Exception):
    pass


def _summary(title: str, rows: list[tuple[str, object]]) -> None:
    width = max(len(key) for key, _ in rows)
    print(f"\n{title}")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def _refuse_existing(path: Path) -> None:
    if path.exists():
        raise FileExistsError(f"output {path} already exists; choose a new path or remove it")


# --- import / export ----------------------------------------------------------------------------
@contextlib.contextmanager
def _existing_objects_not_collected():
    """The cyclic GC leaves the objects that exist now out of its collections meanwhile (`gc.freeze`):
    the ~500k of torch, Megatron and transformers, which a conversion does not free. A conversion
    allocates enough to trigger full collections, and each of those traversed them all (0.2 CPU-seconds,
    in about one in four in-process conversions of a 2 GB checkpoint); what the conversion itself
    allocates is still collected. For the command's ranks only: `gc.unfreeze` also thaws whatever was frozen before."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _config_with_dtype(source: Path, dtype_name: str) -> str | None:
    """The text of `source`'s config.json saying the weights are `dtype_name` (what the import stores,
    and so what an export writes), or None when it says so already (it is then copied as it is)."""
    config = read_json(source, source.parent)
    keys = [key for key in ("torch_dtype", "dtype") if key in config]
    if all(config[key] == dtype_name for key in keys) and (keys or dtype_name == "float32"):  # none: float32
        return None
    return json.dumps({**config, **dict.fromkeys(keys or ["dtype"], dtype_name)}, indent=2, sort_keys=True) + "\n"


def _import_rank(rank: int, hf_dir: str, out_dir: str, tp: int, ep: int, dtype_name: str, naming: str | None,
                 options: dict, allow_non_finite: bool, pp: int) -> int:
    import torch

    from modelzoo import runtime
    from modelzoo.conversion import engine, megatron_ckpt, validation
    from modelzoo.provider import TOKENIZER_FILES

    with (_existing_objects_not_collected(), runtime.parallel(tp=tp, ep=ep, pp=pp),
          validation.non_finite_allowed(allow_non_finite)):
        provider = build_provider(hf_dir, params_dtype=getattr(torch, dtype_name), **options)
        config = Path(hf_dir) / "config.json"
        retyped_config = _config_with_dtype(config, dtype_name)
        reader = provider.checkpoint_reader(Path(hf_dir), naming)

        def write_hf_side(folder: Path) -> None:
            if retyped_config is not None:
                (folder / config.name).write_text(retyped_config)
            provider.keep_source_files(reader, folder)

        try:
            tensors, elements = validation.reader_contents(reader)
            validation.check_config_fits(provider.hf_config, str(reader.folder), elements, tensors,
                                         provider.weights_per_unit)
            # files copied into the output: refused before any work if one leads out of the folder
            side_files = [confined(Path(hf_dir) / name, hf_dir) for name in TOKENIZER_FILES
                          if (Path(hf_dir) / name).exists()]
            side_files += [config] if retyped_config is None else []
            # streamed: the model is never built, each tensor is read, sharded and written in turn
            skeleton = provider.provide_skeleton()
            weights = engine.hf_weights(skeleton, provider.mapping(), reader)
            metadata = {"architecture": provider.name, "dtype": dtype_name, "written_at_tp": tp, "written_at_ep": ep,
                        "written_at_pp": pp,
                        "model_options": provider.model_options()}
            megatron_ckpt.save(skeleton, out_dir, metadata, side_files, weights=weights, write_hf_side=write_hf_side)
        finally:
            reader.close()
        return sum(t.numel() for t in engine.megatron_tensors(skeleton).values())


def cmd_import(args) -> int:
    out = Path(args.megatron_dir)
    _refuse_existing(out)
    options = _provider_options(args)
    provider = build_provider(args.hf_dir, **options)  # model type and layout checked before any process starts
    provider.check_parallel_layout(args.tp, args.ep, pp=args.pp)
    from modelzoo import runtime  # after the checks: a refused input does not wait for torch

    start = time.perf_counter()
    naming = None if args.format == "auto" else args.format
    local_elements = runtime.run(_import_rank, args.tp * args.ep * args.pp, args.hf_dir, str(out), args.tp, args.ep,
                                 args.dtype, naming, options, args.allow_non_finite, args.pp)
    _summary("import", [("architecture", provider.name), ("source", args.hf_dir), ("output", out),
                        ("tensor / expert / pipeline parallel", f"{args.tp} / {args.ep} / {args.pp}"),
                        ("dtype", args.dtype),
                        ("parameters", f"{sum(local_elements):,} (all ranks)"),
                        ("seconds", f"{time.perf_counter() - start:.1f}")])
    return 0


def _export_rank(rank: int, megatron_dir: str, out_dir: str, tp: int, ep: int, max_shard_bytes: int,
                 options: dict, allow_non_finite: bool = False) -> int:
    import torch

    from modelzoo.conversion import megatron_ckpt, validation
    from modelzoo import runtime

    metadata = megatron_ckpt.read_metadata(megatron_dir)
    hf_side = megatron_ckpt.hf_side(megatron_dir)
    with (_existing_objects_not_collected(), runtime.parallel(tp=tp, ep=ep),
          validation.non_finite_allowed(allow_non_finite)):
        provider = build_provider(hf_side, params_dtype=getattr(torch, metadata["dtype"]),
                                  **metadata.get("model_options", {}))
        stored = megatron_ckpt.checked_state(megatron_dir)
        # the config against what the checkpoint holds, before a model of it is built
        elements = sum(math.prod(entry.size) for entry in stored.state_dict_metadata.values()
                       if hasattr(entry, "size"))
        validation.check_config_fits(provider.hf_config, str(megatron_dir), elements,
                                     weights_per_unit=provider.weights_per_unit)
        # streamed: the model is never built, its tensors are read a bounded group at a time
        weights = megatron_ckpt.stream_weights(provider.provide_skeleton(), megatron_dir, stored=stored)
        return provider.save_checkpoint(weights, out_dir, max_shard_bytes=max_shard_bytes, source_dir=hf_side, **options)


def cmd_export(args) -> int:
    out = Path(args.hf_dir)
    _refuse_existing(out)
    from modelzoo.conversion import megatron_ckpt  # after the check: a refused input does not wait for torch
    from modelzoo import runtime

    metadata = megatron_ckpt.read_metadata(args.megatron_dir)
    metadata_file = Path(args.megatron_dir) / megatron_ckpt.METADATA_FILE
    if metadata.get("dtype") not in DTYPES or not isinstance(metadata.get("architecture"), str):
        raise CheckpointError(f"{metadata_file} must name the architecture and a dtype among {sorted(DTYPES)}")
    start = time.perf_counter()
    provider = build_provider(megatron_ckpt.hf_side(args.megatron_dir))
    provider.check_recorded_options(metadata.get("model_options", {}), str(metadata_file))
    provider.check_parallel_layout(args.tp, args.ep)
    options = {"format": args.format, **_architecture_options(args, "save")}
    written = runtime.run(_export_rank, args.tp * args.ep, args.megatron_dir, str(out), args.tp, args.ep,
                          args.max_shard_bytes, options, args.allow_non_finite)[0]
    _summary("export", [("architecture", metadata["architecture"]), ("source", args.megatron_dir),
                        ("output", out), ("tensor / expert parallel", f"{args.tp} / {args.ep}"),
                        ("bytes written", f"{written:,}"),
                        ("seconds", f"{time.perf_counter() - start:.1f}")])
    return 0


def cmd_export_adapter(args) -> int:
    from modelzoo.lora import export_adapter

    start = time.perf_counter()
    result = export_adapter(args.checkpoint_dir, args.adapter_dir, tp=args.tp, base_dir=args.base, naming=args.naming,
                            allow_non_finite=args.allow_non_finite)
    _summary("export-adapter", [("architecture", result["architecture"]), ("source", args.checkpoint_dir),
                                ("step", result["step"]), ("output", result["output"]),
                                ("tensor parallel", args.tp), ("seconds", f"{time.perf_counter() - start:.1f}")])
    return 0


# --- logprobs / parity --------------------------------------------------------------------------
def _read_token_lists(path: str, vocab_size: int, max_positions: int, config: str) -> list[list[int]]:
    """The token file: a regular file (a FIFO or a device is refused before it is opened) of at most
    `MAX_TOKEN_FILE_BYTES`, holding a JSON list of sequences of at least 2 and at most `max_positions` (the
    model's max_position_embeddings, read from `config`) token ids below `vocab_size`."""
    if not (Path(path).exists() or Path(path).is_symlink()):
        raise FileNotFoundError(f"token file {path} does not exist")
    try:
        tokens = read_json(path, what=list, limit=MAX_TOKEN_FILE_BYTES)
    except CheckpointError as error:
        raise ValueError(f"token file {error}") from None
    if not all(isinstance(seq, list) and len(seq) >= 2 for seq in tokens):
        raise ValueError(f"token file {path} must hold a JSON list of token-id lists, each of length >= 2")
    for number, seq in enumerate(tokens):
        # JSON true / false are Python ints too: refused like any other non-id
        bad = [t for t in seq if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token file {path}: sequence {number} has ids outside [0, {vocab_size}): "
                             f"{[t if isinstance(t, int) else type(t).__name__ for t in bad[:5]]}")
        if len(seq) > max_positions:
            raise ValueError(f"token file {path}: sequence {number} has {len(seq)} tokens, more than the "
                             f"{max_positions} positions of the model (max_position_embeddings in {config})")
    return tokens


def _architecture_options(args, passed_to: str) -> dict:
    """The options architectures add (`ModelProvider.cli_options`) that `args` gives other than their defaults."""
    options = {}
    for flag, option in _declared_cli_options().items():
        dest = flag.removeprefix("--").replace("-", "_")
        value = getattr(args, dest, option.get("default"))
        if option["passed_to"] == passed_to and value != option.get("default"):
            options[dest] = value
    return options


def _declared_cli_options() -> dict[str, dict]:
    """flag -> its declaration (the first architecture's), with "architectures": those declaring it, and "helps":
    architecture -> its help text."""
    options: dict[str, dict] = {}
    for entry in BUILTIN_ARCHITECTURES.values():
        for flag, option in entry.cli_options.items():
            declared = options.setdefault(flag, {**option, "architectures": [], "helps": {}})
            declared["architectures"].append(entry.name)
            declared["helps"][entry.name] = option["help"]
    return options


def _provider_options(args) -> dict:
    options = _architecture_options(args, "provider")
    if getattr(args, "sp", False):
        options["sequence_parallel"] = True
    return options


def _write_new_file(path: Path, text: str) -> None:
    """`text` into a new file `path`, whole or not at all: written beside it under a temporary name, then
    renamed into place; an existing `path` is never replaced."""
    _refuse_existing(path)
    try:
        remove_stale_staging(path)
        descriptor, partial = tempfile.mkstemp(prefix=staging_prefix(path), dir=path.parent)
    except FileNotFoundError:
        raise FileNotFoundError(f"output {path}: its folder {path.parent} does not exist") from None
    except OSError as error:
        raise (write_failure(error, path) or error) from None
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        _refuse_existing(path)
        check_not_interrupted()
        os.replace(partial, path)
    except BaseException as error:
        Path(partial).unlink(missing_ok=True)
        raise (write_failure(error, path) or error) from None


def cmd_logprobs(args) -> int:
    out = Path(args.out)
    _refuse_existing(out)
    provider = build_provider(args.hf_dir, **_provider_options(args))
    provider.check_parallel_layout(args.tp, args.ep, args.cp, args.pp)
    sequences = _read_token_lists(args.tokens, provider.vocab_size, provider.hf_config.max_position_embeddings,
                                  str(Path(args.hf_dir) / "config.json"))
    if args.pack and args.backend == "hf":
        raise ValueError("--pack runs the Megatron backend's packed (THD) forward; the hf backend runs one sequence "
                         "at a time: drop --pack or use --backend megatron")
    import torch  # after the checks: a refused input does not wait for torch, Megatron-Core or transformers

    from modelzoo.parity import hf_outputs, megatron_outputs

    dtype = getattr(torch, args.dtype)
    if args.pack:  # one forward of all sequences packed into a row
        [packed] = megatron_outputs(args.hf_dir, [], args.tp, dtype, args.attention, with_logits=False, ep=args.ep,
                                    options=_provider_options(args), packed=sequences,
                                    allow_non_finite=args.allow_non_finite, cp=args.cp, pp=args.pp)
        results = [logprobs.tolist() for logprobs in packed]
    else:
        batches = [torch.tensor([seq]) for seq in sequences]  # one sequence a batch: lengths differ, no padding
        if args.backend == "hf":
            outputs = hf_outputs(args.hf_dir, batches, dtype, allow_non_finite=args.allow_non_finite,
                                 options=_architecture_options(args, "provider"))
        else:
            outputs = megatron_outputs(args.hf_dir, batches, args.tp, dtype, args.attention, with_logits=False,
                                       ep=args.ep, options=_provider_options(args),
                                       allow_non_finite=args.allow_non_finite, cp=args.cp, pp=args.pp)
        results = [logprobs[0].tolist() for logprobs, _ in outputs]
    for number, values in enumerate(results):
        bad = next((position for position, value in enumerate(values) if not math.isfinite(value)), None)
        if bad is not None:  # strict JSON has no NaN or Infinity, and a NaN log-prob answers nothing
            raise ValueError(f"sequence {number} of {args.tokens}: the log-probability at position {bad} is "
                             f"{values[bad]}; nothing was written")
    _write_new_file(out, json.dumps({"logprobs": results}, allow_nan=False) + "\n")
    _summary("logprobs", [("backend", args.backend), ("packed", "yes" if args.pack else "no"),
                          ("sequences", len(results)), ("output", out)])
    return 0


def cmd_parity(args) -> int:
    provider = build_provider(args.hf_dir, **_provider_options(args))
    provider.check_parallel_layout(args.tp, args.ep, args.cp, args.pp)
    if args.seq_len > provider.hf_config.max_position_embeddings:
        raise ValueError(f"--seq-len {args.seq_len}: more than the {provider.hf_config.max_position_embeddings} "
                         f"positions of the model (max_position_embeddings in {Path(args.hf_dir) / 'config.json'})")
    import torch  # after the checks: a refused input does not wait for torch, Megatron-Core or transformers

    from modelzoo.parity import hf_outputs, megatron_outputs

    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, provider.vocab_size, (args.batch, args.seq_len), generator=generator)
    # the packed case: sequences of several lengths in one THD row, each against its own HF run
    lengths = sorted({1, 5, max(1, args.seq_len // 3), args.seq_len})
    packed = [torch.randint(0, provider.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    [(megatron_logprobs, megatron_logits), megatron_packed] = megatron_outputs(
        args.hf_dir, [ids], args.tp, dtype, args.attention, ep=args.ep, options=_provider_options(args), packed=packed,
        allow_non_finite=args.allow_non_finite, cp=args.cp, pp=args.pp)
    alone = [torch.tensor([sequence]) for sequence in packed]
    [(hf_logprobs, hf_logits), *hf_alone] = hf_outputs(args.hf_dir, [ids, *alone], dtype,
                                                   allow_non_finite=args.allow_non_finite,
                                                   options=_architecture_options(args, "provider"))
    packed_diff = max((ours - theirs[0][0]).abs().max().item() for ours, theirs in zip(megatron_packed, hf_alone)
                      if ours.numel())
    tolerance = args.tolerance if args.tolerance is not None else (1e-4 if dtype == torch.float32 else 2e-2)
    report = {
        "architecture": provider.name, "tp": args.tp, "sp": args.sp, "ep": args.ep, "cp": args.cp, "pp": args.pp,
        "dtype": args.dtype, "attention": args.attention,
        "batch": args.batch, "seq_len": args.seq_len,
        "max_abs_diff_logprobs": (megatron_logprobs - hf_logprobs).abs().max().item(),
        "max_abs_diff_logits": (megatron_logits - hf_logits).abs().max().item(),
        "packed_lengths": lengths, "max_abs_diff_logprobs_packed": packed_diff,
        "tolerance": tolerance,
    }
    report["passed"] = max(report["max_abs_diff_logprobs"], packed_diff) <= tolerance
    if args.json:
        print(json.dumps(report))
    else:
        _summary("parity: Megatron vs Hugging Face", [(key, value) for key, value in report.items()])
    if not report["passed"]:
        worst = max(report["max_abs_diff_logprobs"], packed_diff)
        raise ParityFailed(f"max |logprob diff| {worst:.3e} exceeds tolerance {tolerance:.1e}")
    return 0


def cmd_list(args) -> int:
    for name in list_architectures():
        print(name)
    return 0


class UsageError(Exception):
    """A command line argparse cannot read: reported in one line, like any other refused input."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # argparse prints the usage and the message on lines of their own and exits; here it is one line
        raise UsageError(f"{message} ({self.prog} --help lists the arguments)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="modelzoo", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub, tp=True, dtype=True):
        if tp:
            sub.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
            sub.add_argument("--ep", type=int, default=1, help="expert-parallel size (models with experts)")
        if dtype:
            sub.add_argument("--dtype", choices=sorted(DTYPES), default="float32")

    formats: dict[str, list[str]] = {}  # a format several architectures declare: each one's description
    for entry in BUILTIN_ARCHITECTURES.values():
        for name, text in entry.checkpoint_formats.items():
            formats.setdefault(name, []).append(f"{entry.name}: {text}")
    formats_help = "; ".join(["hf: the Hugging Face checkpoint's names",
                              *(f"{name} ({'; '.join(texts)})" for name, texts in formats.items())])

    sub = commands.add_parser("import", help="HF checkpoint -> Megatron torch_dist checkpoint")
    sub.add_argument("hf_dir")
    sub.add_argument("megatron_dir")
    sub.add_argument("--format", choices=("auto", "hf", *formats), default="auto",
                     help=f"tensor naming of the source (auto: the architecture detects it); {formats_help}")
    common(sub)
    sub.set_defaults(func=cmd_import)

    sub = commands.add_parser("export", help="Megatron torch_dist checkpoint -> HF checkpoint")
    sub.add_argument("megatron_dir")
    sub.add_argument("hf_dir")
    sub.add_argument("--max-shard-bytes", type=int, default=5 * 2**30)
    sub.add_argument("--format", choices=("hf", *formats), default="hf",
                     help=f"tensor naming of the output; {formats_help}")
    common(sub, dtype=False)
    sub.set_defaults(func=cmd_export)

    sub = commands.add_parser("export-adapter", help="LoRA training checkpoint -> HF PEFT adapter folder")
    sub.add_argument("checkpoint_dir")
    sub.add_argument("adapter_dir")
    sub.add_argument("--base", default=None, help="base HF checkpoint (default: the one recorded in the checkpoint)")
    sub.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    sub.add_argument("--naming", choices=("transformers", "release"), default="transformers",
                     help="module names: transformers' model class (what peft loads onto) or the checkpoint's "
                          "tensor names (the same where transformers loads the checkpoint's names unchanged)")
    sub.set_defaults(func=cmd_export_adapter)
    for name in ("export", "export-adapter"):
        commands.choices[name].add_argument("--allow-non-finite", action="store_true",
                                            help="write tensors with NaN or infinite values (refused by default)")

    for name, func, text in (("logprobs", cmd_logprobs, "token log-probabilities to JSON"),
                             ("parity", cmd_parity, "Megatron vs HF on random tokens")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("hf_dir")
        sub.add_argument("--attention", choices=("exact", "fast"), default="exact")
        sub.add_argument("--cp", type=int, default=1,
                         help="context-parallel size: each sequence cut into 2 x cp chunks over cp ranks")
        common(sub)
        sub.add_argument("--sp", action="store_true",
                         help="sequence parallel: split each sequence over the --tp ranks (rows padded to a multiple)")
        sub.set_defaults(func=func)
    for name in ("import", "logprobs", "parity"):
        commands.choices[name].add_argument("--pp", type=int, default=1,
                                            help="pipeline-parallel size: the decoder layers split over pp stages")
        commands.choices[name].add_argument("--allow-non-finite", action="store_true",
                                            help="load weights with NaN or infinite values (refused by default)")
    commands.choices["logprobs"].add_argument("--tokens", required=True, help="JSON list of token-id lists")
    commands.choices["logprobs"].add_argument("--out", required=True)
    commands.choices["logprobs"].add_argument("--backend", choices=("megatron", "hf"), default="megatron")
    commands.choices["logprobs"].add_argument("--pack", action="store_true",
                                              help="one forward of all sequences packed into a row (THD)")
    parity = commands.choices["parity"]
    parity.add_argument("--batch", type=int, default=2)
    parity.add_argument("--seq-len", type=int, default=64)
    parity.add_argument("--seed", type=int, default=0)
    parity.add_argument("--tolerance", type=float, default=None,
                        help="max |logprob diff| allowed (default 1e-4 in float32, 2e-2 in bfloat16)")
    parity.add_argument("--json", action="store_true")

    commands.add_parser("list", help="supported architectures").set_defaults(func=cmd_list)
    for flag, option in _declared_cli_options().items():
        keywords = {key: value for key, value in option.items()
                    if key not in ("commands", "passed_to", "architectures", "helps")}
        helps = option["helps"]
        keywords["help"] = f"{', '.join(helps)}: {option['help']}" if len(set(helps.values())) == 1 else \
            "; ".join(f"{name}: {text}" for name, text in helps.items())
        for command in option["commands"]:
            commands.choices[command].add_argument(flag, **keywords)
    return parser


# the least each count among the arguments can be (a log-prob needs two tokens)
MINIMUMS = {"tp": 1, "ep": 1, "cp": 1, "pp": 1, "batch": 1, "seq_len": 2, "max_shard_bytes": 1}
# the argument naming what each command writes
OUTPUTS = {"import": "megatron_dir", "export": "hf_dir", "export-adapter": "adapter_dir", "logprobs": "out"}


def check_arguments(args) -> None:
    for name, least in MINIMUMS.items():
        value = getattr(args, name, None)
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} {value}: it must be at least {least}")
    if getattr(args, "sp", False) and args.tp < 2:
        raise ValueError(f"--sp splits each sequence over the tensor-parallel ranks and needs --tp 2 or more, "
                         f"got --tp {args.tp}")
    tolerance = getattr(args, "tolerance", None)
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"--tolerance {tolerance}: it must be a finite number >= 0")


def _error(message) -> int:
    print(f"modelzoo: error: {one_line(message)}", file=sys.stderr)
    return 2


def _interrupted(error: BaseException | str) -> int:
    # on a line of its own: after the terminal's ^C, or a progress bar of a rank that was stopped
    print(f"\nmodelzoo: {one_line(str(error) or 'interrupted')}; nothing was written", file=sys.stderr)
    return 128 + (signal.SIGTERM if str(error) == "terminated" else signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:
        return _error(error)
    output = Path(getattr(args, OUTPUTS[args.command])) if args.command in OUTPUTS else None
    # SIGTERM (a job scheduler's kill, `timeout`) unwinds like Ctrl-C: staging folders are removed; a second
    # signal does not cut that short
    with signals_interrupt():
        try:
            check_arguments(args)
            return args.func(args)
        except USER_ERRORS as error:
            return _error(error)
        except OSError as error:  # a file that cannot be read (writes are reported where they fail)
            if error.filename is None:
                raise
            return _error(f"{error.filename}: {error.strerror}")
        except RankFailed as error:  # what the rank's exception was, not its class's name, says how to report it
            if error.is_a(KeyboardInterrupt):
                return _interrupted(error.message)
            if error.is_a(*USER_ERRORS) or (error.is_a(OSError) and error.filename is not None):
                return _error(error.message)
            raise
        except RankDied as error:  # a rank killed from outside (the OOM killer, a signal to it alone)
            # on a line of its own: after the progress bar the rank could not clear
            print(f"\nmodelzoo: {error}; nothing was written", file=sys.stderr)
            return 128 - error.exit_code if error.exit_code < 0 else 1
        except ParityFailed as error:
            print(f"modelzoo: parity failed: {one_line(error)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as error:
            return _interrupted(error)
        finally:
            if output is not None and not output.exists():
                # ranks killed mid-write (this run's, after a failure, or a dead run's) leave their staging folders
                remove_stale_staging(output)


if __name__ == "__main__":
    sys.exit(main())
