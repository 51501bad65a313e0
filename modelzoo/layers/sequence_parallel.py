"""Sequence parallelism (Megatron's `sequence_parallel=True` with tensor parallelism), shared by every model.

Between the tensor-parallel regions (norms, residual streams, DeepSeek-V4's hyper-connections) the tokens of a
row are split along the sequence across the TP ranks: rank r holds tokens [r * S/tp, (r + 1) * S/tp). Megatron's
column-parallel linears all-gather their input along the sequence and its row-parallel linears reduce-scatter
their output (along dim 0, the `s` of its [s, b, h] layout). A parameter that acts on this rank's tokens only
(a norm's weight, a hyper-connection map) gets the gradient of those tokens: it is marked `sequence_parallel`,
and Megatron's `finalize_model_grads` sums such gradients over the TP group, as it does for its own norms.

The sequence must divide by the TP size (Megatron's rule: every rank holds the same number of tokens); packed
rows are padded to it by `pack_sequences(divisor=tp)`. The batch's `TokenLayout` always describes the whole row,
and is read only where the whole sequence is present (attention, after the gather).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor


def enabled(config) -> bool:
    """Whether `config` (a TransformerConfig) asks for sequence parallelism over more than one rank."""
    return bool(config.sequence_parallel) and config.tensor_model_parallel_size > 1


def check_sequence_length(model_name: str, seq_len: int, config) -> None:
    """Refuse a sequence the TP ranks cannot split evenly (one sentence)."""
    tp = config.tensor_model_parallel_size
    if enabled(config) and seq_len % tp:
        raise ValueError(f"{model_name}: with sequence parallelism the sequence length ({seq_len}) must be a multiple "
                         f"of the tensor-parallel size ({tp}); pad the rows (pack_sequences(divisor={tp}) does)")


def mark_sequence_parallel(module: torch.nn.Module, config) -> torch.nn.Module:
    """Mark `module`'s parameters as acting on this rank's tokens (their gradients are summed over TP)."""
    for param in module.parameters():
        param.sequence_parallel = enabled(config)
    return module


def rms_norm(config, hidden_size: int, eps: float = 1e-5, **unused_megatron_kwargs) -> torch.nn.RMSNorm:
    """The local spec's RMSNorm (torch.nn.RMSNorm, as Megatron's WrappedTorchNorm builds it), which Megatron
    refuses under sequence parallelism only for want of the mark its fused norms set: set here."""
    return mark_sequence_parallel(torch.nn.RMSNorm(hidden_size, eps=eps), config)


def whole_sequence_config(config):
    """`config` for the parallel linears of a module that runs on the gathered sequence in a batch-first model:
    Megatron's linears read `sequence_parallel` and would gather dim 0 (the batch there) themselves."""
    if not config.sequence_parallel:
        return config
    whole = copy.copy(config)
    whole.sequence_parallel = False
    return whole


def gather_sequence(x: Tensor, dim: int) -> Tensor:
    """This rank's tokens -> the whole sequence along `dim`, all-gathered over the TP group (contiguous).

    The backward keeps this rank's slice of the gradient, without a sum: what follows is tensor-parallel
    math whose input gradient is already whole on every rank (Megatron's
    `gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)`)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    gathered = gather_from_sequence_parallel_region(x.transpose(0, dim), tensor_parallel_output_grad=False)
    return gathered.transpose(0, dim).contiguous()  # no copy for dim 0, or a batch of one


def split_sequence(x: Tensor, dim: int) -> Tensor:
    """The whole sequence along `dim` (the same on every TP rank) -> this rank's tokens (contiguous); the backward
    all-gathers."""
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(x.transpose(0, dim)).transpose(0, dim).contiguous()
