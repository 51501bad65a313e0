"""IQuest LoopCoder on Megatron-Core: one physical decoder run twice with shared weights.

    h = embed(x)
    loop 1:  for each layer l:  h, (K1[l], V1[l]) = layer(h)                       # plain causal attention
    loop 2:  for each layer l:  h = layer(h, K1[l], V1[l])
             attention = g * Attn(q2, K1[l], V1[l]) + (1 - g) * SlidingAttn(q2, k2, v2; window W)
             g[t, head] = sigmoid(q2[t, head] . w_l[head] + b_l[head])           # post-RoPE loop-2 query
    logits = output_layer(final_norm(h))                                          # the embedding matrix if tied

The layers are built from Megatron-Core's parallel pieces (ColumnParallelLinear / RowParallelLinear,
MLP, the local spec's norm, RotaryEmbedding) with the same module names as GPTModel, so every
Llama tensor maps the same way; each layer adds a `loop_gate` (weight [heads, head_dim], bias
[heads]) sharded by heads with the attention, so computing it needs no communication.

Loop-1 keys and values are handed from loop 1 to loop 2 through the forward call (a local list),
never stored on a module: they are freed with the autograd graph after backward.

The model takes Megatron-Core GPTModel's call (`modelzoo.layers.gpt_call`): in packed rows and padded batches the
batch's `TokenLayout` keeps every attention (loop 1, loop 2's global attention over loop-1 K/V, and its
window) inside each sequence, and RoPE follows each token's position.

Under sequence parallelism (modelzoo.layers.sequence_parallel) the norms and residuals hold this rank's tokens; the
column-parallel linear_qkv gathers the sequence, so queries, keys, the gate and loop-1 K/V are whole-sequence
tensors of this rank's heads (the gate is sharded with them and gathers nothing).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.utils import divide
from torch import Tensor

from modelzoo.layers import gpt_call, sequence_parallel
from modelzoo.layers.attention import attention
from modelzoo.loopcoder.config import PIPELINE_REFUSAL
from modelzoo.layers.recompute import full_recompute_groups, recomputed, selective_modules
from modelzoo.layers.replicated_kv import QKVParallelLinear
from modelzoo.layers.sequences import TokenLayout

LoopKV = tuple[Tensor, Tensor]  # post-RoPE loop-1 keys and values of one layer, [batch, kv_heads, seq, head_dim]


class LoopGate(torch.nn.Module):
    """The frozen per-head mixing gate of loop 2; this rank's heads only (partition_dim 0 = heads)."""

    def __init__(self, local_heads: int, head_dim: int, dtype: torch.dtype, trainable: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(local_heads, head_dim, dtype=dtype), requires_grad=trainable)
        self.bias = torch.nn.Parameter(torch.zeros(local_heads, dtype=dtype), requires_grad=trainable)
        for param in (self.weight, self.bias):
            tensor_parallel.set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        # split by heads in torch_dist too, so a checkpoint reshards across TP sizes
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(keep_vars=True), prefix, {"weight": 0, "bias": 0}, sharded_offsets)

    def forward(self, query: Tensor) -> Tensor:
        """query [batch, heads, seq, head_dim] -> gate [batch, heads, seq, 1]."""
        logits = torch.einsum("bhsd,hd->bhs", query, self.weight) + self.bias[:, None]
        return torch.sigmoid(logits)[..., None]


# recompute_granularity="selective": the recompute_modules names (Megatron's) LoopCoder honours, in both loops
SELECTIVE_RECOMPUTE = {
    "core_attn": "the attention kernels (causal, global over loop-1 K/V, window)",
    "mlp": "the pre-MLP norm and the MLP, under one checkpoint that keeps only the residual stream",
}


