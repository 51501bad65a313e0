"""IQuest LoopCoder for Hugging Face transformers: a reference implementation (no `trust_remote_code`).

Math. h = embed(x). The same L Llama layers run twice, sharing every weight; positions and RoPE are the same in
both loops.
  Loop 1, layer l: a plain Llama block. Its post-RoPE keys/values K1[l], V1[l] are kept for loop 2.
  Loop 2, layer l: u = RMSNorm_in(h); q2, k2, v2 = RoPE(Wq u), RoPE(Wk u), Wv u (same weights as loop 1);
    A = causal attention of q2 over K1[l], V1[l]                 (global: every position <= t)
    B = causal attention of q2 over k2, v2 at positions t-W+1..t  (local: W = loop_window_size, self included)
    g[t, head] = sigmoid(q2[t, head, :] . Wg_l[head, :] + bg_l[head])
    h += Wo concat_heads(g A + (1 - g) B);  h += MLP(RMSNorm_post(h))
  Then the final RMSNorm and the lm_head (the embedding matrix when tie_word_embeddings). GQA, scale 1/sqrt(head_dim).
  loop_num=1 is plain Llama.

Defects of the official remote code (`modeling_iquestloopcoder.py`) that this implementation avoids:
  - loop 2 reads K1/V1 only from the cache object, so `use_cache=False` (training, gradient checkpointing) fails;
    here K1/V1 are handed from loop 1 to loop 2 directly, and the cache only stores them.
  - the mixed [batch, heads, seq, head_dim] output is reshaped to [batch, seq, heads * head_dim] without a transpose,
    which is wrong whenever more than one token is processed; here it is transposed first.
  - prefill trims the local keys/values to the last W tokens before attending, so earlier prompt positions lose
    their window (prefill and token-by-token decode disagree); here every position gets its own window through the
    mask, and only what is stored for later steps is trimmed.
"""

import torch
from torch import nn

from transformers import AutoConfig, AutoModelForCausalLM
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from .config import IQuestLoopCoderConfig


class IQuestLoopCoderCache(Cache):
    """Cache of `2 * num_hidden_layers` layers: the first L hold the full loop-1 keys/values of each layer (loop 2's
    global attention reads them), the last L hold loop 2's own keys/values, of which only the last
    `loop_window_size - 1` tokens are kept between steps (enough for the local window of the next token)."""

    def __init__(self, config: IQuestLoopCoderConfig):
        self.num_physical_layers = config.num_hidden_layers
        layers = [DynamicLayer() for _ in range(config.num_hidden_layers)]
        if config.loop_num == 2:
            layers += [
                DynamicSlidingWindowLayer(sliding_window=config.loop_window_size)
                for _ in range(config.num_hidden_layers)
            ]
        super().__init__(layers=layers)

    def update_global(self, key_states, value_states, layer_idx):
        """Append loop-1 keys/values of `layer_idx`; return all of them so far."""
        return self.update(key_states, value_states, layer_idx)

    def update_local(self, key_states, value_states, layer_idx):
        """Append loop-2 keys/values of `layer_idx`; return the kept past ones followed by the new ones."""
        return self.update(key_states, value_states, self.num_physical_layers + layer_idx)


def visible_keys(query_slots, num_keys, padding_mask=None, window=None):
    """Boolean mask [batch or 1, 1, queries, keys], True where a query may attend a key.

    Slots are indices in the whole sequence (cache included). The keys are the `num_keys` slots that end at the last
    query, as every cache layer returns them. `window` limits keys to slots t-window+1..t. A padding query (left
    padding) sees only itself, which keeps its softmax finite; its output is never read by a real token.
    """
    key_slots = torch.arange(num_keys, device=query_slots.device) + (query_slots[-1] + 1 - num_keys)
    offset = query_slots[:, None] - key_slots[None, :]
    allowed = offset >= 0
    if window is not None:
        allowed &= offset < window
    allowed = allowed[None, None]
    if padding_mask is not None:
        key_is_token = padding_mask[:, key_slots].bool()[:, None, None, :]
        allowed = allowed & (key_is_token | (offset == 0))
    return allowed


def masked_attention(query, key, value, allowed, scaling, attn_implementation):
    """Softmax attention of `query` [b, heads, q, d] over `key`/`value` [b, kv_heads, k, d] where `allowed` is True.
    Returns [b, heads, q, d] (heads not yet merged)."""
    num_key_value_groups = query.shape[1] // key.shape[1]
    key = repeat_kv(key, num_key_value_groups)
    value = repeat_kv(value, num_key_value_groups)
    if attn_implementation == "sdpa":
        return nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)


class IQuestLoopCoderLoopGate(nn.Module):
    """Per-head mixing gate of loop 2: g[.., head, t] = sigmoid(query[.., head, t, :] . weight[head] + bias[head])."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(num_heads))

    def forward(self, query: torch.Tensor) -> torch.Tensor:
        """query [b, heads, q, d] -> gate [b, heads, q, 1]."""
        logits = torch.einsum("bhqd,hd->bhq", query, self.weight) + self.bias[:, None]
        return torch.sigmoid(logits)[..., None]


class IQuestLoopCoderAttention(nn.Module):
    """Llama attention projections; which keys are attended is decided by the decoder layer for each loop."""

    def __init__(self, config: IQuestLoopCoderConfig):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )

    def project(self, hidden_states, position_embeddings):
        """Post-RoPE query, key and value, each [b, heads, s, d]."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    def attend(self, query, key, value, allowed):
        return masked_attention(query, key, value, allowed, self.scaling, self.config._attn_implementation)

    def output(self, attn_output):
        """[b, heads, s, d] -> o_proj of [b, s, heads * d]; the transpose keeps each token's heads together."""
        batch_size, _, query_length, _ = attn_output.shape
        return self.o_proj(attn_output.transpose(1, 2).reshape(batch_size, query_length, -1))


class IQuestLoopCoderDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: IQuestLoopCoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.loop_window_size = config.loop_window_size
        self.self_attn = IQuestLoopCoderAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        loop1_key: torch.Tensor | None = None,
        loop1_value: torch.Tensor | None = None,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        query_slots: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        loop_gate: IQuestLoopCoderLoopGate | None = None,
        cache: IQuestLoopCoderCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Loop 1 when `loop1_key` is None, else loop 2 over this layer's loop-1 keys/values.

        Loop-1 keys/values are positional arguments so that they get gradients under reentrant checkpointing.
        Returns the new hidden states and the keys/values this loop attended with its own projections (in loop 1,
        all keys so far: what loop 2 needs).
        """
        residual = hidden_states
        query, key, value = self.self_attn.project(self.input_layernorm(hidden_states), position_embeddings)

        if loop1_key is None:
            if cache is not None:
                key, value = cache.update_global(key, value, self.layer_idx)
            causal = visible_keys(query_slots, key.shape[-2], padding_mask)
            attn_output = self.self_attn.attend(query, key, value, causal)
        else:
            causal = visible_keys(query_slots, loop1_key.shape[-2], padding_mask)
            global_output = self.self_attn.attend(query, loop1_key, loop1_value, causal)
            if cache is not None:
                key, value = cache.update_local(key, value, self.layer_idx)
            window = visible_keys(query_slots, key.shape[-2], padding_mask, window=self.loop_window_size)
            local_output = self.self_attn.attend(query, key, value, window)
            gate = loop_gate(query)
            attn_output = gate * global_output + (1 - gate) * local_output

        hidden_states = residual + self.self_attn.output(attn_output)
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, key, value


class IQuestLoopCoderPreTrainedModel(PreTrainedModel):
    config: IQuestLoopCoderConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["IQuestLoopCoderDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        # Linears and embeddings: normal(0, initializer_range); norms: ones; RoPE buffers.
        super()._init_weights(module)
        if isinstance(module, IQuestLoopCoderLoopGate):
            # Upstream starts the gate at zero, i.e. an even mix g = 0.5.
            init.zeros_(module.weight)
            init.zeros_(module.bias)


class IQuestLoopCoderModel(IQuestLoopCoderPreTrainedModel):
    def __init__(self, config: IQuestLoopCoderConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [IQuestLoopCoderDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        # At model level, one per physical layer: the official checkpoint layout.
        self.gate_projections = nn.ModuleList(
            [
                IQuestLoopCoderLoopGate(config.num_attention_heads, config.head_dim)
                for _ in range(config.num_hidden_layers)
            ]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: IQuestLoopCoderCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """`attention_mask`: None or a 2D [batch, past + new] mask, 1 for tokens and 0 for padding."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if use_cache and cache is None:
            cache = IQuestLoopCoderCache(self.config)
        if cache is not None and not isinstance(cache, IQuestLoopCoderCache):
            raise TypeError(
                f"IQuestLoopCoder needs an IQuestLoopCoderCache (full loop-1 and windowed loop-2 layers), "
                f"got {type(cache).__name__}."
            )

        past_length = cache.get_seq_length() if cache is not None else 0
        query_length = inputs_embeds.shape[1]
        query_slots = torch.arange(past_length, past_length + query_length, device=inputs_embeds.device)
        if position_ids is None:
            position_ids = query_slots.unsqueeze(0)
        if attention_mask is not None and attention_mask.shape != (inputs_embeds.shape[0], past_length + query_length):
            raise ValueError(
                f"attention_mask must be a 2D padding mask of shape [batch, past + new] = "
                f"{[inputs_embeds.shape[0], past_length + query_length]}, got {list(attention_mask.shape)}."
            )

        hidden_states = inputs_embeds
        # One RoPE table for both loops: loop 2 sees the same positions.
        layer_kwargs = {
            "position_embeddings": self.rotary_emb(hidden_states, position_ids),
            "query_slots": query_slots,
            "padding_mask": attention_mask,
            "cache": cache,
        }

        loop1_keys_values = []
        for layer in self.layers:
            hidden_states, key, value = layer(hidden_states, **layer_kwargs)
            loop1_keys_values.append((key, value))

        if self.config.loop_num == 2:
            for layer, loop_gate, (key, value) in zip(self.layers, self.gate_projections, loop1_keys_values):
                hidden_states, _, _ = layer(hidden_states, key, value, loop_gate=loop_gate, **layer_kwargs)

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class IQuestLoopCoderForCausalLM(IQuestLoopCoderPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # tied when config.tie_word_embeddings

    def __init__(self, config: IQuestLoopCoderConfig):
        super().__init__(config)
        self.model = IQuestLoopCoderModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not build a plain DynamicCache; the model builds an IQuestLoopCoderCache on first use.
        return False

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: IQuestLoopCoderCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)


AutoConfig.register(IQuestLoopCoderConfig.model_type, IQuestLoopCoderConfig, exist_ok=True)
AutoModelForCausalLM.register(IQuestLoopCoderConfig, IQuestLoopCoderForCausalLM, exist_ok=True)

__all__ = [
    "IQuestLoopCoderCache",
    "IQuestLoopCoderForCausalLM",
    "IQuestLoopCoderModel",
    "IQuestLoopCoderPreTrainedModel",
]
