"""Log-probabilities of the same tokens from the Megatron model and from the Hugging Face model.

Used by `modelzoo parity`, `modelzoo logprobs` and the tests. The HF side is the architecture's
oracle class (transformers' own where it exists), loaded without remote code.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from modelzoo.conversion import engine, validation
from modelzoo.conversion.files import check_files_of
from modelzoo.conversion.mapping import MappingError
from modelzoo import runtime
from modelzoo.registry import build_provider
from modelzoo.layers.sequences import pack_sequences


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(t[i+1] | t[:i+1]) from full-vocabulary logits [batch, seq, vocab] -> [batch, seq - 1]."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, input_ids[:, 1:, None])[..., 0]


@contextlib.contextmanager
def _transformers_quiet():
    verbosity, progress_bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress_bar:
            hf_logging.enable_progress_bar()


def check_before_building(provider, read_values: bool = False) -> None:
    """What `modelzoo import` checks before it writes, here before a model is built: the checkpoint's
    tensor names, shapes and kinds of dtype against the model the config describes, on the meta device,
    so that a config claiming more than its checkpoint holds is refused, not allocated. `read_values`:
    also read every tensor through the mapping, refusing NaN or infinite weights unless allowed (a
    Megatron load does so as it goes; a transformers load does not)."""
    reader = provider.checkpoint_reader(provider.hf_dir)
    try:
        tensors, elements = validation.reader_contents(reader)
        validation.check_config_fits(provider.hf_config, str(reader.folder), elements, tensors,
                                     provider.weights_per_unit)
        skeleton = provider.provide_skeleton()
        weights = engine.hf_weights(skeleton, provider.mapping(), reader)
        if read_values:
            for name in engine.megatron_tensors(skeleton):
                weights(name)
    finally:
        reader.close()


def load_hf_model(hf_dir: str | Path, dtype: torch.dtype = torch.float32, provider=None):
    """The oracle with every weight from the checkpoint: transformers would initialise a missing one at random
    and only log it, so a missing, unexpected or mis-shaped tensor is refused here (as the Megatron side does).
    `provider`: the checkpoint's provider, when the caller has built one already."""
    provider = provider if provider is not None else build_provider(hf_dir)
    # _transformers_quiet: its load report and progress bar; a mismatch is reported below, in one line
    with provider.oracle_checkpoint() as folder, _transformers_quiet():
        model, info = provider.hf_model_class().from_pretrained(folder, dtype=dtype, output_loading_info=True)
    problems = [f"{what} {', '.join(sorted(map(str, info[kind])))}" for kind, what in
                (("missing_keys", "missing tensors"), ("unexpected_keys", "unexpected tensors"),
                 ("mismatched_keys", "mis-shaped tensors")) if info[kind]]
    if problems:
        raise MappingError(f"{hf_dir}: the Hugging Face model {type(model).__name__} does not match the checkpoint: "
                           + "; ".join(problems))
    return model.eval()


@torch.no_grad()
def hf_outputs(hf_dir: str | Path, batches: list[torch.Tensor], dtype: torch.dtype = torch.float32,
               allow_non_finite: bool = False, options: dict | None = None):
    """For each batch of token ids: (token logprobs [b, s-1] fp32, logits [b, s, vocab] fp32) of the HF model
    (full-sequence forward); the model is loaded once for all batches, once the checkpoint is checked.
    `options`: the architecture's `build_provider` keywords the Megatron side runs with; the oracle's forward
    takes what they ask of it (`oracle_forward_kwargs`)."""
    with runtime.parallel(), validation.non_finite_allowed(allow_non_finite):
        # in the dtype the HF model is loaded in: a value finite as stored may not be once cast
        provider = build_provider(hf_dir, params_dtype=dtype, **(options or {}))
        check_before_building(provider, read_values=True)
    check_files_of(hf_dir)  # transformers opens whichever files it looks for: none may lead out of the folder
    model = load_hf_model(hf_dir, dtype, provider).to(runtime.device())
    outputs = []
    for input_ids in batches:
        logits = model(input_ids.to(runtime.device()), use_cache=False,
                       **provider.oracle_forward_kwargs()).logits.float().cpu()
        outputs.append((logprobs_from_logits(logits, input_ids), logits))
    return outputs


def right_padded(input_ids: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`input_ids` [b, s] right-padded to a multiple of `multiple` tokens (what sequence parallelism splits), and
    GPTModel's padding mask of it ([b, 1, 1, s'], True = padding), None when no padding is needed."""
    seq = input_ids.shape[1]
    padding = -seq % multiple
    if not padding:
        return input_ids, None
    mask = torch.zeros(input_ids.shape[0], 1, 1, seq + padding, dtype=torch.bool, device=input_ids.device)
    mask[..., seq:] = True
    return torch.nn.functional.pad(input_ids, (0, padding)), mask


def _megatron_rank(rank: int, hf_dir: str, batches: list[torch.Tensor], tp: int, ep: int, cp: int, dtype: torch.dtype,
                   attention: str, with_logits: bool, options: dict, packed: list[list[int]] | None = None,
                   allow_non_finite: bool = False, pp: int = 1):
    with runtime.parallel(tp=tp, ep=ep, cp=cp, pp=pp), validation.non_finite_allowed(allow_non_finite):
        provider = build_provider(hf_dir, params_dtype=dtype, attention=attention, perform_initialization=False,
                                  **options)
        check_before_building(provider)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        model.eval()
        # sequence parallelism splits each row over the TP ranks: rows and packed slots padded to a multiple of tp
        multiple = tp if options.get("sequence_parallel") else 1
        outputs = []
        with torch.no_grad():
            for input_ids in batches:
                seq = input_ids.shape[1]
                ids, mask = right_padded(input_ids.to(runtime.device()), multiple)
                logprobs = provider.token_logprobs(model, ids, attention_mask=mask)[:, :seq - 1].float().cpu()
                logits = None
                if with_logits:
                    logits = provider.gathered_logits(model, ids, attention_mask=mask)[:, :seq].float().cpu()
                outputs.append((logprobs, logits))
            if packed is not None:
                # sequence parallelism splits the row over tp ranks, context parallelism each sequence into 2 x cp chunks
                batch = pack_sequences(packed, divisor=math.lcm(multiple, 2 * cp), device=runtime.device())
                logprobs = provider.token_logprobs(model, batch.input_ids, packed_seq_params=batch.packed_seq_params)
                outputs.append([sequence.float().cpu() for sequence in logprobs])
        return outputs


def megatron_outputs(hf_dir: str | Path, batches: list[torch.Tensor], tp: int = 1, dtype: torch.dtype = torch.float32,
                     attention: str = "exact", with_logits: bool = True, ep: int = 1, options: dict | None = None,
                     packed: list[list[int]] | None = None, allow_non_finite: bool = False, cp: int = 1,
                     pp: int = 1):
    """For each batch: (token logprobs, logits or None) of the Megatron model on tp x ep x cp x pp ranks, as rank 0
    sees them (with pipeline stages, sent from the last stage); the model is built and loaded once for all batches.
    `options`: more keywords of `build_provider`. With `packed` (token-id lists), one more entry: each sequence's
    log-probs from one forward of them packed into a row.
    `allow_non_finite`: load NaN or infinite weights rather than refuse them.

    Every rank runs the same tokens (under EP the ranks are data-parallel replicas of the dense part; under CP each
    runs its share of every row and the results are gathered back).
    """
    return runtime.run(_megatron_rank, tp * ep * cp * pp, str(hf_dir), batches, tp, ep, cp, dtype, attention,
                       with_logits, options or {}, packed, allow_non_finite, pp)[0]
