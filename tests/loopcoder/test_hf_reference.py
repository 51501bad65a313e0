"""Acceptance tests of the Hugging Face reference implementation of IQuest LoopCoder (CPU, fp32, tiny model).

Tests 1-2 check that the cached paths agree with the full forward (self-consistency); test 4 checks the math against
an independent oracle written below with plain loops over positions; test 3 checks loop_num=1 against transformers'
Llama.
"""

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from modelzoo.loopcoder import IQuestLoopCoderCache, IQuestLoopCoderConfig, IQuestLoopCoderForCausalLM

LOOP_WINDOW_SIZE = 4
SEQUENCE_LENGTH = 13  # > 2 * LOOP_WINDOW_SIZE, so windows slide well past the prompt
TOLERANCE = 1e-5


def tiny_config(**overrides) -> IQuestLoopCoderConfig:
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rope_theta=10000.0,
        loop_num=2,
        loop_window_size=LOOP_WINDOW_SIZE,
        pad_token_id=0,
        eos_token_id=None,
    )
    fields.update(overrides)
    return IQuestLoopCoderConfig(**fields)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Seeded weights large enough for sharp attention and gates spread over (0, 1), so that wrong windows, masks
    or gates change the logits far beyond the tolerance. Gates are non-zero (upstream initialises them to zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.1 * noise)
            elif "gate_projections" in name:
                parameter.copy_(0.5 * noise if name.endswith("weight") else noise)
            elif "embed_tokens" in name:
                parameter.copy_(noise)
            else:  # linear [out, in]
                parameter.copy_(noise / math.sqrt(parameter.shape[-1]))


def tiny_model(attn_implementation: str = "eager", seed: int = 0, **overrides) -> IQuestLoopCoderForCausalLM:
    model = IQuestLoopCoderForCausalLM(tiny_config(attn_implementation=attn_implementation, **overrides))
    randomize_(model, seed)
    return model.eval()