class LoopCoderAttention(MegatronModule):
    def __init__(self, config, loop_window_size: int, attention_impl: str, train_gate: bool, num_kv_heads: int,
                 recompute_core_attention: bool = False):
        super().__init__(config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.head_dim = config.kv_channels
        self.local_heads = divide(config.num_attention_heads, tp)
        self.local_groups = divide(config.num_query_groups, tp)
        self.loop_window_size = loop_window_size
        self.attention_impl = attention_impl
        self.recompute_core_attention = recompute_core_attention
        qkv_size = self.head_dim * (config.num_attention_heads + 2 * config.num_query_groups)
        self.linear_qkv = QKVParallelLinear(  # config.num_query_groups is the TP size when KV heads are copied
            config.hidden_size, qkv_size, config=config, init_method=config.init_method, bias=False,
            gather_output=False, num_kv_heads=num_kv_heads)
        self.linear_proj = tensor_parallel.RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True)
        self.loop_gate = LoopGate(self.local_heads, self.head_dim, config.params_dtype, train_gate)

    def _project(self, hidden: Tensor, rotary: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """hidden [seq, batch, H] -> post-RoPE q [b, heads, s, d], k, v [b, kv_heads, s, d] (this rank's)."""
        qkv, _ = self.linear_qkv(hidden)
        seq, batch = qkv.shape[:2]
        per_group = self.local_heads // self.local_groups
        qkv = qkv.view(seq, batch, self.local_groups, (per_group + 2) * self.head_dim)
        q, k, v = qkv.split([per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(seq, batch, self.local_heads, self.head_dim)
        q = apply_rotary_pos_emb(q, rotary, config=self.config)
        k = apply_rotary_pos_emb(k, rotary, config=self.config)
        return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def _core(self, q: Tensor, k: Tensor, v: Tensor, window: int | None, layout: TokenLayout) -> Tensor:
        scale = self.head_dim**-0.5
        return recomputed(attention, self.recompute_core_attention)(q, k, v, scale, window, self.attention_impl, 0.0,
                                                                    layout)

    def forward(self, hidden: Tensor, rotary: Tensor, layout: TokenLayout,
                loop1_kv: LoopKV | None = None) -> tuple[Tensor, LoopKV]:
        q, k, v = self._project(hidden, rotary)
        if loop1_kv is None:  # loop 1: a plain causal layer
            context = self._core(q, k, v, None, layout)
        else:  # loop 2: global attention over loop-1 K/V, local over its own, mixed per head
            global_context = self._core(q, *loop1_kv, None, layout)
            local_context = self._core(q, k, v, self.loop_window_size, layout)
            gate = self.loop_gate(q)
            context = gate * global_context + (1 - gate) * local_context
        batch, _, seq, _ = q.shape  # the whole sequence: under sequence parallelism linear_qkv gathered it
        context = context.permute(2, 0, 1, 3).reshape(seq, batch, self.local_heads * self.head_dim)
        output, _ = self.linear_proj(context)
        return output, (k, v)


class LoopCoderLayer(MegatronModule):
    def __init__(self, config, loop_window_size: int, attention_impl: str, train_gate: bool, num_kv_heads: int,
                 recompute: frozenset[str] = frozenset()):
        super().__init__(config)
        self.input_layernorm = sequence_parallel.rms_norm(config, config.hidden_size, config.layernorm_epsilon)
        self.self_attention = LoopCoderAttention(config, loop_window_size, attention_impl, train_gate, num_kv_heads,
                                                 "core_attn" in recompute)
        self.pre_mlp_layernorm = sequence_parallel.rms_norm(config, config.hidden_size, config.layernorm_epsilon)
        self.mlp = MLP(config, MLPSubmodules(linear_fc1=tensor_parallel.ColumnParallelLinear,
                                             linear_fc2=tensor_parallel.RowParallelLinear))
        self.recompute_mlp = "mlp" in recompute

    def _mlp(self, hidden: Tensor) -> Tensor:
        mlp_out, _ = self.mlp(self.pre_mlp_layernorm(hidden))
        return mlp_out

    def forward(self, hidden: Tensor, rotary: Tensor, layout: TokenLayout,
                loop1_kv: LoopKV | None = None) -> tuple[Tensor, LoopKV]:
        attention_out, kv = self.self_attention(self.input_layernorm(hidden), rotary, layout, loop1_kv)
        hidden = hidden + attention_out
        return hidden + recomputed(self._mlp, self.recompute_mlp)(hidden), kv


class LoopCoderDecoder(MegatronModule):
    def __init__(self, config, loop_window_size: int, attention_impl: str, train_gate: bool, num_kv_heads: int):
        super().__init__(config)
        recompute = selective_modules(config, "LoopCoder", SELECTIVE_RECOMPUTE)
        self.layers = torch.nn.ModuleList(LoopCoderLayer(config, loop_window_size, attention_impl, train_gate,
                                                         num_kv_heads, recompute) for _ in range(config.num_layers))
        self.final_layernorm = sequence_parallel.rms_norm(config, config.hidden_size, config.layernorm_epsilon)
        # Megatron's full recompute, applied alike to each loop: runs of layers, each run under one checkpoint or none
        self.recompute_groups = full_recompute_groups(config, config.num_layers)

    def _run(self, layers: range, checkpointed: bool, hidden: Tensor, rotary: Tensor, layout: TokenLayout,
             loop1_kv: list[LoopKV] | None) -> tuple[Tensor, list[LoopKV]]:
        """One loop's pass through `layers` (loop 2 when given every layer's loop-1 K/V) -> hidden, their K/V."""
        def run(hidden, *layer_kv):
            produced = []
            for index, kv in zip(layers, layer_kv):
                hidden, kv = self.layers[index](hidden, rotary, layout, kv)
                produced.append(kv)
            return hidden, produced

        # loop-1 K/V are outputs of a recomputed run and loop-2 inputs to it: gradients reach them through both
        layer_kv = [None] * len(layers) if loop1_kv is None else [loop1_kv[index] for index in layers]
        return recomputed(run, checkpointed)(hidden, *layer_kv)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        # Megatron's default treats a plain ModuleList as replicated; each layer knows its own TP split
        state = {}
        for index, layer in enumerate(self.layers):
            state.update(layer.sharded_state_dict(f"{prefix}layers.{index}.", sharded_offsets, metadata))
        state.update(sharded_state_dict_default(self.final_layernorm, f"{prefix}final_layernorm.", sharded_offsets,
                                                metadata, tp_group=parallel_state.get_tensor_model_parallel_group()))
        return state

    def forward(self, hidden: Tensor, rotary: Tensor, loop_num: int, layout: TokenLayout) -> Tensor:
        loop1_kv: list[LoopKV] = []
        for layers, checkpointed in self.recompute_groups:
            hidden, kv = self._run(layers, checkpointed, hidden, rotary, layout, None)
            loop1_kv += kv
        if loop_num == 2:
            for layers, checkpointed in self.recompute_groups:
                hidden, _ = self._run(layers, checkpointed, hidden, rotary, layout, loop1_kv)
        return self.final_layernorm(hidden)


class LoopCoderModel(gpt_call.GPTModelSurface, MegatronModule):
    """Embedding -> LoopCoderDecoder (run `loop_num` times) -> vocab-parallel output layer."""

    model_type = ModelType.encoder_or_decoder  # what Megatron's schedules ask of a model
    pre_process = post_process = True  # one pipeline stage: it embeds and holds the head (GPTModel's flags)

    def __init__(self, config, vocab_size: int, padded_vocab_size: int, max_sequence_length: int, rope_theta: float,
                 loop_num: int, loop_window_size: int, num_kv_heads: int, attention_impl: str = "exact",
                 train_gate: bool = False, tie_word_embeddings: bool = False):
        super().__init__(config)
        self.loop_num, self.vocab_size, self.max_sequence_length = loop_num, vocab_size, max_sequence_length
        self.share_embeddings_and_output_weights = tie_word_embeddings
        self.embedding = LanguageModelEmbedding(config, padded_vocab_size, max_sequence_length,
                                                position_embedding_type="none")
        self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, rotary_percent=1.0, rotary_base=rope_theta,
                                              use_cpu_initialization=config.use_cpu_initialization)
        self.decoder = LoopCoderDecoder(config, loop_window_size, attention_impl, train_gate, num_kv_heads)
        # tied: the output layer has no weight of its own and is handed the embedding matrix (as GPTModel does)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, padded_vocab_size, config=config, init_method=config.init_method, bias=False,
            gather_output=False, skip_weight_param_allocation=tie_word_embeddings)
        if tie_word_embeddings:
            # one weight used twice on this stage: with gradient-accumulation fusion the output layer adds its
            # gradient to main_grad itself, and Megatron's DDP must then add a zero, not garbage (LanguageModule)
            self.embedding.word_embeddings.weight.zero_out_wgrad = True

    def shared_embedding_or_output_weight(self) -> Tensor:
        """The word embedding (GPTModel's answer on a first stage; the output layer's weight when tied)."""
        return self.embedding.word_embeddings.weight

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's schedules hand each pipeline stage its input; LoopCoder is one stage, whose input is None."""
        tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        if any(tensor is not None for tensor in tensors):
            raise ValueError(PIPELINE_REFUSAL.format(pp=self.config.pipeline_model_parallel_size))

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                decoder_input: Tensor | None = None, labels: Tensor | None = None, inference_context=None,
                packed_seq_params=None, extra_block_kwargs=None, runtime_gather_output: bool | None = None, *,
                inference_params=None, loss_mask=None, padding_mask=None, mtp_kwargs=None) -> Tensor:
        """GPTModel's call (modelzoo.layers.gpt_call): this rank's vocabulary shard of the logits [batch, seq, vocab / tp],
        or with `labels` the per-token loss [batch, seq]."""
        gpt_call.refuse_unsupported("LoopCoder", inference_context, inference_params, extra_block_kwargs)
        gpt_call.refuse_mtp_training("LoopCoder", mtp_kwargs)
        layout = gpt_call.input_layout("LoopCoder", input_ids, decoder_input, position_ids, attention_mask,
                                       packed_seq_params, self.max_sequence_length, self.config)
        hidden = decoder_input if decoder_input is not None else self.embedding(input_ids, None)  # [seq, batch, hidden]
        rotary = gpt_call.rotary_per_token(self.rotary_pos_emb, layout)
        hidden = self.decoder(hidden, rotary, self.loop_num, layout)
        output_weight = self.embedding.word_embeddings.weight if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=output_weight)
        return gpt_call.language_model_output(logits.transpose(0, 1), labels, self.vocab_size, runtime_gather_output)

