"""The DeepSeek-V4 decoder on Megatron-Core parallel layers (transformers' DeepseekV4ForCausalLM).

    streams = embed(ids) copied to hc_mult streams                   VocabParallelEmbedding
    for each layer:  streams = hc(attention) ; streams = hc(MoE)     decoder.layers.N
    x = final_norm(hc_head(streams)); logits = output_layer(x)       vocab-parallel logits (embedding matrix if tied)
    [mtp: next-token-after-next heads on the final streams]          mtp.layers.K

Tensors are batch-first [B, S, ...] throughout, like transformers, so that the parity path runs
the same ops in the same order. Module names follow Megatron's (embedding / decoder / output_layer,
linear_q_down_proj, linear_proj, pre_mlp_layernorm, ...); mapping.py maps them to the HF names.

The model takes Megatron-Core GPTModel's call (`modelzoo.layers.gpt_call`). In packed rows and padded batches the
batch's `TokenLayout` keeps each sequence to itself: its sliding window, its own compressor windows (no
compressed entry mixes two sequences; a last partial window makes no entry, as for a sequence's end), the
indexer's top-k among its own entries, MTP targets shifted within it; padding tokens go to no expert.

Sequence parallelism (modelzoo.layers.sequence_parallel) splits S (dim 1 here, not Megatron's dim 0): the embedding is
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

from modelzoo.compat import share_embedding_across_stages
from modelzoo.layers import gpt_call, sequence_parallel
from modelzoo.layers.cuda_graphs import LayerGraphs
from modelzoo.deepseek_v4.config import HASH_MOE, DeepseekV4Args
from modelzoo.deepseek_v4.model.attention import DeepseekV4Attention
from modelzoo.deepseek_v4.model.decisions import deciding
from modelzoo.deepseek_v4.model.hyper_connection import HyperConnection, HyperHead, hc_residual
from modelzoo.deepseek_v4.model.layers import RMSNorm, per_token
from modelzoo.deepseek_v4.model.moe import DeepseekV4MoE
from modelzoo.deepseek_v4.model.mtp import DeepseekV4MTP, mtp_loss
from modelzoo.layers.recompute import ATTENTION_OUTPUT, full_recompute_groups, recomputed, selective_modules
from modelzoo.layers.sequences import TokenLayout, plain_layout

# recompute_granularity="selective": the recompute_modules names (Megatron's) this model honours
SELECTIVE_RECOMPUTE = {
    "core_attn": "compressor and attention over window and compressed entries (the indexer's picks are kept)",
    "layernorm": "hyper-connection maps and the norms after them",
    "moe": "router, routed and shared experts",
}


def hyper_connection(config, args: DeepseekV4Args) -> HyperConnection:
    return HyperConnection(args.hidden_size, args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps,
                           config.init_method_std)


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
        self.mlp = DeepseekV4MoE(whole_sequence, args, mlp_type, self.sequence_parallel)
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
    """This pipeline stage's decoder layers (all of them at one stage), numbered in the model by Megatron's layer
    offset (`layer_number`, 1-based, as Megatron's TransformerLayer); the last stage also holds the head's hyper
    connection and norm."""

    def __init__(self, config, args: DeepseekV4Args, attention: str = "exact", post_process: bool = True,
                 keep_attention_output: bool = False):
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        super().__init__()
        kinds = list(zip(args.layer_types, args.mlp_layer_types, strict=True))
        offset = get_transformer_layer_offset(config) if config.pipeline_model_parallel_size > 1 else 0
        recompute = selective_modules(config, "DeepSeek-V4", SELECTIVE_RECOMPUTE)
        self.layers = nn.ModuleList()
        for number in range(offset, offset + get_num_layers_to_build(config)):
            layer = DeepseekV4DecoderLayer(config, args, *kinds[number], attention, recompute)
            layer.layer_number = number + 1
            layer.mlp.router.set_layer_number(layer.layer_number)
            self.layers.append(layer)
        if post_process:
            self.hc_head = per_token(HyperHead(args.hidden_size, args.hc_mult, args.hc_eps, args.rms_norm_eps,
                                               config.init_method_std), config)
            self.final_layernorm = per_token(RMSNorm(args.hidden_size, args.rms_norm_eps), config)
        # as Megatron's TransformerBlock: full recompute counts this stage's layers
        self.recompute_groups = full_recompute_groups(config, len(self.layers))
        # what a fully recomputed run of layers keeps from its forward besides its input streams
        self.recompute_keeps = frozenset({ATTENTION_OUTPUT} if keep_attention_output else ())
        self.recomputing = any(recompute for _, recompute in self.recompute_groups) or bool(recompute)

    def forward(self, streams: torch.Tensor, position_ids: torch.Tensor, input_ids: torch.Tensor | None,
                layout: TokenLayout, unrouted: torch.Tensor | None) -> torch.Tensor:
        """This stage's layers in turn; under full recompute each run of layers keeps only its input streams."""
        for layers, recompute in self.recompute_groups:
            def run(streams, layers=layers):
                for index in layers:
                    streams = self.layers[index](streams, position_ids, input_ids, layout, unrouted)
                return streams
            streams = recomputed(run, recompute, self.recompute_keeps)(streams)
        return streams


class DeepseekV4Model(gpt_call.GPTModelSurface, MegatronModule):
    """One pipeline stage of DeepSeek-V4 (the whole model at one stage), placed as GPTModel places its pieces: the
    first stage (`pre_process`) embeds, the last (`post_process`) holds the head and the MTP layers. Between stages
    travel the hyper-connection streams [B, S, hc_mult, H], flattened to [S * hc_mult, B, H], the
    [seq, batch, hidden] tensor Megatron's schedules send: give them `seq_length` = S * hc_mult
    (`provider.pipeline_seq_length`). The MTP layers and a tied head read the word embedding, so the last stage
    keeps a copy of it, as Megatron does (`shared_embedding`: the same initial values, its gradient all-reduced
    with the first stage's by finalize_model_grads)."""

    model_type = ModelType.encoder_or_decoder  # what Megatron's schedules ask of a model

    def __init__(self, config, args: DeepseekV4Args, padded_vocab_size: int, attention: str = "exact",
                 build_mtp: bool = True, mtp_loss_scale: float = 0.0, pre_process: bool = True,
                 post_process: bool = True, keep_attention_output: bool = False):
        super().__init__(config=config)
        self.args, self.hc_mult, self.mtp_loss_scale = args, args.hc_mult, mtp_loss_scale
        self.pre_process, self.post_process = pre_process, post_process
        # GPTModel's attributes, which trainers read (vocab_size: the real vocabulary, as modelzoo's other models)
        self.vocab_size, self.max_sequence_length = args.vocab_size, args.max_position_embeddings
        self.share_embeddings_and_output_weights = args.tie_word_embeddings
        self.sequence_parallel = sequence_parallel.enabled(config)
        num_mtp_layers = args.num_mtp_layers if build_mtp else 0
        # the MTP layers and a tied head read the embedding on the last stage; finalize_model_grads all-reduces it
        # between the stages when share_embeddings_and_output_weights or config.mtp_num_layers says so
        self.last_stage_embeds = args.tie_word_embeddings or bool(num_mtp_layers)
        self.input_tensor = None
        if pre_process or (post_process and self.last_stage_embeds):
            self.embedding = nn.Module()
            self.embedding.word_embeddings = VocabParallelEmbedding(
                padded_vocab_size, args.hidden_size, init_method=config.init_method, config=config,
                reduce_scatter_embeddings=self.sequence_parallel)
        self.decoder = DeepseekV4Decoder(config, args, attention, post_process, keep_attention_output)
        if post_process:
            # tied: no weight of its own, the embedding matrix is handed to it (as GPTModel does)
            self.output_layer = ColumnParallelLinear(
                args.hidden_size, padded_vocab_size, config=sequence_parallel.whole_sequence_config(config),
                init_method=config.init_method, bias=False, gather_output=False,
                skip_weight_param_allocation=args.tie_word_embeddings)
            self.mtp = DeepseekV4MTP(config, args, DeepseekV4DecoderLayer, attention, num_mtp_layers)
        if args.tie_word_embeddings and pre_process and post_process:
            # one weight used twice on this stage: with gradient-accumulation fusion the output layer adds its
            # gradient to main_grad itself, and Megatron's DDP must then add a zero, not garbage (LanguageModule)
            self.embedding.word_embeddings.weight.zero_out_wgrad = True
        if config.pipeline_model_parallel_size > 1 and self.last_stage_embeds:
            self._share_embedding_across_stages()
        # The language-model loss reaches neither the indexers (a top-k of indices: DeepSeek trains them with a
        # loss of their own, not implemented here) nor the MTP layers unless their loss is on. Frozen, they are
        # what a step leaves them anyway, and Megatron's DDP, which waits for a gradient of every trainable
        # parameter when it overlaps the reduction with the backward, has none to wait for.
        for name, param in self.named_parameters():
            if ".indexer." in name or (name.startswith("mtp.") and not mtp_loss_scale):
                param.requires_grad_(False)
        self.layer_graphs: LayerGraphs | None = None

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The word embedding on a stage that holds it (finalize_model_grads all-reduces its gradient)."""
        return self.embedding.word_embeddings.weight if hasattr(self, "embedding") else None

    def _share_embedding_across_stages(self) -> None:
        """The first and last stages' embeddings are one weight, as in Megatron's LanguageModule."""
        share_embedding_across_stages(self.shared_embedding_or_output_weight(), self.pre_process,
                                      self.config.init_model_with_meta_device)

    def capture_cuda_graphs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        """Capture the decoder layers' forward and backward as two CUDA graphs for inputs of this shape.

        Later forwards with inputs of the same shape (and training mode) replay them: one launch per
        pass instead of thousands. A parameter's `.grad` made by a graphed backward is the graph's
        buffer (see `modelzoo.layers.cuda_graphs`). Other shapes, and forwards that record or replay decisions,
        run eagerly. Each forward with gradients must have its backward before the next forward (see
        `modelzoo.layers.cuda_graphs`). Needs bf16 on a GPU and no host synchronisation inside a layer, so
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

        from modelzoo.conversion.engine import checkpoint_name_of

        if sharded_offsets:
            raise NotImplementedError("DeepSeek-V4: virtual pipeline (prepended) checkpoint offsets are not supported")
        result = {}
        checkpoint_name = checkpoint_name_of(self)  # a pipeline stage's layers under their numbers in the model
        for name, tensor in self.state_dict(prefix="", keep_vars=True).items():
            # the state dict keeps this stage's names; the checkpoint key is the whole model's
            entry, key = f"{prefix}{name}", f"{prefix}{checkpoint_name(name)}"
            if name.endswith("_extra_state"):
                result[entry] = make_sharded_object_for_checkpoint(tensor, key)
            elif getattr(tensor, "expert_parallel", False):
                offsets = [(0, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())]
                if getattr(tensor, "tensor_model_parallel", False):
                    offsets.append((tensor.partition_dim, ps.get_expert_tensor_parallel_rank(),
                                    ps.get_expert_tensor_parallel_world_size()))
                result[entry] = ShardedTensor.from_rank_offsets(key, tensor, *offsets,
                                                              replica_id=(0, 0, ps.get_expert_data_parallel_rank()))
            elif getattr(tensor, "shared_embedding", False) and not self.pre_process:
                # the last stage's copy of the first stage's embedding: a replica, not written twice (LanguageModule)
                result[entry] = make_tp_sharded_tensor_for_checkpoint(
                    tensor, key, tensor.partition_dim,
                    replica_id=(1, 0, ps.get_data_parallel_rank(with_context_parallel=True)))
            elif getattr(tensor, "tensor_model_parallel", False):
                result[entry] = make_tp_sharded_tensor_for_checkpoint(tensor, key, tensor.partition_dim)
            else:
                result[entry] = make_sharded_tensor_for_checkpoint(tensor, key)
        return result

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] token ids -> [B, S, hidden], under sequence parallelism this rank's [B, S / tp, hidden]."""
        embeddings = self.embedding.word_embeddings(input_ids)
        # reduce-scattered over the TP ranks along Megatron's sequence dim, [S / tp, B, hidden]
        return embeddings.transpose(0, 1) if self.sequence_parallel else embeddings

    def input_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's residual streams: the embeddings copied into hc_mult streams [B, S, N, H]."""
        return self.embed(input_ids).unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()

    def logits(self, streams: torch.Tensor, hc_head: HyperHead, final_layernorm: RMSNorm,
               detach_head: bool = False) -> torch.Tensor:
        """This rank's vocabulary shard of the logits, the padded columns masked (modelzoo.layers.gpt_call);
        `detach_head`: no gradient reaches the output layer's (or tied embedding's) weight."""
        weight = self.embedding.word_embeddings.weight if self.args.tie_word_embeddings else None
        if detach_head:
            weight = (self.output_layer.weight if weight is None else weight).detach()
        hidden = final_layernorm(hc_head(streams))
        if self.sequence_parallel:
            hidden = sequence_parallel.gather_sequence(hidden, dim=1)
        logits, _ = self.output_layer(hidden, weight=weight)
        return gpt_call.mask_padded_vocabulary(logits, self.args.vocab_size)

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's schedules hand each pipeline stage the previous stage's output (None on the first stage)."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def stage_output(self, streams: torch.Tensor) -> torch.Tensor:
        """Streams [B, S, N, H] as the [S * N, B, H] tensor sent to the next stage."""
        batch, seq, streams_per_token, hidden = streams.shape
        return streams.permute(1, 2, 0, 3).reshape(seq * streams_per_token, batch, hidden).contiguous()

    def stage_input(self, received: torch.Tensor) -> torch.Tensor:
        """The previous stage's [S * N, B, H] tensor as streams [B, S, N, H]."""
        length, batch, hidden = received.shape
        return received.view(length // self.hc_mult, self.hc_mult, batch, hidden).permute(2, 0, 1, 3)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, decoder_input: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, inference_context=None, packed_seq_params=None,
                extra_block_kwargs=None, runtime_gather_output: bool | None = None, *, inference_params=None,
                loss_mask: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                mtp_kwargs: dict | None = None, return_mtp: bool = False):
        """GPTModel's call (modelzoo.layers.gpt_call): this rank's vocabulary shard of the logits [B, S, V_padded / tp],
        or with `labels` the per-token loss [B, S] (plus, through the backward, `mtp_loss_scale` x the MTP loss,
        as Megatron's GPTModel adds it). `padding_mask` [B, S] (True = padding) keeps tokens from the experts.

        `mtp_kwargs={"mtp_labels": tokens}` (slime's and miles' MTP training; labels may be None and the logits come
        out): `mtp_loss_scale` x the MTP loss against `tokens` [B, S] (the input ids: depth k's target at i is
        tokens[i + k + 1]) joins the backward, as in slime's Megatron. As there, it trains the MTP layers alone: they
        read the main model's streams, the embedding and the output layer detached.

        With `return_mtp=True`: (logits, [logits of MTP depth k for k = 1..D]); depth k at position
        i predicts token i + k + 1 of its sequence (its last k positions have no target).
        """
        gpt_call.refuse_unsupported("DeepSeek-V4", inference_context, inference_params, extra_block_kwargs)
        mtp_labels = self.mtp_labels(mtp_kwargs, input_ids)
        layout = self.token_layout(input_ids, decoder_input, position_ids, attention_mask, packed_seq_params)
        unrouted = unrouted_tokens(layout, padding_mask)
        if input_ids is None and any(kind == HASH_MOE for kind in self.args.mlp_layer_types):
            raise ValueError("DeepSeek-V4: hash-routed MoE layers route by token id: pass input_ids with decoder_input")
        position_ids = self.default_position_ids(input_ids) if layout.plain else layout.rope_positions
        if not self.pre_process:
            streams = self.stage_input(self.input_tensor)
        elif decoder_input is not None:  # [s, b, hidden], Megatron's layout (this rank's s / tp under sequence parallel)
            embeddings = decoder_input.transpose(0, 1)
            streams = embeddings.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()
        else:
            streams = self.input_streams(input_ids)
        graphs = self.layer_graphs
        if layout.plain and graphs is not None and graphs.matches(streams, position_ids, input_ids) \
                and not deciding(self):
            streams = graphs(streams, position_ids, input_ids)
        else:
            streams = self.decoder(streams, position_ids, input_ids, layout, unrouted)
        if not self.post_process:
            return self.stage_output(streams)
        logits = self.logits(streams, self.decoder.hc_head, self.decoder.final_layernorm)
        mtp_trains = mtp_labels is not None or (labels is not None and bool(self.mtp_loss_scale))
        if return_mtp or mtp_trains:
            if not self.mtp.layers:
                raise ValueError("this DeepSeek-V4 model was built without MTP layers (num_nextn_predict_layers=0 "
                                 "or build_mtp=False)")
            mtp_logits = self.mtp(self, streams, input_ids, position_ids, layout, unrouted,
                                  isolated=mtp_labels is not None)
        output = gpt_call.language_model_output(logits, labels, self.args.vocab_size, runtime_gather_output)
        if mtp_trains:
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler


            targets = input_ids if mtp_labels is None else mtp_labels
            output = MTPLossAutoScaler.apply(output, self.mtp_loss_scale * mtp_loss(
                mtp_logits, targets, self.args.vocab_size, layout, loss_mask))
        return (output, mtp_logits) if return_mtp else output

    def mtp_labels(self, mtp_kwargs: dict | None, input_ids: torch.Tensor | None) -> torch.Tensor | None:
        """`mtp_kwargs["mtp_labels"]`, checked: MTP training needs MTP layers that train and the tokens' shape."""
        labels = (mtp_kwargs or {}).get("mtp_labels")
        if labels is None or not self.post_process:
            return None
        if not (self.args.num_mtp_layers and hasattr(self, "mtp") and self.mtp.layers):
            raise ValueError("DeepSeek-V4: mtp_kwargs={'mtp_labels': ...} asks for MTP training, but this model has "
                             "no MTP layers (num_nextn_predict_layers=0, build_mtp=False, or a checkpoint without "
                             "mtp.* tensors)")
        if not self.mtp_loss_scale:
            raise ValueError("DeepSeek-V4: mtp_kwargs={'mtp_labels': ...} asks for MTP training, but mtp_loss_scale "
                             "is 0, so the MTP layers are frozen: build the provider with mtp_loss_scale > 0 "
                             "(Megatron's mtp_loss_scaling_factor)")
        if input_ids is not None and labels.shape != input_ids.shape:
            raise ValueError(f"DeepSeek-V4: mtp_labels must be the input ids' shape {list(input_ids.shape)} (the "
                             f"tokens, as slime passes them), got {list(labels.shape)}")
        return labels

    def token_layout(self, input_ids, decoder_input, position_ids, attention_mask, packed_seq_params) -> TokenLayout:
        """The batch's layout; a general attention mask cannot say where DeepSeek-V4's compressor windows start."""
        layout = gpt_call.input_layout("DeepSeek-V4", input_ids, decoder_input, position_ids, attention_mask,
                                       packed_seq_params, self.args.max_position_embeddings, self.config)
        if not layout.plain and not layout.whole_rows().contiguous():
            raise ValueError("DeepSeek-V4: compressed attention pools windows of each sequence's consecutive tokens; "
                             "this attention_mask is not causal over runs of consecutive tokens: pass a "
                             "[batch, 1, 1, seq] padding mask, a [batch, 1, seq, seq] mask that is causal over each "
                             "row's real tokens (left or right padding, or packed documents), or packed_seq_params")
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
