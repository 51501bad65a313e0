"""How the trainers feed a Megatron model and read its logits, run as the trainers run it.

SkyRL (`skyrl==0.4.0`, installed by .ci/setup): its own functions are imported and called:
`preprocess_packed_seqs` (sample packing), `remove_left_padding` / `to_te_attention_mask` / `recover_left_padding`
(its unpacked path), `from_parallel_logits_to_logprobs(_packed_sequences)` and its routing replay
(`setup_per_microbatch_replay_forward`). Its Megatron model wrapper imports Megatron-Bridge, which needs Transformer
Engine, so `megatron_model_wrapper.py` is not importable here; `skyrl_packed_targets` below restates its six-line
`_build_packed_targets`, and the forward steps restate the wrapper's calls around the model.

slime / miles are not on the package registry. `slime_get_batch`, `slime_get_responses`, `slime_logprobs` and
`SlimeRoutingReplay` restate THUDM/slime at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21):
`slime/backends/megatron_utils/data.py:get_batch` (THD row of per-sample CP slices, padded to a multiple of
tp x 128 with one more cu_seqlens entry, cu_seqlens scaled by the CP size, no cu_seqlens_q_padded),
`cp_utils.py:slice_with_cp` / `get_logits_and_tokens_offset_with_cp`, `loss.py:get_responses`, the log-prob of
`utils/ppo_utils.py` (minus Megatron's `fused_vocab_parallel_cross_entropy` over the shard's columns, called here
as slime calls it), `model.py:forward_step` (`mtp_kwargs={"mtp_labels": tokens}` with labels None) and
`utils/routing_replay.py` with its Megatron patch (a `RoutingReplay` per router, record / replay_forward stages).
"""

from __future__ import annotations

import os

import torch
from megatron.core import parallel_state as mpu
from megatron.core.packed_seq_params import PackedSeqParams

