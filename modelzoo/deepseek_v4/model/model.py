"""The DeepSeek-V4 decoder on Megatron-Core parallel layers (transformers' DeepseekV4ForCausalLM).

    streams = embed(ids) copied to hc_mult streams                   VocabParallelEmbedding
    for each layer:  streams = hc(attention) ; streams = hc(MoE)     decoder.layers.N
    x = final_norm(hc_head(streams)); logits = output_layer(x)       vocab-parallel logits (embedding matrix if tied)
    [mtp: next-token-after-next heads on the final streams]          mtp.layers.K

Tensors are batch-first [B, S, ...] throughout, like transformers, so that the parity path runs
the same ops in the same order. Module names follow Megatron's (embedding / decoder / output_layer,
linear_q_down_proj, linear_proj, pre_mlp_layernorm, ...); bridge.py maps them to the HF names.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.transformer.module import MegatronModule
from torch import nn

from modelzoo.cuda_graphs import LayerGraphs
from modelzoo.deepseek_v4.config import DeepseekV4Args
from modelzoo.deepseek_v4.model.attention import DeepseekV4Attention
from modelzoo.deepseek_v4.model.decisions import deciding
from modelzoo.deepseek_v4.model.hyper_connection import HyperConnection, HyperHead, hc_residual
from modelzoo.deepseek_v4.model.layers import RMSNorm
from modelzoo.deepseek_v4.model.moe import DeepseekV4MoE


def hyper_connection(config, args: DeepseekV4Args) -> HyperConnection:
    return HyperConnection(args.hidden_size, args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps,
                           config.init_method_std)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config, args: DeepseekV4Args, layer_type: str, mlp_type: str, attention: str = "exact"):
        super().__init__()
        self.layer_type, self.mlp_type = layer_type, mlp_type
        self.attn_hc = hyper_connection(config, args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attention = DeepseekV4Attention(config, args, layer_type, attention)
        self.ffn_hc = hyper_connection(config, args)
        self.pre_mlp_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = DeepseekV4MoE(config, args, mlp_type)

    def forward(self, streams: torch.Tensor, position_ids: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """streams [B, S, hc_mult, hidden] -> same shape."""
        post, comb, collapsed, streams = self.attn_hc(streams)
        attn_output = self.self_attention(self.input_layernorm(collapsed), position_ids)
        streams = hc_residual(post, comb, attn_output, streams)
        post, comb, collapsed, streams = self.ffn_hc(streams)
        mlp_output = self.mlp(self.pre_mlp_layernorm(collapsed), input_ids)
        return hc_residual(post, comb, mlp_output, streams)


class DeepseekV4Decoder(nn.Module):
    def __init__(self, config, args: DeepseekV4Args, attention: str = "exact"):
        super().__init__()
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(config, args, layer_type, mlp_type, attention)
            for layer_type, mlp_type in zip(args.layer_types, args.mlp_layer_types, strict=True))
        self.hc_head = HyperHead(args.hidden_size, args.hc_mult, args.hc_eps, args.rms_norm_eps, config.init_method_std)
        self.final_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class DeepseekV4Model(MegatronModule):
    def __init__(self, config, args: DeepseekV4Args, padded_vocab_size: int, attention: str = "exact",
                 build_mtp: bool = True):
        super().__init__(config=config)
        from modelzoo.deepseek_v4.model.mtp import DeepseekV4MTP

        self.args, self.hc_mult = args, args.hc_mult
        self.embedding = nn.Module()
        self.embedding.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, args.hidden_size, init_method=config.init_method, config=config)
        self.decoder = DeepseekV4Decoder(config, args, attention)
        # tied: no weight of its own, the embedding matrix is handed to it (as GPTModel does)
        self.output_layer = ColumnParallelLinear(
            args.hidden_size, padded_vocab_size, config=config, init_method=config.init_method, bias=False,
            gather_output=False, skip_weight_param_allocation=args.tie_word_embeddings)
        if args.tie_word_embeddings:
            # one weight used twice on this stage: with gradient-accumulation fusion the output layer adds its
            # gradient to main_grad itself, and Megatron's DDP must then add a zero, not garbage (LanguageModule)
            self.embedding.word_embeddings.weight.zero_out_wgrad = True
        self.mtp = DeepseekV4MTP(config, args, attention) if build_mtp and args.num_mtp_layers else None
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
        return self.embedding.word_embeddings(input_ids)

    def input_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's residual streams: the embeddings copied into hc_mult streams [B, S, N, H]."""
        return self.embed(input_ids).unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()

    def logits(self, streams: torch.Tensor, hc_head: HyperHead, final_layernorm: RMSNorm) -> torch.Tensor:
        weight = self.embedding.word_embeddings.weight if self.args.tie_word_embeddings else None
        logits, _ = self.output_layer(final_layernorm(hc_head(streams)), weight=weight)
        return logits

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                return_mtp: bool = False):
        """input_ids [B, S] -> this rank's vocabulary shard of the logits [B, S, V_padded / tp].

        With `return_mtp=True`: (logits, [logits of MTP depth k for k = 1..D]); depth k at position
        i predicts token i + k + 1 (its last k positions have no target).
        """
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids)
        streams = self.input_streams(input_ids)
        graphs = self.layer_graphs
        if graphs is not None and graphs.matches(streams, position_ids, input_ids) and not deciding(self):
            streams = graphs(streams, position_ids, input_ids)
        else:
            for layer in self.decoder.layers:
                streams = layer(streams, position_ids, input_ids)
        logits = self.logits(streams, self.decoder.hc_head, self.decoder.final_layernorm)
        if not return_mtp:
            return logits
        if self.mtp is None:
            raise ValueError("this DeepSeek-V4 model was built without MTP layers (num_nextn_predict_layers=0 "
                             "or build_mtp=False)")
        return logits, self.mtp(self, streams, input_ids, position_ids)