def random_tokens(length: int = SEQUENCE_LENGTH, batch_size: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 128, (batch_size, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------------------------------------------------
# Independent oracle: one token, one head at a time, explicit key lists. Shares no code with hf_model.py.
# ---------------------------------------------------------------------------------------------------------------------


def oracle_logits(weights: dict, config: IQuestLoopCoderConfig, tokens: list[int], loop2_global_keys_detached=False):
    """Logits [len(tokens), vocab] computed from a state dict with plain per-position loops.

    `loop2_global_keys_detached` cuts the gradient from loop 2's global attention into loop 1's keys/values (used to
    show that the gradient of the real model does flow through that path).
    """
    head_dim = config.head_dim
    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    heads_per_kv_head = num_heads // num_kv_heads
    window, eps = config.loop_window_size, config.rms_norm_eps
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def rms_norm(x, weight):
        return weight * x / torch.sqrt((x * x).mean() + eps)

    def rope(vector, position):
        # Rotate-half convention: dimension i pairs with i + head_dim/2.
        cos, sin = torch.cos(position * inv_freq), torch.sin(position * inv_freq)
        first, second = vector[: head_dim // 2], vector[head_dim // 2 :]
        return torch.cat([first * cos - second * sin, second * cos + first * sin])

    def attend(query, keys, values):
        scores = torch.stack([query @ key for key in keys]) / math.sqrt(head_dim)
        probs = torch.softmax(scores, dim=0)
        return sum(p * value for p, value in zip(probs, values))

    hidden = [weights["model.embed_tokens.weight"][token] for token in tokens]
    loop1_keys, loop1_values = {}, {}
    for loop in range(config.loop_num):
        for layer in range(config.num_hidden_layers):
            prefix = f"model.layers.{layer}."
            w = {name[len(prefix) :]: tensor for name, tensor in weights.items() if name.startswith(prefix)}
            queries, keys, values = [], [], []
            for position, h in enumerate(hidden):
                u = rms_norm(h, w["input_layernorm.weight"])
                q = (w["self_attn.q_proj.weight"] @ u).view(num_heads, head_dim)
                k = (w["self_attn.k_proj.weight"] @ u).view(num_kv_heads, head_dim)
                queries.append([rope(q[head], position) for head in range(num_heads)])
                keys.append([rope(k[head], position) for head in range(num_kv_heads)])
                values.append(list((w["self_attn.v_proj.weight"] @ u).view(num_kv_heads, head_dim)))

            new_hidden = []
            for t, h in enumerate(hidden):
                head_outputs = []
                for head in range(num_heads):
                    kv = head // heads_per_kv_head
                    query = queries[t][head]
                    own_keys = [keys[s][kv] for s in range(t + 1)]
                    own_values = [values[s][kv] for s in range(t + 1)]
                    if loop == 0:
                        head_outputs.append(attend(query, own_keys, own_values))
                        continue
                    past_keys = [loop1_keys[layer][s][kv] for s in range(t + 1)]
                    past_values = [loop1_values[layer][s][kv] for s in range(t + 1)]
                    if loop2_global_keys_detached:
                        past_keys = [key.detach() for key in past_keys]
                        past_values = [value.detach() for value in past_values]
                    global_output = attend(query, past_keys, past_values)
                    first = max(0, t - window + 1)
                    local_output = attend(query, own_keys[first:], own_values[first:])
                    gate_weight = weights[f"model.gate_projections.{layer}.weight"][head]
                    gate_bias = weights[f"model.gate_projections.{layer}.bias"][head]
                    gate = torch.sigmoid(query @ gate_weight + gate_bias)
                    head_outputs.append(gate * global_output + (1 - gate) * local_output)
                h = h + w["self_attn.o_proj.weight"] @ torch.cat(head_outputs)
                v = rms_norm(h, w["post_attention_layernorm.weight"])
                mlp_hidden = torch.nn.functional.silu(w["mlp.gate_proj.weight"] @ v) * (w["mlp.up_proj.weight"] @ v)
                new_hidden.append(h + w["mlp.down_proj.weight"] @ mlp_hidden)
            if loop == 0:
                loop1_keys[layer], loop1_values[layer] = keys, values
            hidden = new_hidden

    return torch.stack([weights["lm_head.weight"] @ rms_norm(h, weights["model.norm.weight"]) for h in hidden])


def decode_logits(model, tokens: torch.Tensor, prefill_length: int) -> torch.Tensor:
    """Logits of every position from a prefill of `prefill_length` tokens then one token per forward."""
    cache = IQuestLoopCoderCache(model.config)
    logits = []
    if prefill_length > 0:
        out = model(tokens[:, :prefill_length], cache=cache, use_cache=True)
        logits.append(out.logits)
    for position in range(prefill_length, tokens.shape[1]):
        out = model(tokens[:, position : position + 1], cache=cache, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


# ---------------------------------------------------------------------------------------------------------------------
# 1. full forward == prefill + decode == token-by-token decode
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("prefill_length", [0, 1, 6])
def test_full_forward_matches_cached_decode(attn_implementation, prefill_length):
    model = tiny_model(attn_implementation)
    tokens = random_tokens(batch_size=2)
    with torch.no_grad():
        full = model(tokens, use_cache=False).logits
        decoded = decode_logits(model, tokens, prefill_length)
    diff = max_diff(full, decoded)
    print(f"[{attn_implementation}, prefill {prefill_length}] full vs cached decode: max |diff| = {diff:.2e}")
    assert diff <= TOLERANCE


def test_sliding_cache_keeps_window_minus_one_tokens():
    model = tiny_model()
    cache = IQuestLoopCoderCache(model.config)
    with torch.no_grad():
        model(random_tokens(), cache=cache, use_cache=True)
    num_layers = model.config.num_hidden_layers
    assert cache.layers[0].keys.shape[-2] == SEQUENCE_LENGTH
    assert cache.layers[num_layers].keys.shape[-2] == LOOP_WINDOW_SIZE - 1
    assert cache.get_seq_length() == SEQUENCE_LENGTH


def test_sdpa_matches_eager():
    tokens = random_tokens(batch_size=2)
    with torch.no_grad():
        eager = tiny_model("eager")(tokens, use_cache=False).logits
        sdpa = tiny_model("sdpa")(tokens, use_cache=False).logits
    assert max_diff(eager, sdpa) <= TOLERANCE


# ---------------------------------------------------------------------------------------------------------------------
# 2. generate() greedy == argmax of the full forward at every step
# ---------------------------------------------------------------------------------------------------------------------


def test_generate_greedy_matches_full_forward_argmax():
    model = tiny_model()
    prompt = random_tokens(length=6)
    with torch.no_grad():
        output = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=8,
            return_dict_in_generate=True,
        )
        generated = output.sequences
        assert generated.shape[1] == prompt.shape[1] + 8
        # Decoding went through the loop cache, one token per step after the prompt.
        assert isinstance(output.cache, IQuestLoopCoderCache)
        assert output.cache.get_seq_length() == generated.shape[1] - 1
        for length in range(prompt.shape[1], generated.shape[1]):
            logits = model(generated[:, :length], use_cache=False).logits[:, -1]
            assert torch.equal(logits.argmax(-1), generated[:, length])


def test_generate_left_padded_batch_matches_unpadded():
    model = tiny_model()
    long_prompt, short_prompt = random_tokens(length=7, seed=2), random_tokens(length=4, seed=3)
    pad = model.config.pad_token_id
    batch = torch.cat([long_prompt, torch.cat([torch.full((1, 3), pad), short_prompt], dim=1)])
    attention_mask = torch.cat([torch.ones(1, 7), torch.cat([torch.zeros(1, 3), torch.ones(1, 4)], dim=1)]).long()
    options = dict(do_sample=False, max_new_tokens=8, pad_token_id=pad)
    with torch.no_grad():
        batched = model.generate(batch, attention_mask=attention_mask, **options)
        alone = [
            model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
            for prompt in (long_prompt, short_prompt)
        ]
    assert torch.equal(batched[0], alone[0][0])
    assert torch.equal(batched[1, 3:], alone[1][0])


# ---------------------------------------------------------------------------------------------------------------------
# 3. loop_num=1 is Llama
# ---------------------------------------------------------------------------------------------------------------------


def test_single_loop_equals_llama():
    model = tiny_model(loop_num=1)
    config = model.config
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
    ).eval()
    state = {name: tensor for name, tensor in model.state_dict().items() if "gate_projections" not in name}
    llama.load_state_dict(state, strict=True)
    tokens = random_tokens(batch_size=2)
    with torch.no_grad():
        diff = max_diff(model(tokens, use_cache=False).logits, llama(tokens, use_cache=False).logits)
    print(f"loop_num=1 vs LlamaForCausalLM: max |diff| = {diff:.2e}")
    assert diff <= TOLERANCE


# ---------------------------------------------------------------------------------------------------------------------
# 4. the math, against the independent oracle
# ---------------------------------------------------------------------------------------------------------------------


def test_full_forward_matches_oracle():
    model = tiny_model()
    tokens = random_tokens()
    weights = {name: tensor.double() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        logits = model(tokens, use_cache=False).logits[0]
        expected = oracle_logits(weights, model.config, tokens[0].tolist())
    diff = max_diff(logits, expected)
    print(f"full forward vs oracle: max |diff| = {diff:.2e}")
    assert diff <= TOLERANCE

    # The oracle has teeth: a window one token wider, or the gate at its zero init, is far off.
    with torch.no_grad():
        wider = tiny_model(loop_window_size=LOOP_WINDOW_SIZE + 1)(tokens, use_cache=False).logits[0]
        ungated = {name: (tensor.zero_() if "gate_projections" in name else tensor) for name, tensor in weights.items()}
        assert max_diff(wider, expected) > 1e-2
        assert max_diff(oracle_logits(ungated, model.config, tokens[0].tolist()), expected) > 1e-2


# ---------------------------------------------------------------------------------------------------------------------
# 5. save / load through the Auto classes with the official key names
# ---------------------------------------------------------------------------------------------------------------------


def test_save_and_auto_load_round_trip(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)

    with safe_open(tmp_path / "model.safetensors", "pt") as checkpoint:
        shapes = {key: checkpoint.get_slice(key).get_shape() for key in checkpoint.keys()}
    expected_keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(model.config.num_hidden_layers):
        expected_keys |= {f"model.layers.{i}.{norm}.weight" for norm in ("input_layernorm", "post_attention_layernorm")}
        expected_keys |= {f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected_keys |= {f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected_keys |= {f"model.gate_projections.{i}.weight", f"model.gate_projections.{i}.bias"}
    assert set(shapes) == expected_keys
    assert shapes["model.gate_projections.0.weight"] == [4, 16]  # [num_heads, head_dim]
    assert shapes["model.gate_projections.0.bias"] == [4]

    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["model_type"] == "iquestloopcoder"
    assert config_json["architectures"] == ["IQuestLoopCoderForCausalLM"]
    assert (config_json["rope_theta"], config_json["loop_num"], config_json["loop_window_size"]) == (10000.0, 2, 4)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is IQuestLoopCoderForCausalLM
    tokens = random_tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens, use_cache=False).logits, loaded(tokens, use_cache=False).logits)


# ---------------------------------------------------------------------------------------------------------------------
# 6. training: backward without a cache, gradients through loop 2's global attention
# ---------------------------------------------------------------------------------------------------------------------


def loss_and_grads(model, tokens, checkpointing_kwargs=None):
    model.train()
    if checkpointing_kwargs is not None:
        model.activation_checkpointing_enable(checkpointing_kwargs)
        assert all(layer.gradient_checkpointing for layer in model.model.layers)
    model.zero_grad()
    loss = model(tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_backward_reaches_every_parameter_and_matches_oracle():
    model = tiny_model()
    tokens = random_tokens()
    _, grads = loss_and_grads(model, tokens)
    for name, grad in grads.items():
        assert grad.abs().max() > 0, f"no gradient reaches {name}"

    # Oracle gradients (float64), with and without the loop-2 global path into loop-1 keys/values.
    def oracle_grads(detached):
        weights = {name: p.detach().double().requires_grad_() for name, p in model.named_parameters()}
        logits = oracle_logits(weights, model.config, tokens[0].tolist(), loop2_global_keys_detached=detached)
        loss = torch.nn.functional.cross_entropy(logits[:-1], tokens[0, 1:])
        loss.backward()
        return {name: w.grad for name, w in weights.items()}

    expected, without_global_path = oracle_grads(False), oracle_grads(True)
    worst = max(max_diff(grads[name], expected[name]) for name in grads)
    print(f"gradients vs oracle: max |diff| = {worst:.2e}")
    assert worst <= TOLERANCE
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert max_diff(grads[k_proj], without_global_path[k_proj]) > 1e-3


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_same_gradients(use_reentrant):
    # The official code cannot run this: its loop 2 reads loop-1 keys/values from a cache that checkpointing disables.
    tokens = random_tokens()
    loss, grads = loss_and_grads(tiny_model(), tokens)
    checkpointed_loss, checkpointed_grads = loss_and_grads(
        tiny_model(), tokens, checkpointing_kwargs={"use_reentrant": use_reentrant}
    )
    assert torch.equal(loss, checkpointed_loss)
    assert max(max_diff(grads[name], checkpointed_grads[name]) for name in grads) <= TOLERANCE


def test_loop_num_above_two_is_refused():
    with pytest.raises(ValueError, match="loop_num"):
        tiny_config(loop_num=3)