# --- SkyRL ----------------------------------------------------------------------------------------------------------
def skyrl_batch(samples: list[list[int]], prompt_lengths: list[int]) -> dict[str, torch.Tensor]:
    """SkyRL's micro-batch: prompts left-padded to the longest prompt, responses right-padded, attention_mask 1 on
    real tokens, position ids counting real tokens (its generator's layout)."""
    prompt_width = max(prompt_lengths)
    response_width = max(len(s) - p for s, p in zip(samples, prompt_lengths))
    width = prompt_width + response_width
    sequences = torch.zeros(len(samples), width, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, (sample, prompt) in enumerate(zip(samples, prompt_lengths)):
        start = prompt_width - prompt
        sequences[row, start:start + len(sample)] = torch.tensor(sample)
        attention_mask[row, start:start + len(sample)] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return dict(sequences=sequences, attention_mask=attention_mask, position_ids=position_ids)


def skyrl_packed_targets(sequences: torch.Tensor, attention_mask: torch.Tensor, packed_seq_params) -> torch.Tensor:
    """SkyRL 0.4.0 megatron_model_wrapper.py `_build_packed_targets` (no sub-sequences): every real token at its
    packed place, [1, T]."""
    cu_padded = packed_seq_params.cu_seqlens_q_padded.long()
    targets = torch.zeros(int(cu_padded[-1]), dtype=sequences.dtype)
    packed_indices = cu_padded[:-1].unsqueeze(1) + attention_mask.long().cumsum(dim=1) - 1
    targets[packed_indices[attention_mask]] = sequences[attention_mask]
    return targets.unsqueeze(0)


def skyrl_packed_forward(model, batch: dict, **model_kwargs):
    """The wrapper's forward_step with sample packing: (logits [1, T / cp, V / tp], packed_seq_params, targets)."""
    from skyrl.backends.skyrl_train.distributed.megatron.megatron_utils import preprocess_packed_seqs

    attention_mask = batch["attention_mask"].bool()
    tokens, packed_seq_params = preprocess_packed_seqs(batch["sequences"], attention_mask, pre_process=True)
    targets = skyrl_packed_targets(batch["sequences"], attention_mask, packed_seq_params)
    logits = model(tokens, None, None, packed_seq_params=packed_seq_params, **model_kwargs)
    return logits, packed_seq_params, targets


def skyrl_packed_logprobs(model, batch: dict, inference_only: bool = True, **model_kwargs) -> torch.Tensor:
    """[B, S - 1]: log p(next real token) at each real token's column (SkyRL's layout), zeros elsewhere."""
    from skyrl.backends.skyrl_train.distributed.megatron.model_utils import (
        from_parallel_logits_to_logprobs_packed_sequences,
    )

    logits, packed_seq_params, targets = skyrl_packed_forward(model, batch, **model_kwargs)
    shard = logits.shape[-1]
    rank = mpu.get_tensor_model_parallel_rank()
    return from_parallel_logits_to_logprobs_packed_sequences(
        logits, targets, packed_seq_params.cu_seqlens_q_padded, batch["sequences"].shape[1], rank * shard,
        (rank + 1) * shard, mpu.get_tensor_model_parallel_group(), inference_only=inference_only,
        cp_group=mpu.get_context_parallel_group(), attention_mask=batch["attention_mask"].bool())


def skyrl_unpacked_logprobs(model, batch: dict) -> torch.Tensor:
    """SkyRL without sample packing: left padding removed, a [b, 1, 1, s] padding mask and position ids passed."""
    from skyrl.backends.skyrl_train.distributed.megatron.megatron_utils import (
        recover_left_padding,
        remove_left_padding,
        to_te_attention_mask,
    )
    from skyrl.backends.skyrl_train.distributed.megatron.model_utils import from_parallel_logits_to_logprobs

    attention_mask = batch["attention_mask"].bool()
    tokens, new_mask, new_positions = remove_left_padding(batch["sequences"], attention_mask, batch["position_ids"])
    logits = model(tokens, new_positions, to_te_attention_mask(new_mask))
    logits = recover_left_padding(logits, new_mask, attention_mask, batch["sequences"].shape[1])
    shard = logits.shape[-1]
    rank = mpu.get_tensor_model_parallel_rank()
    return from_parallel_logits_to_logprobs(logits, batch["sequences"], rank * shard, (rank + 1) * shard,
                                            mpu.get_tensor_model_parallel_group(), inference_only=True)


def skyrl_packed_alignment(tp: int, cp: int) -> int:
    """The multiple SkyRL pads each packed sample to; the padding counts as the sample's tokens (cu_seqlens_q =
    cu_seqlens_q_padded), so the model sees the sample followed by that many zeros."""
    from skyrl.backends.skyrl_train.distributed.megatron.packing_utils import get_packed_seq_align_size

    return get_packed_seq_align_size(tp, cp)


def skyrl_layout_logprobs(samples: list[list[int]], prompt_lengths: list[int],
                          per_sample: list[torch.Tensor]) -> torch.Tensor:
    """Per-sample log-probs ([len - 1] each) placed as SkyRL returns them: [B, S - 1]."""
    batch = skyrl_batch(samples, prompt_lengths)
    out = torch.zeros(batch["sequences"].shape[0], batch["sequences"].shape[1] - 1)
    for row, values in enumerate(per_sample):
        start = int(batch["attention_mask"][row].argmax())
        out[row, start:start + len(values)] = values
    return out


def skyrl_replay_kwargs(model, batch: dict, engine_ids: list[torch.Tensor]) -> dict:
    """SkyRL's per-micro-batch routing replay with the engine's expert ids (per sample [len, layers, top_k]) for a
    packed forward: installs them in the routers' RouterReplay and returns the model's extra kwargs."""
    from skyrl.backends.skyrl_train.distributed.megatron.token_metadata import build_token_metadata_layout
    from skyrl.backends.skyrl_train.utils.packed_tensor import PackedTensor
    from skyrl.backends.skyrl_train.utils.replay_utils import setup_per_microbatch_replay_forward

    attention_mask = batch["attention_mask"].bool()
    layout = build_token_metadata_layout(attention_mask, attention_mask.device, packed=True, fp8_enabled=False)
    return setup_per_microbatch_replay_forward(
        PackedTensor.from_segments([ids.to(torch.int32) for ids in engine_ids]), ~attention_mask, attention_mask,
        model=model, model_config=model.config, metadata_layout=layout, remove_microbatch_padding=True)


# --- slime / miles (commit 624b824) ---------------------------------------------------------------------------------
SLIME_PAD_MULTIPLIER = 128


def slime_slice_with_cp(tokens: torch.Tensor) -> torch.Tensor:
    """cp_utils.slice_with_cp: the sample padded to 2 x cp chunks, this rank's chunks r and 2 cp - 1 - r."""
    cp_size, cp_rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    if cp_size == 1:
        return tokens
    chunk = (len(tokens) + 2 * cp_size - 1) // (2 * cp_size)
    tokens = torch.nn.functional.pad(tokens, (0, 2 * cp_size * chunk - len(tokens)), value=0)
    second = 2 * cp_size - cp_rank - 1
    return torch.cat([tokens[chunk * cp_rank:chunk * (cp_rank + 1)], tokens[chunk * second:chunk * (second + 1)]])


def slime_alignment(cp: int) -> int:
    """The multiple slime pads each sample to (slice_with_cp, under context parallelism); the padding counts as the
    sample's tokens."""
    return 2 * cp if cp > 1 else 1


def slime_get_batch(samples: list[list[int]]) -> dict:
    """data.get_batch (allgather_cp off): this rank's THD row and its PackedSeqParams."""
    cp_size = mpu.get_context_parallel_world_size()
    pad_size = mpu.get_tensor_model_parallel_world_size() * SLIME_PAD_MULTIPLIER
    unconcat = [torch.tensor(sample) for sample in samples]
    pieces = [slime_slice_with_cp(tokens) for tokens in unconcat]
    cu_seqlens = [0]
    for piece in pieces:
        cu_seqlens.append(cu_seqlens[-1] + len(piece))
    tokens = torch.cat(pieces)
    pad = (pad_size - len(tokens) % pad_size) % pad_size
    if pad:  # the row's padding: one more sequence
        tokens = torch.nn.functional.pad(tokens, (0, pad), value=0)
        cu_seqlens.append(cu_seqlens[-1] + pad)
    cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int) * cp_size
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    params = PackedSeqParams(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_seqlen,
                             max_seqlen_kv=max_seqlen, qkv_format="thd")
    return dict(tokens=tokens.unsqueeze(0), packed_seq_params=params, unconcat_tokens=unconcat)


