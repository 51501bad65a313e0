"""The DeepSeek-V4 decoder on Megatron-Core parallel layers (transformers' DeepseekV4ForCausalLM).

    streams = embed(ids) copied to hc_mult streams                   VocabParallelEmbedding
    for each layer:  streams = hc(attention) ; streams = hc(MoE)     decoder.layers.N
    x = final_norm(hc_head(streams)); logits = output_layer(x)       vocab-parallel logits (embedding matrix if tied)
    [mtp: next-token-after-next heads on the final streams]          mtp.layers.K

Tensors are batch-first [B, S, ...] throughout, like transformers, so that the parity path runs
the same ops in the same order. Module names follow Megatron's (embedding / decoder / output_layer,
linear_q_down_proj, linear_proj, pre_mlp_layernorm, ...); bridge.py maps them to the HF names.

The model takes Megatron-Core GPTModel's call (`modelzoo.gpt_call`). In packed rows and padded batches the
batch's `TokenLayout` keeps each sequence to itself: its sliding window, its own compressor windows (no
compressed entry mixes two sequences; a last partial window makes no entry, as for a sequence's end), the
indexer's top-k among its own entries, MTP targets shifted within it; padding tokens go to no expert.

Sequence parallelism (modelzoo.sequence_parallel) splits S (dim 1 here, not Megatron's dim 0): the embedding is
reduce-scattered to this rank's S / tp tokens, and the hyper-connection streams, their maps, the norms and the
hyper head act on them alone (their parameters are marked `sequence_parallel`: Megatron's finalize_model_grads sums
their gradients over TP). Attention needs the whole sequence and the MoE block runs its experts' TP shards on
every token, as the tensor-parallel model does: each gathers its input over the TP ranks and keeps this rank's
tokens of its (all-reduced) output; so does the output layer of the final hidden states. The batch's layout, the
RoPE positions and the token ids always describe the whole row.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from torch import nn

from modelzoo import gpt_call, sequence_parallel
from modelzoo.cuda_graphs import LayerGraphs
from modelzoo.deepseek_v4.config import HASH_MOE, DeepseekV4Args
from modelzoo.deepseek_v4.model.attention import DeepseekV4Attention
from modelzoo.deepseek_v4.model.decisions import deciding
from modelzoo.deepseek_v4.model.hyper_connection import HyperConnection, HyperHead, hc_residual
from modelzoo.deepseek_v4.model.layers import RMSNorm
from modelzoo.deepseek_v4.model.moe import DeepseekV4MoE
from modelzoo.recompute import full_recompute_groups, recomputed, selective_modules
from modelzoo.sequences import TokenLayout, plain_layout

# recompute_granularity="selective": the recompute_modules names (Megatron's) this model honours
SELECTIVE_RECOMPUTE = {
    "core_attn": "compressor, indexer and attention over window and compressed entries",
    "layernorm": "hyper-connection maps and the norms after them",
    "moe": "router, routed and shared experts",
}


def hyper_connection(config, args: DeepseekV4Args) -> HyperConnection:
    return HyperConnection(args.hidden_size, args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps,
                           config.init_method_std)


def per_token(module: nn.Module, config) -> nn.Module:
    """A module that acts on each token alone: under sequence parallelism on this rank's tokens only."""
    return sequence_parallel.mark_sequence_parallel(module, config)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config, args: DeepseekV4Args, layer_type: str, mlp_type: str, attention: str = "exact",
                 recompute: frozenset[str] = frozenset()):
        super().__init__()
        self.layer_type, self.mlp_type = layer_type, mlp_type
        self.sequence_parallel = sequence_parallel.enabled(config)
        whole_sequence = sequence_parallel.whole_sequence_config(config)
        self.attn_hc = per_token(hyper_connection(config, args), config)
        self.input_layernorm = per_token(RMSNorm(args.hidden_size, args.rms_norm_eps), config)
        self.self_attention = DeepseekV4Attention(whole_sequence, args, layer_type, attention,
                                                  recompute_core="core_attn" in recompute)
        self.ffn_hc = per_token(hyper_connection(config, args), config)
        self.pre_mlp_layernorm = per_token(RMSNorm(args.hidden_size, args.rms_norm_eps), config)
        self.mlp = DeepseekV4MoE(whole_sequence, args, mlp_type)
        self.recompute_norms, self.recompute_mlp = "layernorm" in recompute, "moe" in recompute

    def _attention_input(self, streams: torch.Tensor):
        post, comb, collapsed, streams = self.attn_hc(streams)
        return post, comb, self.input_layernorm(collapsed), streams

    def _mlp_input(self, streams: torch.Tensor):
        post, comb, collapsed, streams = self.ffn_hc(streams)
        return post, comb, self.pre_mlp_layernorm(collapsed), streams

    def forward(self, streams: torch.Tensor, position_ids: torch.Tensor, input_ids: torch.Tensor | None,
                layout: TokenLayout | None = None, unrouted: torch.Tensor | None = None) -> torch.Tensor:
        """streams [B, S, hc_mult, hidden] (under sequence parallelism this rank's S / tp tokens) -> same shape;
        position_ids [B|1, S]: RoPE positions; layout None: plain rows; unrouted [B, S] bool: tokens that go to no
        expert (padding). position_ids, input_ids, layout and unrouted are of the whole sequence."""
        if layout is None:
            layout = plain_layout(streams.shape[0], position_ids.shape[1], streams.device)
        post, comb, normed, streams = recomputed(self._attention_input, self.recompute_norms)(streams)
        attn_output = self.on_whole_sequence(self.self_attention, normed, position_ids, layout)
        streams = hc_residual(post, comb, attn_output, streams)
        post, comb, normed, streams = recomputed(self._mlp_input, self.recompute_norms)(streams)
        mlp_output = self.on_whole_sequence(recomputed(self.mlp, self.recompute_mlp), normed, input_ids, unrouted)
        return hc_residual(post, comb, mlp_output, streams)

    def on_whole_sequence(self, block: nn.Module, hidden: torch.Tensor, *args) -> torch.Tensor:
        """block(hidden, *args); under sequence parallelism on the sequence gathered over the TP ranks, keeping this
        rank's tokens of the output (whole and the same on every rank: the block's row-parallel layers all-reduce)."""
        if not self.sequence_parallel:
            return block(hidden, *args)
        return sequence_parallel.split_sequence(block(sequence_parallel.gather_sequence(hidden, dim=1), *args), dim=1)


