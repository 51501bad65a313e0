"""Triton kernels of `logprobs.py`'s two passes over the logits, on a GPU: one program per row (token),
looping over its shard of the vocabulary in blocks; fp32 inside, the logits read in their own dtype.

The same signatures as `logprobs.PlainOps`, which tests/test_logprobs.py compares them against (in Triton's
CPU interpreter and on a GPU). Any number of rows and columns without recompiling: the shapes are runtime
arguments, so sequences of changing length (RL rollouts) compile these once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_COLUMNS = 2048  # vocabulary columns per loop step: 8 fp32 per thread at 8 warps
WARPS = 8


@triton.jit
def _statistics(logits, row_stride, targets, largest_out, sum_exp_out, target_out, valid_columns,
                BLOCK: tl.constexpr):
    """Online softmax over one row: the running maximum, the sum of exp rescaled whenever it grows, and the
    target's logit (the sum of the one matching column, 0 where the target is not among this shard's real
    columns)."""
    row = tl.program_id(0).to(tl.int64)
    start = logits + row * row_stride
    target = tl.load(targets + row)
    largest = tl.full([], float("-inf"), tl.float32)
    sum_exp = tl.zeros([], tl.float32)
    target_logit = tl.zeros([], tl.float32)
    for first in range(0, valid_columns, BLOCK):
        columns = first + tl.arange(0, BLOCK)
        inside = columns < valid_columns
        x = tl.load(start + columns, mask=inside, other=float("-inf")).to(tl.float32)
        grown = tl.maximum(largest, tl.max(x, axis=0))  # finite: each block holds at least one column
        sum_exp = sum_exp * tl.exp(largest - grown) + tl.sum(tl.exp(x - grown), axis=0)
        largest = grown
        target_logit += tl.sum(tl.where((columns == target) & inside, x, 0.0), axis=0)
    tl.store(largest_out + row, largest)
    tl.store(sum_exp_out + row, sum_exp)
    tl.store(target_out + row, target_logit)


@triton.jit
def _gradient(grad, logits, row_stride, targets, log_normaliser, grad_logits, valid_columns, columns_total,
              BLOCK: tl.constexpr):
    """grad * (onehot(target) - exp(logit - log normaliser)) over one row; 0 on padding columns."""
    row = tl.program_id(0).to(tl.int64)
    start = logits + row * row_stride
    g = tl.load(grad + row)
    target = tl.load(targets + row)
    normaliser = tl.load(log_normaliser + row)
    for first in range(0, columns_total, BLOCK):
        columns = first + tl.arange(0, BLOCK)
        inside = columns < valid_columns
        x = tl.load(start + columns, mask=inside, other=float("-inf")).to(tl.float32)
        value = g * (tl.where((columns == target) & inside, 1.0, 0.0) - tl.exp(x - normaliser))
        tl.store(grad_logits + row * columns_total + columns, value.to(grad_logits.dtype.element_ty),
                 mask=columns < columns_total)


def statistics(rows: torch.Tensor, targets: torch.Tensor, valid_columns: int):
    rows = _unit_column_stride(rows)
    largest, sum_exp, target_logit = (torch.empty(rows.shape[0], device=rows.device) for _ in range(3))
    _statistics[(rows.shape[0],)](rows, rows.stride(0), targets.contiguous(), largest, sum_exp, target_logit,
                                  valid_columns, BLOCK=BLOCK_COLUMNS, num_warps=WARPS)
    return largest, sum_exp, target_logit


def gradient(grad, rows, targets, log_normaliser, valid_columns):
    rows = _unit_column_stride(rows)
    grad_rows = torch.empty(rows.shape, device=rows.device, dtype=rows.dtype)
    _gradient[(rows.shape[0],)](grad, rows, rows.stride(0), targets.contiguous(), log_normaliser, grad_rows,
                                valid_columns, rows.shape[1], BLOCK=BLOCK_COLUMNS, num_warps=WARPS)
    return grad_rows


def _unit_column_stride(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(1) == 1 else rows.contiguous()