def _logit_and_token_offsets_with_cp(total_length: int, response_length: int):
    """cp_utils.get_logits_and_tokens_offset_with_cp."""
    cp_size, cp_rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    prompt_length = total_length - response_length
    chunk = (total_length + 2 * cp_size - 1) // (2 * cp_size)
    chunks = ((cp_rank * chunk, (cp_rank + 1) * chunk),
              ((2 * cp_size - cp_rank - 1) * chunk, (2 * cp_size - cp_rank) * chunk))
    logits, tokens = [], []
    for start, end in chunks:
        first, last = max(start, prompt_length - 1), min(end, total_length - 1)
        if first < last:
            logits.append((first, last))
            tokens.append((first + 1, last + 1))
        else:  # an empty slice keeps the gradient flowing
            logits.append((0, 0))
            tokens.append((0, 0))
    return chunk, chunks, logits, tokens


def slime_get_responses(logits: torch.Tensor, unconcat_tokens: list[torch.Tensor], response_lengths: list[int]):
    """loss.get_responses: per sample (logits [R_rank, V / tp], its response tokens [R_rank], their indices in the
    sample) for the response tokens this rank holds."""
    logits = logits.squeeze(0)
    cp_size = mpu.get_context_parallel_world_size()
    end = 0
    for tokens, response_length in zip(unconcat_tokens, response_lengths, strict=True):
        total_length = len(tokens)
        if cp_size == 1:
            end += total_length
            start = end - response_length
            yield logits[start - 1:end - 1], tokens[-response_length:], torch.arange(total_length - response_length,
                                                                                     total_length)
            continue
        chunk, chunks, logit_offsets, token_offsets = _logit_and_token_offsets_with_cp(total_length, response_length)
        parts = (logits[end:end + chunk], logits[end + chunk:end + 2 * chunk])
        end += 2 * chunk
        chunk_logits = [part[first - base:last - base] for part, (first, last), (base, _)
                        in zip(parts, logit_offsets, chunks)]
        yield (torch.cat(chunk_logits), torch.cat([tokens[a:b] for a, b in token_offsets]),
               torch.cat([torch.arange(a, b) for a, b in token_offsets]))