class DeepseekV4Decoder(nn.Module):
    def __init__(self, config, args: DeepseekV4Args, attention: str = "exact"):
        super().__init__()
        recompute = selective_modules(config, "DeepSeek-V4", SELECTIVE_RECOMPUTE)
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(config, args, layer_type, mlp_type, attention, recompute)
            for layer_type, mlp_type in zip(args.layer_types, args.mlp_layer_types, strict=True))
        self.hc_head = per_token(HyperHead(args.hidden_size, args.hc_mult, args.hc_eps, args.rms_norm_eps,
                                           config.init_method_std), config)
        self.final_layernorm = per_token(RMSNorm(args.hidden_size, args.rms_norm_eps), config)
        self.recompute_groups = full_recompute_groups(config, len(self.layers))
        self.recomputing = any(recompute for _, recompute in self.recompute_groups) or bool(recompute)

    def forward(self, streams: torch.Tensor, position_ids: torch.Tensor, input_ids: torch.Tensor | None,
                layout: TokenLayout, unrouted: torch.Tensor | None) -> torch.Tensor:
        """Every layer in turn; under full recompute each run of layers keeps only its input streams."""
        for layers, recompute in self.recompute_groups:
            def run(streams, layers=layers):
                for index in layers:
                    streams = self.layers[index](streams, position_ids, input_ids, layout, unrouted)
                return streams
            streams = recomputed(run, recompute)(streams)
        return streams


