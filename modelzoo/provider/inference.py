"""A provider's forwards for inference and parity: log-probabilities and full logits on every parallel layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

from modelzoo import runtime
from modelzoo.conversion import engine
from modelzoo.layers import context_parallel
from modelzoo.logprobs import next_token_logprobs, vocab_parallel_logprobs


class InferenceHelpers:
    """`ModelProvider`'s forwards: GPTModel's call on every rank, pipeline stages and context parallelism included."""

    def token_logprobs(self, model: torch.nn.Module, input_ids: torch.Tensor, *, position_ids=None,
                       attention_mask=None, packed_seq_params=None, loss_mask: torch.Tensor | None = None):
        """log p(t[i+1] | t[:i+1]) from one forward, fp32, on every TP and CP rank.

        - rows `input_ids` [b, s] (padded ones with `attention_mask` / `position_ids`, GPTModel's arguments):
          a tensor [b, s - 1]; entries whose target is padding mean nothing;
        - a packed row [1, T] with `packed_seq_params` (THD): a list of each sequence's [length - 1] tensor,
          equal to running that sequence alone;
        - with `loss_mask` (same shape as input_ids, nonzero on the tokens to score, e.g. the response tokens):
          a list, per row or per packed sequence, of the scored tokens' log-probabilities, in order.
        Under context parallelism every rank passes the whole batch: each runs its share (`modelzoo.layers.context_parallel`)
        and the log-probabilities are gathered back.
        """
        from modelzoo.layers.sequences import BatchLayoutError, packed_spans

        if context_parallel.current() is None:
            logits = self.forward(model, input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                  packed_seq_params=packed_seq_params)
            logprobs = next_token_logprobs(logits, input_ids, self.vocab_size)     # [b, s - 1]
        else:
            logprobs = self._context_parallel_logprobs(model, input_ids, position_ids, attention_mask,
                                                       packed_seq_params)
        if packed_seq_params is None:
            spans = [(row, 0, input_ids.shape[1]) for row in range(input_ids.shape[0])]
            if loss_mask is None:
                return logprobs
        else:
            lengths, offsets = packed_spans(packed_seq_params, input_ids.shape[1])
            spans = [(0, offset, length) for offset, length in zip(offsets, lengths)]
        if loss_mask is None:
            return [logprobs[row, start:start + length - 1] for row, start, length in spans]
        if loss_mask.shape != input_ids.shape:
            raise BatchLayoutError(f"loss_mask must have input_ids' shape {list(input_ids.shape)}, "
                                   f"got {list(loss_mask.shape)}")
        scored = loss_mask.to(device=logprobs.device) != 0
        first = [number for number, (row, start, _) in enumerate(spans) if scored[row, start]]
        if first:
            raise BatchLayoutError(f"loss_mask marks the first token of sequence {first[0]}, which has no "
                                   f"log-probability (nothing precedes it)")
        return [logprobs[row, start:start + length - 1][scored[row, start + 1:start + length]]
                for row, start, length in spans]

    def _context_parallel_logprobs(self, model, input_ids, position_ids, attention_mask, packed_seq_params):
        """`next_token_logprobs` of the whole batch from this CP rank's share of it: each token's target is read
        from the whole row before it is split, and the per-token result is gathered back."""
        seq = input_ids.shape[1]
        packed_rows = None if packed_seq_params is not None else context_parallel.rows_as_packed(input_ids,
                                                                                                  position_ids)
        if packed_rows is not None:  # rows the ranks cannot split evenly: each row a sequence in a padded slot
            batch, positions = packed_rows
            logprobs = self._context_parallel_logprobs(model, batch.input_ids, positions, attention_mask,
                                                       batch.packed_seq_params)
            return torch.stack([logprobs[0, start:start + seq - 1] for start in batch.offsets])
        targets = input_ids.roll(-1, dims=1)
        local_ids, local_targets, local_positions = (context_parallel.split_for_rank(tensor, packed_seq_params)
                                                     for tensor in (input_ids, targets, position_ids))
        logits = self.forward(model, local_ids, position_ids=local_positions, attention_mask=attention_mask,
                              packed_seq_params=packed_seq_params)
        local = vocab_parallel_logprobs(logits, local_targets, self.vocab_size)
        return context_parallel.gather_from_ranks(local, packed_seq_params)[:, : seq - 1]

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor, **call) -> torch.Tensor:
        """`model(input_ids, **call)` (GPTModel's call) on every rank; `input_ids` are this CP rank's share under
        context parallelism. With several pipeline stages, one micro-batch through Megatron's forward-only schedule;
        the last stage's output is sent to every stage."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        group = engine.pipeline_group()
        if group is None:
            return model(input_ids, **call)
        kept = []

        def forward_step(data_iterator, module):
            def keep(output):
                kept.append(output)
                return output.new_zeros(()), {}
            return module(input_ids, **call), keep

        # the schedule's seq_length is the whole row's: it divides it by the CP size (and TP size under SP) itself
        whole_row = input_ids.shape[1] * parallel_state.get_context_parallel_world_size()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=self.pipeline_seq_length(whole_row), micro_batch_size=input_ids.shape[0], forward_only=True)
        last = dist.get_global_rank(group, dist.get_world_size(group) - 1)
        described = [(tuple(kept[0].shape), kept[0].dtype) if parallel_state.is_pipeline_last_stage() else None]
        dist.broadcast_object_list(described, src=last, group=group)
        shape, dtype = described[0]
        output = kept[0].contiguous() if kept else torch.empty(shape, dtype=dtype, device=runtime.device())
        dist.broadcast(output, src=last, group=group)
        return output

    @torch.no_grad()
    def gathered_logits(self, model: torch.nn.Module, input_ids: torch.Tensor, **call) -> torch.Tensor:
        """Full-vocabulary logits [batch, seq, vocab] on every rank (for parity checks; not for training); under
        context parallelism from the whole rows, each rank running its share."""
        from megatron.core import parallel_state

        seq, packed_seq_params = input_ids.shape[1], call.get("packed_seq_params")
        packed_rows = None if packed_seq_params is not None else context_parallel.rows_as_packed(
            input_ids, call.get("position_ids"))
        if packed_rows is not None:  # rows the ranks cannot split evenly: each row a sequence in a padded slot
            batch, positions = packed_rows
            call = {**call, "packed_seq_params": batch.packed_seq_params}
            if positions is not None:
                call["position_ids"] = positions
            logits = self.gathered_logits(model, batch.input_ids, **call)
            return torch.stack([logits[0, start:start + seq] for start in batch.offsets])
        local = self.forward(model, context_parallel.split_for_rank(input_ids, packed_seq_params),
                             **call).contiguous()
        shards = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
        dist.all_gather(shards, local, group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1)[..., : self.vocab_size]
        return context_parallel.gather_from_ranks(logits, packed_seq_params)[:, :seq]
