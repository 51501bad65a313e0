"""The DeepSeek-V4.1 text model on Megatron-Core parallel layers (our reference: modelzoo/deepseek_v41/hf_model.py).

    streams = embed(ids) copied into hc_mult streams; pre = one-hot on stream 0      VocabParallelEmbedding
    for each layer:                                                                 decoder.layers.N
        [Engram: streams += gate * value(table[n-gram hashes])]                      row-sharded tables
        attention site: its (pre, post, comb) from its streams; input collapsed with the previous site's pre
        FFN site:       its (pre, post, comb); input collapsed with the attention site's pre
    logits = output_layer(final_norm(collapse(streams, last FFN pre)))             no hc_head
    DSpark (mtp.layers.K, frozen): draft logits of a block after each position, from the stream means of the
    target layers' attention inputs                                                 `forward(draft_anchor_ids=...)`

Tensors are batch-first [B, S, ...] like the reference, so the parity path runs the same ops in the same order.
Module names follow Megatron's and DeepSeek-V4's (mapping.py maps them to the checkpoint's).

Packed (THD) and padded batches run each sequence as a right-padded row of one forward (`each_sequence`): the
compressor pools fixed positions from each sequence's start. Under context parallelism (Megatron's layout, plain or
packed rows) a rank runs its tokens of each sequence as such rows, with the keys, latents and n-grams of the whole
sequences gathered over the CP group (`context_parallel_share`, model/context_parallel.py). Pipeline stages hold
their layers as Megatron places them; between stages travel each row's (or packed sequence's, or under context
parallelism each sequence's share) streams, the last site's pre and the CSA2 state, and the token ids, packed into
one tensor (model/pipeline.py). Under sequence parallelism with context parallelism the TP ranks split the rows of
this CP rank's shares (padded to a multiple of tp) as they split whole rows.

Sequence parallelism (modelzoo.layers.sequence_parallel, S split along dim 1 as in DeepSeek-V4): the embedding is
reduce-scattered to this rank's S / tp tokens; the hyper-connection streams, their maps, each site's `pre` and the
norms act on them alone (parameters marked `sequence_parallel`: finalize_model_grads sums their gradients over TP).
Attention, the MoE and the Engram (its n-gram hashes are of the whole row) run on the sequence gathered over TP and
keep this rank's tokens of their output; the final hidden states are gathered for the output layer. The rows of a
packed or padded batch are padded to a multiple of tp; the DSpark layers (inference) run on whole rows.

Activation recompute as Megatron's TransformerConfig names it (modelzoo.layers.recompute): full ("uniform" / "block",
`recompute_num_layers`) checkpoints runs of layers; the selective `recompute_modules` are DeepSeek-V4's
(SELECTIVE_RECOMPUTE: core_attn, layernorm, moe). The cross-layer state (the CSA2 `CompressedState`, the previous
site's `pre`) enters a checkpointed region as explicit inputs and leaves it as outputs, so a recompute re-reads what
the forward read and publishes nothing; the indexer's picks are kept from the forward.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.transformer.module import MegatronModule
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from modelzoo.layers import gpt_call, sequence_parallel
from modelzoo.deepseek_v4.model.hyper_connection import HyperConnection, collapse, hc_residual, plain_collapse
from modelzoo.deepseek_v4.model.layers import ReplicatedLinear, RMSNorm, per_token
from modelzoo.deepseek_v4.model.model import SELECTIVE_RECOMPUTE, DeepseekV4DecoderLayer, DeepseekV4Model
from modelzoo.deepseek_v4.model.moe import MegatronOrder
from modelzoo.deepseek_v41.config import DeepseekV41Args
from modelzoo.deepseek_v41.mapping import carried_name
from modelzoo.deepseek_v41.hf_model import CompressedState, DeepseekV41NgramHasher
from modelzoo.deepseek_v41.model.attention import DeepseekV41Attention, state_values
from modelzoo.deepseek_v41.model.context_parallel import SequenceShares
from modelzoo.deepseek_v41.model.engram import DeepseekV41Engram
from modelzoo.deepseek_v41.model.moe import DeepseekV41MoE
from modelzoo.deepseek_v41.model import pipeline
from modelzoo.provider import keep_fp32
from modelzoo.layers.recompute import full_recompute_groups, recomputed, selective_modules
from modelzoo.layers.sequences import TokenLayout


class SinglePassHyperConnection(HyperConnection):
    """V4's hyper-connection map, whose input collapse uses the previous site's pre instead of its own."""

    def forward(self, streams: torch.Tensor, previous_pre: torch.Tensor):
        """-> (pre [B, S, N] for the next site, post, comb, collapsed [B, S, hidden], streams)."""
        pre, post, comb, streams = self.mix(streams)
        collapsed, streams = collapse(streams, previous_pre)
        return pre, post, comb, collapsed, streams


class DeepseekV41Layer(nn.Module):
    """One block: attention site and FFN site with single-pass hyper-connections, optionally an Engram (run by the
    model before the block). `layer_idx` >= num_layers: a DSpark draft layer (sliding window, its own MoE size).
    `fake_quant`: its attention rounds K/V and indexer inputs as the release stores them; `attention`: "exact" or
    "fast" (model/attention.py)."""

    def __init__(self, config, args: DeepseekV41Args, layer_idx: int, train_engram_tables: bool = False,
                 fake_quant: bool = False, recompute: frozenset[str] = frozenset(), attention: str = "exact"):
        """`recompute`: the selective recompute_modules (SELECTIVE_RECOMPUTE's names)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.sequence_parallel = sequence_parallel.enabled(config)
        whole_sequence = sequence_parallel.whole_sequence_config(config)
        hc = dict(hidden_size=args.hidden_size, hc_mult=args.hc_mult, sinkhorn_iters=args.hc_sinkhorn_iters,
                  hc_eps=args.hc_eps, norm_eps=args.rms_norm_eps, init_std=config.init_method_std)
        self.attn_hc = per_token(SinglePassHyperConnection(**hc), config)
        self.input_layernorm = per_token(RMSNorm(args.hidden_size, args.rms_norm_eps), config)
        self.self_attention = DeepseekV41Attention(whole_sequence, args, layer_idx, fake_quant,
                                                   "core_attn" in recompute, attention)
        self.ffn_hc = per_token(SinglePassHyperConnection(**hc), config)
        self.pre_mlp_layernorm = per_token(RMSNorm(args.hidden_size, args.rms_norm_eps), config)
        self.mlp = DeepseekV41MoE(whole_sequence, args if layer_idx < args.num_layers else args.draft_moe(),
                                  self.sequence_parallel)
        engram_ids = args.text.engram_layer_ids
        self.engram = (DeepseekV41Engram(whole_sequence, args,
                                         args.text.engram_num_embeddings[engram_ids.index(layer_idx)],
                                         train_engram_tables) if layer_idx in engram_ids else None)
        self.recompute_norms, self.recompute_mlp = "layernorm" in recompute, "moe" in recompute

    @property
    def mtp_model_layer(self) -> nn.Module:
        """A draft layer under the name Megatron's MTP layers give their decoder layer (its schedules set the
        micro-batch number on it)."""
        return self

    def _attention_input(self, streams: torch.Tensor, previous_pre: torch.Tensor):
        attn_pre, post, comb, collapsed, streams = self.attn_hc(streams, previous_pre)
        return attn_pre, post, comb, self.input_layernorm(collapsed), streams

    def _mlp_input(self, streams: torch.Tensor, attn_pre: torch.Tensor):
        ffn_pre, post, comb, collapsed, streams = self.ffn_hc(streams, attn_pre)
        return ffn_pre, post, comb, self.pre_mlp_layernorm(collapsed), streams

    def forward(self, streams: torch.Tensor, previous_pre: torch.Tensor, attention,
                padding: torch.Tensor | None = None, order: MegatronOrder | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [B, S, N, hidden], previous_pre [B, S, N] (under sequence parallelism this rank's S / tp
        tokens); `attention(x)` runs this layer's attention on the collapsed, normalised input of the whole
        sequence; padding [B, S] (the whole sequence): tokens routed to no expert; `order`: the tokens' places in
        the micro-batch (routing replay). Returns the new streams and the FFN site's pre."""
        attn_pre, post, comb, normed, streams = recomputed(self._attention_input, self.recompute_norms)(
            streams, previous_pre)
        streams = hc_residual(post, comb, self.on_whole_sequence(attention, normed), streams)
        ffn_pre, post, comb, normed, streams = recomputed(self._mlp_input, self.recompute_norms)(streams, attn_pre)
        mlp_output = self.on_whole_sequence(recomputed(self.mlp, self.recompute_mlp), normed, None, padding, order)
        return hc_residual(post, comb, mlp_output, streams), ffn_pre

    on_whole_sequence = DeepseekV4DecoderLayer.on_whole_sequence


class DSparkHeads(nn.Module):
    """The last draft layer's extras: final norm, the Markov head (a logit bias from the previous draft token) and
    the confidence head. Replicated (small: vocabulary x markov rank)."""

    def __init__(self, config, args: DeepseekV41Args):
        super().__init__()
        rank = args.text.dspark_markov_rank
        self.final_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.markov_embed = nn.Embedding(args.vocab_size, rank, dtype=config.params_dtype)
        self.markov_head = ReplicatedLinear(rank, args.vocab_size, config)
        self.confidence_head = ReplicatedLinear(args.hidden_size + rank, 1, config)
        with torch.no_grad():
            config.init_method(self.markov_embed.weight)


@dataclasses.dataclass
class DraftOutput:
    """DSpark's block after each position t (the tokens after the anchor at t + 1): logits [B, S, K, V] (the whole
    vocabulary), confidence [B, S, K], and the draft ids [B, S, K] whose Markov biases were used."""

    logits: torch.Tensor
    confidence: torch.Tensor
    ids: torch.Tensor


class DeepseekV41Model(gpt_call.GPTModelSurface, MegatronModule):
    """One pipeline stage of the model (the whole model at one stage), placed as GPTModel places its pieces: the
    first stage (`pre_process`) embeds and carries the unused checkpoint tensors, the last (`post_process`) holds the
    final norm, the output layer and the DSpark layers; a stage with Engram layers hashes the token ids. Frozen by
    default (requires_grad False), as in the reference: the indexers (their scores only feed a top-k), the Engram
    tables (`train_engram_tables=True` trains them), the DSpark layers (trained after pre-training with the backbone
    frozen); the router biases are buffers.
    `fake_quant=True`: every forward (backbone and DSpark layers) rounds the window K/V to FP8 and the compressed K/V
    and indexer queries and keys to FP4, as the release's inference stores them, with straight-through gradients.
    `attention="fast"`: the backbone's attention runs each query over its window keys and picked latents
    (model/attention.py); the DSpark layers' block attention is always exact."""

    model_type = ModelType.encoder_or_decoder

    def __init__(self, config, args: DeepseekV41Args, padded_vocab_size: int, token_map: torch.Tensor | None,
                 carried: dict | None = None, train_engram_tables: bool = False, fake_quant: bool = False,
                 attention: str = "exact", pre_process: bool = True, post_process: bool = True):
        """`token_map`: the Engram's normalised vocabulary (None: a forward is refused; a skeleton needs none);
        `carried`: name -> (shape, dtype) of the checkpoint tensors held unused for the export."""
        super().__init__(config=config)
        self.args, self.hc_mult = args, args.hc_mult
        self.pre_process, self.post_process = pre_process, post_process
        self.vocab_size, self.max_sequence_length = args.vocab_size, args.text.max_position_embeddings
        self.share_embeddings_and_output_weights = False
        self.input_tensor = None
        self.sequence_parallel = sequence_parallel.enabled(config)
        whole_sequence = sequence_parallel.whole_sequence_config(config)
        if pre_process:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = VocabParallelEmbedding(
                padded_vocab_size, args.hidden_size, init_method=config.init_method, config=config,
                reduce_scatter_embeddings=self.sequence_parallel)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList()
        # recompute_granularity="selective": V4's recompute_modules, which name the same pieces of a V4.1 layer
        recompute = selective_modules(config, "DeepSeek-V4.1", SELECTIVE_RECOMPUTE)
        for index in stage_layers(config):
            layer = DeepseekV41Layer(config, args, index, train_engram_tables, fake_quant, recompute, attention)
            layer.layer_number = index + 1
            layer.mlp.router.set_layer_number(layer.layer_number)
            self.decoder.layers.append(layer)
        # as Megatron's TransformerBlock: runs of this stage's layers, each under one checkpoint or not
        self.decoder.recompute_groups = full_recompute_groups(config, len(self.decoder.layers))
        # what the previous stage hands this one's first layer
        self.picks_as_ids = attention == "fast"  # the fast attention's picks are ids (model/attention.py)
        self.boundary = pipeline.Boundary.before(args, self.decoder.layers[0].layer_idx, self.picks_as_ids)
        self.mtp = nn.Module()
        self.mtp.layers = nn.ModuleList()
        if post_process:
            self.decoder.final_layernorm = per_token(RMSNorm(args.hidden_size, args.rms_norm_eps), config)
            self.output_layer = ColumnParallelLinear(args.hidden_size, padded_vocab_size, config=whole_sequence,
                                                     init_method=config.init_method, bias=False, gather_output=False)
            # the DSpark layers run on whole rows (drafting is inference: nothing to gain from splitting them)
            self.mtp.layers.extend(DeepseekV41Layer(whole_sequence, args, args.num_layers + stage, fake_quant=fake_quant)
                                   for stage in range(args.num_draft_layers))
        if self.mtp.layers:
            first = self.mtp.layers[0]
            first.main_proj = ReplicatedLinear(args.hidden_size * len(args.text.dspark_target_layer_ids),
                                               args.hidden_size, config)
            first.main_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.mtp.layers[-1].heads = DSparkHeads(config, args)
        engram_here = any(layer.engram is not None for layer in self.decoder.layers)
        self.engram_hasher = DeepseekV41NgramHasher(args.text) if engram_here else None
        if self.engram_hasher is not None and token_map is not None:
            self.engram_hasher.set_token_map(token_map)
        self.carried = nn.Module()
        for name, (shape, dtype) in ((carried or {}) if pre_process else {}).items():
            # replicated, never cast (`keep_fp32` keeps the checkpoint's dtype, whatever it is)
            self.carried.register_buffer(carried_name(name), keep_fp32(torch.zeros(shape, dtype=dtype)))
        for name, param in self.named_parameters():
            if ".indexer." in name or name.startswith("mtp."):
                param.requires_grad_(False)

    sharded_state_dict = DeepseekV4Model.sharded_state_dict  # reads each tensor's own parallel attributes
    embed = DeepseekV4Model.embed  # under sequence parallelism this rank's tokens

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's schedules hand each pipeline stage the previous stage's output (None on the first stage)."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def received(self, shapes: pipeline.RowShapes):
        """The rows' (streams, pre, state) the previous stage sent (`pipeline.pack`)."""
        return pipeline.unpack(self.args, self.boundary, self.input_tensor, shapes, self.config.pipeline_dtype,
                               self.config.params_dtype)

    def row_shapes(self, layout: TokenLayout, shares: SequenceShares | None) -> pipeline.RowShapes:
        """What this rank holds of each row its layers run (as `each_sequence` and `context_parallel_share` lay
        the rows out)."""
        tp = self.config.tensor_model_parallel_size if self.sequence_parallel else 1
        split = dict(tp=tp, rank=parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0)
        if shares is not None:
            return pipeline.RowShapes.of((~shares.padding).sum(dim=1).tolist(), shares.padding.shape[1],
                                         [length for *_, length in layout.whole_rows().sequences],
                                         shares.key_index.shape[1], **split)
        lengths = [layout.shape[1]] * layout.shape[0] if layout.plain else [length for *_, length in layout.sequences]
        padded = max(lengths) + -max(lengths) % tp  # as each_sequence pads them (plain rows: S, a multiple of tp)
        return pipeline.RowShapes.of(lengths, padded, lengths, padded, **split)

    def embedded(self, input_ids: torch.Tensor):
        """The first layer's (streams, pre, state): the embeddings copied into hc_mult streams (under sequence
        parallelism this rank's tokens), pre on stream 0."""
        streams = self.embed(input_ids).unsqueeze(2).expand(-1, -1, self.hc_mult, -1)
        return streams, self.first_pre(streams), CompressedState()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, decoder_input: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, inference_context=None, packed_seq_params=None,
                extra_block_kwargs=None, runtime_gather_output: bool | None = None, *, inference_params=None,
                loss_mask: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                mtp_kwargs: dict | None = None, draft_anchor_ids: torch.Tensor | None = None,
                draft_ids: torch.Tensor | None = None):
        """GPTModel's call on plain rows: this rank's vocabulary shard of the logits [B, S, V_padded / tp], or with
        `labels` the per-token loss [B, S]. With `draft_anchor_ids` [B, S] (the token at t + 1 for each t):
        (that output, DraftOutput); `draft_ids` [B, S, K - 1] picks the Markov biases (default: greedy)."""
        gpt_call.refuse_unsupported("DeepSeek-V4.1", inference_context, inference_params, extra_block_kwargs)
        gpt_call.refuse_mtp_training("DeepSeek-V4.1", mtp_kwargs)
        if not self.pre_process:  # the previous stage sends the token ids with the streams and state
            if self.input_tensor is None:
                raise ValueError("deepseek_v41: a pipeline stage after the first runs on what the previous stage "
                                 "sent: drive the stages with Megatron's schedules (get_forward_backward_func)")
            input_ids = pipeline.received_ids(self.input_tensor)
        if input_ids is None or decoder_input is not None:
            raise ValueError("deepseek_v41: the model needs input_ids (the Engram hashes them), not decoder_input")
        layout = gpt_call.input_layout("DeepSeek-V4.1", input_ids, None, position_ids, attention_mask,
                                       packed_seq_params, self.max_sequence_length, self.config)
        if draft_anchor_ids is not None and layout.context_parallel_keys is not None:
            raise ValueError("deepseek_v41: draft_anchor_ids under context parallelism: the DSpark drafts run "
                             "without it (pass the whole rows at context parallel size 1)")
        if draft_anchor_ids is not None and self.config.pipeline_model_parallel_size > 1:
            raise ValueError("deepseek_v41: draft_anchor_ids at pipeline parallel size > 1: the DSpark drafts read "
                             "the word embedding and the target layers of every stage (run them at one stage)")
        if draft_anchor_ids is not None and not layout.plain:
            raise ValueError("deepseek_v41: draft_anchor_ids needs plain rows (no padding or packing)")
        shares = None
        if layout.context_parallel_keys is not None:  # under sequence parallelism the TP ranks split its rows
            shares = SequenceShares(layout, self.config.tensor_model_parallel_size if self.sequence_parallel else 1)
        shapes = self.row_shapes(layout, shares)
        entering = None if self.pre_process else self.received(shapes)
        if shares is not None:
            hidden = self.context_parallel_share(input_ids, shares, entering)
        elif layout.plain:
            hidden, targets = self.backbone(input_ids, padding_mask, keep_targets=draft_anchor_ids is not None,
                                            entering=entering)
        else:
            hidden = self.each_sequence(input_ids, layout, entering)
        if not self.post_process:  # the rows' streams, pre and state for the next stage
            cp = self.config.context_parallel_size
            rows = pipeline.boundary_length(self.args, input_ids.shape[1] * cp, self.config.pipeline_dtype, cp,
                                            self.picks_as_ids)
            return pipeline.pack(self.args, self.boundary_after(), *hidden, shapes, input_ids,
                                 self.config.pipeline_dtype, rows)
        logits, _ = self.output_layer(hidden)
        output = gpt_call.language_model_output(logits, labels, self.args.vocab_size, runtime_gather_output)
        if draft_anchor_ids is None:
            return output
        if not self.mtp.layers:
            raise ValueError("deepseek_v41: draft_anchor_ids needs DSpark layers (num_nextn_predict_layers > 0)")
        if draft_anchor_ids.shape != input_ids.shape:
            raise ValueError(f"deepseek_v41: draft_anchor_ids must be input_ids' shape {list(input_ids.shape)}, got "
                             f"{list(draft_anchor_ids.shape)}")
        return output, self.draft(targets, draft_anchor_ids, draft_ids)

    def each_sequence(self, input_ids: torch.Tensor, layout: TokenLayout, entering: tuple | None = None):
        """A packed or padded batch: its sequences as right-padded rows of one forward (a sequence's tokens then see
        exactly what they would alone: attention, latents, top-k and n-grams only look back, and the padding goes
        to no expert), their hidden states put back in place (zeros at padding) [B, S, hidden]; before the last
        pipeline stage the rows' (streams, pre, state). `entering`: what the previous stage sent."""
        if not layout.contiguous():
            raise ValueError("deepseek_v41: the compressor pools each sequence's consecutive tokens from its start; "
                             "this attention_mask is not causal over runs of consecutive tokens: pass a [batch, 1, 1, "
                             "seq] padding mask, a causal mask over each row's real tokens, or packed_seq_params")
        sequences = layout.sequences
        rows = pad_sequence([input_ids[row, start:start + length] for row, start, length in sequences],
                            batch_first=True)
        if self.sequence_parallel:  # the TP ranks split each row evenly
            rows = torch.nn.functional.pad(rows, (0, -rows.shape[1] % self.config.tensor_model_parallel_size))
        lengths = torch.tensor([length for *_, length in sequences], device=input_ids.device)
        slots = torch.arange(rows.shape[1], device=rows.device)
        padding = slots >= lengths[:, None]
        # the slots' tokens in the micro-batch (-1: padding), for routing replay
        starts = torch.tensor([row * input_ids.shape[1] + start for row, start, _ in sequences], device=rows.device)
        order = MegatronOrder.of_batch_first((starts[:, None] + slots).masked_fill(padding, -1), *input_ids.shape)
        hidden_rows, _ = self.backbone(rows, padding, entering=entering, order=order)
        if not self.post_process:
            return hidden_rows
        hidden = hidden_rows.new_zeros(*input_ids.shape, hidden_rows.shape[-1])
        for number, (row, start, length) in enumerate(sequences):
            hidden[row, start:start + length] = hidden_rows[number, :length]
        return hidden

    def context_parallel_share(self, input_ids: torch.Tensor, shares: SequenceShares,
                               entering: tuple | None = None):
        """This CP rank's share of the rows (Megatron's layout): its tokens of each sequence as a right-padded row
        of one forward, whose keys are the whole sequences gathered over the group (`shares`); their hidden states
        put back in this rank's order (zeros at tokens of no sequence) [B, s, hidden]; before the last pipeline
        stage the rows' (streams, pre, state). `entering`: what the previous stage sent."""
        order = MegatronOrder.of_batch_first(shares.query_index, *input_ids.shape)
        hidden_rows, _ = self.backbone(shares.rows(input_ids), shares.padding, shares=shares, entering=entering,
                                       order=order)
        return shares.put_back(hidden_rows) if self.post_process else hidden_rows

    def backbone(self, input_ids: torch.Tensor, padding: torch.Tensor | None = None, keep_targets: bool = False,
                 shares: SequenceShares | None = None, entering: tuple | None = None,
                 order: MegatronOrder | None = None):
        """The final hidden states [B, S, hidden] of plain rows (of the whole sequence, under sequence parallelism
        too) and, with `keep_targets`, the stream means of the DSpark target layers' attention inputs
        [B, S, targets * hidden] (else None). `padding` [B, S] bool: tokens routed to no expert. `shares`: the rows
        are this CP rank's tokens of each sequence (context_parallel_share). `entering`: the rows' (streams, pre,
        state) from the previous pipeline stage (`received`); on a stage before the last the first output is what
        this stage's layers leave, (streams, pre, state). `order`: where the rows' tokens sit in the micro-batch
        (routing replay; default: the rows are the micro-batch)."""
        if padding is not None and (padding.shape != input_ids.shape or padding.dtype != torch.bool):
            raise ValueError(f"deepseek_v41: padding_mask must be a boolean [batch, seq] = {list(input_ids.shape)} "
                             f"tensor (True = padding), got {padding.dtype} {list(padding.shape)}")
        streams, pre, state = entering or self.embedded(input_ids)
        hash_ids = self.engram_hashes(input_ids, shares) if self.engram_hasher is not None else None
        compressed, targets = state_values(state), []
        for layers, recompute in self.decoder.recompute_groups:
            run = functools.partial(self.run_layers, layers, hash_ids, padding, order, keep_targets, shares)
            streams, pre, group_targets, *compressed = recomputed(run, recompute)(streams, pre, *compressed)
            targets += group_targets
        if not self.post_process:
            return (streams, pre, CompressedState(*compressed)), None
        hidden = self.decoder.final_layernorm(plain_collapse(pre, streams))
        targets = torch.cat(targets, dim=-1) if keep_targets else None
        if self.sequence_parallel:
            hidden = sequence_parallel.gather_sequence(hidden, dim=1)
            targets = sequence_parallel.gather_sequence(targets, dim=1) if keep_targets else None
        return hidden, targets

    def run_layers(self, layers: range, hash_ids: torch.Tensor | None, padding: torch.Tensor | None,
                   order: MegatronOrder | None, keep_targets: bool, shares: SequenceShares | None,
                   streams: torch.Tensor, pre: torch.Tensor, *state) -> tuple:
        """Decoder layers `layers` in turn, from explicit inputs (`state`: the CompressedState's values before them)
        -> (streams, pre, [DSpark targets], *the state's values after them): a checkpointed run's recompute
        re-reads what its forward read."""
        text, state, targets = self.args.text, CompressedState(*state), []
        for index in layers:
            layer = self.decoder.layers[index]
            if layer.engram is not None:
                # the n-grams end at every token of the whole row
                streams = layer.on_whole_sequence(layer.engram, streams,
                                                  hash_ids[:, :, text.engram_layer_ids.index(layer.layer_idx)], None)
            if keep_targets and layer.layer_idx in text.dspark_target_layer_ids:
                targets.append(streams.float().mean(dim=2).to(streams.dtype))
            streams, pre = layer(streams, pre, lambda x, attention=layer.self_attention: attention(x, state, shares),
                                 padding, order)
        return streams, pre, targets, *state_values(state)

    def boundary_after(self) -> pipeline.Boundary:
        """What this stage hands the next."""
        return pipeline.Boundary.before(self.args, self.decoder.layers[-1].layer_idx + 1, self.picks_as_ids)

    def engram_hashes(self, input_ids: torch.Tensor, shares: SequenceShares | None) -> torch.Tensor:
        """The n-gram hash ids of each token [B, S, engram layers, columns]; under context parallelism the n-grams
        reach into other ranks' tokens, so the whole sequences' ids are gathered and hashed."""
        if shares is None:
            return self.engram_hasher(input_ids, None)
        return shares.at_positions(self.engram_hasher(shares.whole(input_ids), None))

    def first_pre(self, streams: torch.Tensor) -> torch.Tensor:
        """The first site reads stream 0: pre = one-hot [..., N] (fp32)."""
        pre = torch.zeros(streams.shape[:-1], dtype=torch.float32, device=streams.device)
        pre[..., 0] = 1.0
        return pre

    def full_vocabulary_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, _ = self.output_layer(hidden)
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., : self.args.vocab_size].float()

    def draft(self, targets: torch.Tensor, anchor_ids: torch.Tensor, draft_ids: torch.Tensor | None) -> DraftOutput:
        """The DSpark layers for every anchor position (inference: frozen, the whole vocabulary on every rank)."""
        text, first, last = self.args.text, self.mtp.layers[0], self.mtp.layers[-1]
        batch, seq_len = anchor_ids.shape
        block = text.dspark_block_size
        main_x = first.main_norm(first.main_proj(targets))
        block_ids = torch.full((batch, seq_len, block), text.dspark_noise_token_id, device=anchor_ids.device)
        block_ids[..., 0] = anchor_ids
        # the layers see [B, S * K] tokens; the attention regroups them by anchor
        embeddings = self.embed(block_ids.flatten(1))
        if self.sequence_parallel:
            embeddings = sequence_parallel.gather_sequence(embeddings, dim=1)
        streams = embeddings.unsqueeze(2).expand(-1, -1, self.hc_mult, -1)
        pre = self.first_pre(streams)
        for layer in self.mtp.layers:
            streams, pre = layer(streams, pre, lambda x, attention=layer.self_attention:
                                 draft_attention(attention, x.unflatten(1, (seq_len, block)), main_x).flatten(1, 2))
        hidden = plain_collapse(pre, streams)
        heads = last.heads
        logits = self.full_vocabulary_logits(heads.final_layernorm(hidden)).unflatten(1, (seq_len, block))
        previous, chosen, embeddings, slots = anchor_ids, [], [], []
        for slot in range(block):
            embedding = heads.markov_embed(previous)
            slots.append(logits[:, :, slot] + heads.markov_head(embedding).float())
            embeddings.append(embedding)
            previous = slots[-1].argmax(-1) if draft_ids is None or slot == block - 1 else draft_ids[..., slot]
            chosen.append(previous)
        logits = torch.stack(slots, dim=2)
        joined = torch.cat((hidden.unflatten(1, (seq_len, block)), torch.stack(embeddings, dim=2).to(hidden.dtype)),
                           dim=-1)
        confidence = torch.nn.functional.linear(joined.float(), heads.confidence_head.weight.float()).squeeze(-1)
        return DraftOutput(logits, confidence, torch.stack(chosen, dim=-1))