class DeepseekV4Model(MegatronModule):

    model_type = ModelType.encoder_or_decoder  # what Megatron's schedules ask of a model
    def __init__(self, config, args: DeepseekV4Args, padded_vocab_size: int, attention: str = "exact",
                 build_mtp: bool = True, mtp_loss_scale: float = 0.0):
        super().__init__(config=config)
        from modelzoo.deepseek_v4.model.mtp import DeepseekV4MTP

        self.args, self.hc_mult, self.mtp_loss_scale = args, args.hc_mult, mtp_loss_scale
        self.sequence_parallel = sequence_parallel.enabled(config)
        self.embedding = nn.Module()
        self.embedding.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, args.hidden_size, init_method=config.init_method, config=config,
            reduce_scatter_embeddings=self.sequence_parallel)
        self.decoder = DeepseekV4Decoder(config, args, attention)
        # tied: no weight of its own, the embedding matrix is handed to it (as GPTModel does)
        self.output_layer = ColumnParallelLinear(
            args.hidden_size, padded_vocab_size, config=sequence_parallel.whole_sequence_config(config),
            init_method=config.init_method, bias=False, gather_output=False,
            skip_weight_param_allocation=args.tie_word_embeddings)
        if args.tie_word_embeddings:
            # one weight used twice on this stage: with gradient-accumulation fusion the output layer adds its
            # gradient to main_grad itself, and Megatron's DDP must then add a zero, not garbage (LanguageModule)
            self.embedding.word_embeddings.weight.zero_out_wgrad = True
        self.mtp = DeepseekV4MTP(config, args, attention, args.num_mtp_layers if build_mtp else 0)
        # The language-model loss reaches neither the indexers (a top-k of indices: DeepSeek trains them with a
        # loss of their own, not implemented here) nor the MTP layers unless their loss is on. Frozen, they are
        # what a step leaves them anyway, and Megatron's DDP, which waits for a gradient of every trainable
        # parameter when it overlaps the reduction with the backward, has none to wait for.
        for name, param in self.named_parameters():
            if ".indexer." in name or (name.startswith("mtp.") and not mtp_loss_scale):
                param.requires_grad_(False)
        self.layer_graphs: LayerGraphs | None = None

    def capture_cuda_graphs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        """Capture the decoder layers' forward and backward as two CUDA graphs for inputs of this shape.

        Later forwards with inputs of the same shape (and training mode) replay them: one launch per
        pass instead of thousands. A parameter's `.grad` made by a graphed backward is the graph's
        buffer (see `modelzoo.cuda_graphs`). Other shapes, and forwards that record or replay decisions,
        run eagerly. Each forward with gradients must have its backward before the next forward (see
        `modelzoo.cuda_graphs`). Needs bf16 on a GPU and no host synchronisation inside a layer, so
        expert-parallel size 1 (the expert-parallel dispatcher sizes its groups on the host). Measured
        and tested at tensor-parallel size 1 only.
        """
        from megatron.core import parallel_state

        if self.decoder.recomputing:
            raise ValueError("DeepSeek-V4 CUDA graphs: a captured layer keeps its activations in the graph's pool; "
                             "capture without activation recompute (recompute_granularity None)")
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            raise ValueError("DeepSeek-V4 CUDA graphs: expert parallelism sizes the expert groups on the host "
                             "each forward; capture with expert_model_parallel_size 1")
        self.release_cuda_graphs()
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids)
        with torch.no_grad():
            streams = self.input_streams(input_ids)
        self.layer_graphs = LayerGraphs(self.decoder.layers, streams.requires_grad_(), position_ids, input_ids)

    def release_cuda_graphs(self) -> None:
        if self.layer_graphs is not None:
            self.layer_graphs.release()
            self.layer_graphs = None

    @staticmethod
    def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
        return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """torch_dist checkpoint layout, read from the parameters' own attributes.

        Megatron's default treats parameters of plain modules as replicated, which is wrong for the
        head-sharded sinks, the group-sharded wo_a and the expert-parallel experts. Here every tensor
        says how it is split: `expert_parallel` (dim 0 over the expert-model-parallel group, and
        `partition_dim` over the expert-tensor-parallel group), else `tensor_model_parallel` /
        `partition_dim` over the TP group (Megatron's linears and embeddings set these too), else replicated.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.transformer.utils import (
            make_sharded_object_for_checkpoint,
            make_sharded_tensor_for_checkpoint,
            make_tp_sharded_tensor_for_checkpoint,
        )

        if sharded_offsets:
            raise NotImplementedError("DeepSeek-V4: pipeline-parallel (prepended) checkpoint offsets are not supported")
        result = {}
        for name, tensor in self.state_dict(prefix="", keep_vars=True).items():
            key = f"{prefix}{name}"
            if name.endswith("_extra_state"):
                result[key] = make_sharded_object_for_checkpoint(tensor, key)
            elif getattr(tensor, "expert_parallel", False):
                offsets = [(0, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())]
                if getattr(tensor, "tensor_model_parallel", False):
                    offsets.append((tensor.partition_dim, ps.get_expert_tensor_parallel_rank(),
                                    ps.get_expert_tensor_parallel_world_size()))
                result[key] = ShardedTensor.from_rank_offsets(key, tensor, *offsets,
                                                              replica_id=(0, 0, ps.get_expert_data_parallel_rank()))
            elif getattr(tensor, "tensor_model_parallel", False):
                result[key] = make_tp_sharded_tensor_for_checkpoint(tensor, key, tensor.partition_dim)
            else:
                result[key] = make_sharded_tensor_for_checkpoint(tensor, key)
        return result

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] token ids -> [B, S, hidden], under sequence parallelism this rank's [B, S / tp, hidden]."""
        embeddings = self.embedding.word_embeddings(input_ids)
        # reduce-scattered over the TP ranks along Megatron's sequence dim, [S / tp, B, hidden]
        return embeddings.transpose(0, 1) if self.sequence_parallel else embeddings

    def input_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's residual streams: the embeddings copied into hc_mult streams [B, S, N, H]."""
        return self.embed(input_ids).unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()

    def logits(self, streams: torch.Tensor, hc_head: HyperHead, final_layernorm: RMSNorm) -> torch.Tensor:
        weight = self.embedding.word_embeddings.weight if self.args.tie_word_embeddings else None
        hidden = final_layernorm(hc_head(streams))
        if self.sequence_parallel:
            hidden = sequence_parallel.gather_sequence(hidden, dim=1)
        logits, _ = self.output_layer(hidden, weight=weight)
        return logits

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's schedules hand each pipeline stage its input; this model is one stage, whose input is None."""
        tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        if any(tensor is not None for tensor in tensors):
            raise ValueError("DeepSeek-V4: pipeline stages are not supported; the model runs as one stage")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, decoder_input: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, inference_context=None, packed_seq_params=None,
                extra_block_kwargs=None, runtime_gather_output: bool | None = None, *, inference_params=None,
                loss_mask: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                return_mtp: bool = False):
        """GPTModel's call (modelzoo.gpt_call): this rank's vocabulary shard of the logits [B, S, V_padded / tp],
        or with `labels` the per-token loss [B, S] (plus, through the backward, `mtp_loss_scale` x the MTP loss,
        as Megatron's GPTModel adds it). `padding_mask` [B, S] (True = padding) keeps tokens from the experts.

        With `return_mtp=True`: (logits, [logits of MTP depth k for k = 1..D]); depth k at position
        i predicts token i + k + 1 of its sequence (its last k positions have no target).
        """
        gpt_call.refuse_unsupported("DeepSeek-V4", inference_context, inference_params, extra_block_kwargs)
        layout = self.token_layout(input_ids, decoder_input, position_ids, attention_mask, packed_seq_params)
        unrouted = unrouted_tokens(layout, padding_mask)
        if input_ids is None and any(kind == HASH_MOE for kind in self.args.mlp_layer_types):
            raise ValueError("DeepSeek-V4: hash-routed MoE layers route by token id: pass input_ids with decoder_input")
        position_ids = self.default_position_ids(input_ids) if layout.plain else layout.rope_positions
        if decoder_input is not None:  # [s, b, hidden], Megatron's layout (this rank's s / tp under sequence parallel)
            embeddings = decoder_input.transpose(0, 1)
            streams = embeddings.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()
        else:
            streams = self.input_streams(input_ids)
        if layout.context_parallel_keys is not None and deciding(self):
            raise ValueError("DeepSeek-V4: recording or replaying decisions (routed experts, indexer picks) under "
                             "context parallelism is not supported: each rank would hold its share of them")
        graphs = self.layer_graphs
        if layout.plain and graphs is not None and graphs.matches(streams, position_ids, input_ids) \
                and not deciding(self):
            streams = graphs(streams, position_ids, input_ids)
        else:
            streams = self.decoder(streams, position_ids, input_ids, layout, unrouted)
        logits = self.logits(streams, self.decoder.hc_head, self.decoder.final_layernorm)
        if return_mtp or (labels is not None and self.mtp_loss_scale):
            if not self.mtp.layers:
                raise ValueError("this DeepSeek-V4 model was built without MTP layers (num_nextn_predict_layers=0 "
                                 "or build_mtp=False)")
            mtp_logits = self.mtp(self, streams, input_ids, position_ids, layout, unrouted)
        output = gpt_call.language_model_output(logits, labels, self.args.vocab_size, runtime_gather_output)
        if labels is not None and self.mtp_loss_scale:
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

            from modelzoo.deepseek_v4.model.mtp import mtp_loss

            output = MTPLossAutoScaler.apply(output, self.mtp_loss_scale * mtp_loss(
                mtp_logits, input_ids, self.args.vocab_size, layout, loss_mask))
        return (output, mtp_logits) if return_mtp else output

    def token_layout(self, input_ids, decoder_input, position_ids, attention_mask, packed_seq_params) -> TokenLayout:
        """The batch's layout; a general attention mask cannot say where DeepSeek-V4's compressor windows start."""
        layout = gpt_call.input_layout("DeepSeek-V4", input_ids, decoder_input, position_ids, attention_mask,
                                       packed_seq_params, self.args.max_position_embeddings, self.config)
        if not layout.plain and not layout.whole_rows().contiguous():
            raise ValueError("DeepSeek-V4: compressed attention pools windows of each sequence's consecutive tokens; "
                             "this attention_mask is not a padding mask of one run of tokens per row: pass a "
                             "[batch, 1, 1, seq] padding mask (left or right padding) or packed_seq_params")
        return layout


def unrouted_tokens(layout: TokenLayout, padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[B, S] bool: the tokens no expert sees, the layout's padding and GPTModel's `padding_mask` (True = padding);
    None when every token is routed."""
    if padding_mask is not None and (padding_mask.shape != layout.shape or padding_mask.dtype != torch.bool):
        raise ValueError(f"padding_mask must be a boolean [batch, seq] = {list(layout.shape)} tensor "
                         f"(True = padding), got {padding_mask.dtype} {list(padding_mask.shape)}")
    if layout.plain:
        return padding_mask
    return layout.padding if padding_mask is None else layout.padding | padding_mask.to(layout.padding.device)
