"""Megatron-Core GPTModel's forward arguments, read the same way by every model of modelzoo.

    model(input_ids, position_ids, attention_mask, decoder_input=None, labels=None, inference_context=None,
          packed_seq_params=None, extra_block_kwargs=None, runtime_gather_output=None, *,
          inference_params=None, loss_mask=None, padding_mask=None)

Each argument means what it means to GPTModel (megatron/core/models/gpt/gpt_model.py): `labels` [b, s] turn the
output from this rank's vocabulary shard of the logits [b, s, V / tp] into the per-token loss [b, s]
(-log p(labels[t] | tokens up to t)); `runtime_gather_output=True` gathers the logits over the vocabulary;
`decoder_input` [s, b, hidden] replaces the embedding; `loss_mask` weighs the MTP loss (the main loss is
returned per token, unweighted, as GPTModel returns it). `attention_mask`, `position_ids` and
`packed_seq_params` describe the batch (`modelzoo.layers.sequences`); under context parallelism `input_ids`,
`position_ids` and `labels` are this rank's share of the rows (`modelzoo.layers.context_parallel`). What a model cannot honour (a KV-cache
inference context, extra kwargs for Megatron's own blocks) is refused by name with the reason.

Megatron pads the vocabulary to a multiple of lcm(128, tp) (`VOCAB_PADDING_MULTIPLE`). Trainers take their
log-softmax or cross entropy over every column of the vocab-parallel logits (SkyRL's
`from_parallel_logits_to_logprobs`, slime's `fused_vocab_parallel_cross_entropy`), so the padded columns get
`PADDED_VOCAB_LOGIT` in every output: exp of it underflows to exactly 0 next to any real logit, their
probability is 0 in fp32 and bf16 alike, and their gradient is 0, so the padded rows of the output layer
never train (they are zeros from the checkpoint, and the export drops them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from modelzoo.logprobs import vocab_parallel_logprobs
from modelzoo.layers.sequences import TokenLayout

# Megatron's value for a masked attention score: exp(-1e4 - m) is exactly 0 in fp32 (and bf16, fp16) for any
# real logit m above -9900, so a softmax over the padded columns equals one over the real vocabulary
PADDED_VOCAB_LOGIT = -10000.0


def refuse_unsupported(model_name: str, inference_context=None, inference_params=None, extra_block_kwargs=None,
                       output_processor=None) -> None:
    if inference_context is not None or inference_params is not None:
        raise ValueError(f"{model_name}: inference_context / inference_params (KV-cache decoding) are not supported: "
                         f"these models run whole sequences (training, prefill, log-probabilities)")
    if extra_block_kwargs:
        raise ValueError(f"{model_name}: extra_block_kwargs {sorted(extra_block_kwargs)} are for Megatron's own "
                         f"TransformerBlock, which this model does not use")
    if output_processor is not None:
        raise ValueError(f"{model_name}: output_processor is not supported: pass labels for the per-token loss, "
                         f"or take the logits")


def refuse_mtp_training(model_name: str, mtp_kwargs: dict | None) -> None:
    """slime / miles ask for MTP training with `mtp_kwargs={"mtp_labels": ...}`: a model without MTP layers says so."""
    if mtp_kwargs and mtp_kwargs.get("mtp_labels") is not None:
        raise ValueError(f"{model_name} has no MTP layers: mtp_kwargs={{'mtp_labels': ...}} asks for MTP training "
                         f"(turn it off in the trainer, e.g. slime's --enable-mtp-training)")


class GPTModelSurface:
    """What trainers call on a GPTModel beside its forward, refused by name where these models cannot honour it
    (Llama's GPTModel subclass too: its layers are not Megatron's TransformerLayers)."""

    def build_schedule_plan(self, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__}.build_schedule_plan: Megatron's combined 1F1B schedule (the expert all-to-all "
            f"overlapped with another micro-batch's compute) splits GPTModel's own layers into sub-modules, which "
            f"this model does not have; run without overlap_moe_expert_parallel_comm (slime: "
            f"--overlap-moe-expert-parallel-comm off)")


def rotary_per_token(rotary_pos_emb, layout: TokenLayout) -> Tensor:
    """Megatron's `RotaryEmbedding` -> each token's frequencies [s, b, 1, d]; for plain rows the table's first s
    rows as they are, [s, 1, 1, d]."""
    # the whole table [rope_length, 1, 1, d], whatever the context-parallel size: each token takes its own row
    # (`packed_seq=True` keeps Megatron from cutting the table into this rank's chunks, as it does for THD rows)
    table = rotary_pos_emb(layout.rope_length, packed_seq=True)
    if layout.plain:
        return table[: layout.shape[1]]
    return table[layout.rope_positions.transpose(0, 1)].squeeze(2)


def language_model_output(logits: Tensor, labels: Tensor | None, vocab_size: int,
                          runtime_gather_output: bool | None = None) -> Tensor:
    """Vocab-parallel logits [b, s, V_padded / tp] -> what GPTModel returns: the logits (gathered over the
    tensor-parallel group when `runtime_gather_output`), or with `labels` the per-token loss [b, s], fp32,
    over the real vocabulary (the padded rows of Megatron's vocabulary take no probability)."""
    logits = mask_padded_vocabulary(logits, vocab_size)
    if labels is not None:
        if labels.shape != logits.shape[:-1]:
            raise ValueError(f"labels must be [batch, seq] = {list(logits.shape[:-1])}, got {list(labels.shape)}")
        return -vocab_parallel_logprobs(logits, labels, vocab_size)
    if runtime_gather_output:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(logits)
    return logits


def mask_padded_vocabulary(logits: Tensor, vocab_size: int) -> Tensor:
    """This rank's vocabulary shard of the logits [..., V_padded / tp] with `PADDED_VOCAB_LOGIT` in the columns
    past the real vocabulary, in place (only the padded columns are written; their gradient becomes 0)."""
    from megatron.core import parallel_state

    rank = 0
    if parallel_state.model_parallel_is_initialized():
        rank = parallel_state.get_tensor_model_parallel_rank()
    real_columns = max(0, min(logits.shape[-1], vocab_size - rank * logits.shape[-1]))
    if real_columns < logits.shape[-1]:
        logits[..., real_columns:] = PADDED_VOCAB_LOGIT
    return logits


def input_layout(model_name: str, input_ids: Tensor | None, decoder_input: Tensor | None, position_ids, attention_mask,
                 packed_seq_params, max_positions: int, config) -> TokenLayout:
    """The batch's layout, from `input_ids` or, when the embedding is skipped, `decoder_input`'s [s, b] shape (under
    sequence parallelism this rank's s / tp tokens, as Megatron hands them between stages); under context
    parallelism, this rank's share of it."""
    from modelzoo.layers import context_parallel, sequence_parallel
    from modelzoo.layers.sequences import token_layout

    if input_ids is None:
        if decoder_input is None:
            raise ValueError(f"{model_name}: input_ids or decoder_input is needed")
        seq = decoder_input.shape[0] * (config.tensor_model_parallel_size if sequence_parallel.enabled(config) else 1)
        input_ids = torch.empty(decoder_input.shape[1], seq, dtype=torch.long, device=decoder_input.device)
    layout = token_layout(input_ids, position_ids, attention_mask, packed_seq_params, max_positions,
                          context_parallel.current())
    sequence_parallel.check_sequence_length(model_name, layout.shape[1], config)
    return layout