def stage_layers(config) -> range:
    """The model's layers this pipeline stage builds (Megatron's split: get_transformer_layer_offset)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if config.pipeline_model_parallel_size == 1:
        return range(config.num_layers)
    offset = get_transformer_layer_offset(config)
    return range(offset, offset + get_num_layers_to_build(config))


def draft_attention(attention: DeepseekV41Attention, x: torch.Tensor, main_x: torch.Tensor) -> torch.Tensor:
    """x [B, S, K, hidden]: the block of each anchor t (positions t + 1 .. t + K); main_x [B, S, hidden]. Each block
    query attends the main K/V of positions t - W + 1 .. t and every K/V of its own block."""
    seq_len, block = x.shape[1], x.shape[2]
    anchors = torch.arange(seq_len, device=x.device)
    cos, sin = attention.rotary(anchors, x.dtype)
    main_kv = attention.project_kv(main_x, cos, sin)                                        # [B, S, D]
    positions = (anchors[:, None] + 1 + torch.arange(block, device=x.device)).flatten()
    block_cos, block_sin = attention.rotary(positions, x.dtype)
    queries, _ = attention.project_q(x.flatten(1, 2), block_cos, block_sin)
    block_kv = attention.project_kv(x.flatten(1, 2), block_cos, block_sin).unflatten(1, (seq_len, block))
    queries = queries.unflatten(1, (seq_len, block))                                       # [B, S, K, h, D]
    offset = anchors[:, None] - anchors[None, :]
    window = (offset >= 0) & (offset < attention.sliding_window)                           # [anchors, main positions]
    keys = torch.cat((main_kv[:, None].expand(-1, seq_len, -1, -1), block_kv), dim=2)      # [B, S, S + K, D]
    allowed = torch.cat((window[:, None, :].expand(-1, block, -1), window.new_ones(seq_len, block, block)), dim=-1)
    attended = attention.attend(queries, keys, allowed)                                    # [B, S, K, h, D]
    return attention.output(attended.flatten(1, 2), block_cos, block_sin).unflatten(1, (seq_len, block))
