"""Token log-probabilities from vocab-parallel logits, in the logits' own dtype.

`next_token_logprobs(logits, input_ids, vocab_size)` is log softmax(logits[:, i])[input_ids[:, i + 1]] over
the whole vocabulary, where `logits` [batch, seq, local vocab] is this TP rank's shard of Megatron's padded
vocabulary; columns at or past `vocab_size` are padding and get no probability. It is what
`ModelProvider.token_logprobs` returns and, negated, every loss of ours.

Each rank reduces its shard to three numbers per position (its largest logit, the sum of exp(logit - that
maximum), the target's logit where the rank holds it), and the ranks combine them with two all-reduces, as
Megatron's `vocab_parallel_cross_entropy` does. That function wants fp32 logits: bf16 logits' fp32 copy is
twice their size, and it makes about eight passes over it forward and backward, keeping an fp32 softmax for
the backward (about 3 ms of a 4096 x 32000 step on the H200). Here the statistics are one pass over the
logits as they are (fp32 inside: an online softmax), the backward one pass that writes their gradient, and
only the logits themselves are kept. On a GPU each pass is a Triton kernel (`logprob_kernels.py`); on CPU
plain ops compute the same (the path of the parity tests, and the oracle of the kernels' test).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, vocab_size: int,
                        shift: int = 1) -> torch.Tensor:
    """log p(input_ids[:, i + shift] | logits[:, i]) for i < seq - shift: [batch, seq - shift], fp32, on every TP rank."""
    # the last `shift` positions have no target: they get stand-ins (the roll's wrap-around), dropped below
    targets = input_ids.roll(-shift, dims=1)
    return vocab_parallel_logprobs(logits, targets, vocab_size)[:, : input_ids.shape[1] - shift]


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log softmax(logits)[targets] over the whole vocabulary, [*targets.shape] fp32; `logits` [*targets.shape,
    local vocab] is this rank's shard of the tensor-parallel group's padded vocabulary."""
    from megatron.core import parallel_state

    group, rank = None, 0
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_world_size() > 1:
        group, rank = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()
    return _VocabParallelLogprobs.apply(logits, targets, rank * logits.shape[-1], vocab_size, group)


class _VocabParallelLogprobs(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group):
        # targets as columns of this shard (outside it: another rank's)
        rows, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1) - vocab_start
        valid_columns = max(0, min(rows.shape[1], vocab_size - vocab_start))  # the rest of the shard is padding
        largest, sum_exp, target_logit = _implementation(rows).statistics(rows, targets, valid_columns)
        if group is not None:
            global_largest = largest.clone()
            dist.all_reduce(global_largest, dist.ReduceOp.MAX, group=group)
            sums = torch.stack([sum_exp * torch.exp(largest - global_largest), target_logit])
            dist.all_reduce(sums, group=group)
            largest, (sum_exp, target_logit) = global_largest, sums
        log_normaliser = largest + torch.log(sum_exp)
        ctx.save_for_backward(rows, targets, log_normaliser)
        ctx.valid_columns, ctx.shape = valid_columns, logits.shape
        return (target_logit - log_normaliser).view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad):
        rows, targets, log_normaliser = ctx.saved_tensors
        grad_rows = _implementation(rows).gradient(grad.reshape(-1).float().contiguous(), rows, targets,
                                                   log_normaliser, ctx.valid_columns)
        return grad_rows.view(ctx.shape), None, None, None, None


def _implementation(rows: torch.Tensor):
    if rows.is_cuda:
        from modelzoo import logprob_kernels
        return logprob_kernels
    return PlainOps


class PlainOps:
    """The two passes as plain ops, on rows [tokens, shard columns]; columns from `valid_columns` on are padding.
    `targets` index the shard: one outside its real columns is not this rank's (a target id past the
    vocabulary is no rank's, and its log-probability is minus the log normaliser)."""

    @staticmethod
    def statistics(rows, targets, valid_columns):
        """(largest logit, sum of exp(logit - largest), the target's logit or 0) per row, fp32."""
        logits = PlainOps._masked(rows, valid_columns)
        largest = logits.amax(-1)
        # a shard of padding only has no largest logit: its sum is 0 whatever the shift
        sum_exp = torch.exp(logits - largest.nan_to_num(neginf=0.0)[:, None]).sum(-1)
        holds = (targets >= 0) & (targets < valid_columns)
        target_logit = logits.gather(1, targets.clamp(0, rows.shape[1] - 1)[:, None]).squeeze(1)
        return largest, sum_exp, torch.where(holds, target_logit, 0.0)

    @staticmethod
    def gradient(grad, rows, targets, log_normaliser, valid_columns):
        """d/d rows of sum(grad * logprob): grad * (onehot(target) - softmax), in the rows' dtype."""
        probabilities = torch.exp(PlainOps._masked(rows, valid_columns) - log_normaliser[:, None])
        onehot = (torch.arange(rows.shape[1], device=rows.device) == targets[:, None]) & (targets < valid_columns)[:, None]
        return (grad[:, None] * (onehot.float() - probabilities)).to(rows.dtype)

    @staticmethod
    def _masked(rows, valid_columns):
        logits = rows.float()
        if valid_columns < rows.shape[1]:
            logits = logits.masked_fill(torch.arange(rows.shape[1], device=rows.device) >= valid_columns,
                                        float("-inf"))
        return logits