def slime_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """ppo_utils' log-prob: minus Megatron's fused vocab-parallel cross entropy over the shard's columns, on an fp32
    copy of the logits (slime trains in bf16, where its `.float()` copies; Megatron's fused cross entropy subtracts
    the maximum in place, which must not reach the model's fp32 output that the other samples' slices share)."""
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    if logits.shape[0] == 0:  # none of the sample's responses on this rank (calculate_log_probs_and_entropy)
        return logits.new_zeros((0,))
    return -fused_vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True).unsqueeze(1), tokens.unsqueeze(1),
                                               mpu.get_tensor_model_parallel_group()).squeeze(1)


def slime_forward(model, samples: list[list[int]], mtp: bool = False):
    """model.forward_step's call: (logits, the batch)."""
    batch = slime_get_batch(samples)
    kwargs = dict(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                  packed_seq_params=batch["packed_seq_params"], loss_mask=None)
    if mtp:
        kwargs["mtp_kwargs"] = {"mtp_labels": batch["tokens"]}
    return model(**kwargs), batch


def slime_response_logprobs(model, samples: list[list[int]], response_lengths: list[int]):
    """Per sample: (this rank's response log-probs, their token indices in the sample)."""
    logits, batch = slime_forward(model, samples)
    return [(slime_logprobs(chunk_logits, chunk_tokens), indices)
            for chunk_logits, chunk_tokens, indices
            in slime_get_responses(logits, batch["unconcat_tokens"], response_lengths)]


class SlimeRoutingReplay:
    """utils/routing_replay.py's RoutingReplay with its Megatron patch, for a model whose routers call Megatron's
    `RouterReplay.get_replay_topk(scores, topk, num_groups, group_topk, compute_topk)` positionally (as Megatron's
    TopKRouter does): slime swaps in its own `compute_topk` that reads ROUTING_REPLAY_STAGE. One replay per router,
    in the decoder's layer order (slime's fill_routing_replay records the rollout's ids layer by layer)."""

    def __init__(self, routers: list[torch.nn.Module]):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.replays = {id(router): _SlimeReplayOfRouter() for router in routers}
        self.current = None
        self.hooks = [router.register_forward_pre_hook(self._enter) for router in routers]
        self.original = RouterReplay.get_replay_topk
        replay = self

        def get_replay_topk(router_replay, scores, topk, num_groups=None, group_topk=None, old_compute_topk=None):
            return replay.compute_topk(old_compute_topk, scores, topk, num_groups, group_topk)

        RouterReplay.get_replay_topk = get_replay_topk

    def _enter(self, router, args):
        self.current = self.replays[id(router)]

    def compute_topk(self, old_compute_topk, scores, topk, num_groups, group_topk):
        stage = os.environ.get("ROUTING_REPLAY_STAGE", "fallthrough")
        if stage == "replay_forward":
            top_indices = self.current.pop_forward()
            assert top_indices.shape == (scores.shape[0], topk), (top_indices.shape, scores.shape, topk)
            return scores.gather(1, top_indices.long()), top_indices
        probs, top_indices = old_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if stage == "record":
            self.current.record(top_indices)
        return probs, top_indices

    def recorded(self) -> list[torch.Tensor]:
        return [replay.top_indices[0] for replay in self.replays.values()]

    def fill(self, per_layer: list[torch.Tensor]) -> None:
        for replay, ids in zip(self.replays.values(), per_layer, strict=True):
            replay.clear()
            replay.record(ids)

    def close(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.get_replay_topk = self.original
        for hook in self.hooks:
            hook.remove()


class _SlimeReplayOfRouter:
    def __init__(self):
        self.clear()

    def clear(self):
        self.top_indices, self.forward_index = [], 0

    def record(self, top_indices: torch.Tensor):
        self.top_indices.append(top_indices.detach().clone())

    def pop_forward(self) -> torch.Tensor:
        self.forward_index += 1
        return self.top_indices[self.forward_index - 1].to(torch.int32)
