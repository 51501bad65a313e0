"""Configuration of DeepSeek-V4.1 (`model_type="deepseek_v41"`), with the field names of transformers main.

The checkpoint's config.json is composite: `DeepseekV41Config` holds a `text_config` (`DeepseekV41TextConfig`,
`deepseek_v41_text`), a `vision_config` (`DeepseekV41VisionConfig`, `deepseek_v41_vision`) and `image_token_id`.
The text config describes the layer roles of CSA2 by lists of layer ids:

    compress_ratios            per layer: 0 = sliding window only, 1 = per-token latents, r > 1 = r tokens pooled
                               into one latent; DSpark draft layers (appended) are always 0
    kv_source_layer_ids        layers that own a compressor and publish compressed K/V and indexer keys; every
                               later layer with the same ratio reads them ("Reuse")
    index_source_layer_ids     layers that score the published keys and publish a top-k; a source that is not a
                               KV source re-scores with its own queries ("Reindex")
    candidate_source_layer_id  the index source whose top `candidate_topk_blocks` blocks of `candidate_block_size`
                               latents restrict every later index source (-1: no restriction)
    engram_layer_ids           layers with an Engram lookup before the block

Every value is checked when the config is made, before any model is built, and a bad one is refused with one
sentence that names the field. transformers gets these classes registered only when it has no `deepseek_v41`
of its own (5.25 has none; its main branch has one).
"""

from __future__ import annotations

import dataclasses

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

TRANSFORMERS_HAS_DEEPSEEK_V41 = "deepseek_v41" in CONFIG_MAPPING_NAMES

ENGRAM_SCALE_BLOCK = 32  # one FP8 scale per 32 channels of an Engram table row (the release's and the lookup's)
# transformers main's cache dispatch names: layers that publish compressed K/V, and every other layer
SLIDING, SHARED_COMPRESSED = "sliding_attention", "shared_compressed_attention"
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
# the YaRN keys DeepSeek's inference code reads (`factor`, `original_max_position_embeddings`, `beta_fast`,
# `beta_slow`) plus the bookkeeping transformers adds; any other key would be silently ignored
YARN_KEYS = {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "rope_theta", "partial_rotary_factor"}


def is_prime(number: int) -> bool:
    """Deterministic Miller-Rabin for the bucket sizes of the Engram hash (exact below 3.3e24)."""
    if number < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    if number in small:
        return True
    if any(number % p == 0 for p in small):
        return False
    odd_part, twos = number - 1, 0
    while odd_part % 2 == 0:
        odd_part, twos = odd_part // 2, twos + 1
    for base in small:
        x = pow(base, odd_part, number)
        if x in (1, number - 1):
            continue
        for _ in range(twos - 1):
            x = pow(x, 2, number)
            if x == number - 1:
                break
        else:
            return False
    return True


def engram_bucket_primes(config: "DeepseekV41TextConfig") -> list[list[list[int]]]:
    """The hash bucket sizes, [engram layer][n-gram size - 2][head]: distinct primes drawn in order above
    `engram_vocab_size - 1`, each used once, so every (layer, n-gram size, head) owns its own row range."""
    primes, used, candidate = [], set(), config.engram_vocab_size - 1
    for _ in config.engram_layer_ids:
        per_ngram = []
        for _ in range(config.engram_max_ngram_size - 1):
            heads, candidate = [], config.engram_vocab_size - 1
            for _ in range(config.engram_n_heads):
                candidate += 1
                while not is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                heads.append(candidate)
            per_ngram.append(heads)
        primes.append(per_ngram)
    return primes


def _refuse(config_name: str, field: str, value, reason: str):
    raise ValueError(f"{config_name}.{field} = {value!r}: {reason}")


def _check_int(config_name: str, config, field: str, minimum: int, reason: str, maximum: int | None = None):
    value = getattr(config, field)
    if isinstance(value, bool) or not isinstance(value, int):
        _refuse(config_name, field, value, f"must be an integer ({reason}).")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        _refuse(config_name, field, value, f"must be {bounds}: {reason}.")


def _check_float(config_name: str, config, field: str, reason: str, minimum: float = 0.0, inclusive: bool = False):
    value = getattr(config, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _refuse(config_name, field, value, f"must be a number ({reason}).")
    if value < minimum or (value == minimum and not inclusive):
        _refuse(config_name, field, value, f"must be {'>=' if inclusive else '>'} {minimum}: {reason}.")


def _check_layer_list(config_name: str, config, field: str, num_layers: int, reason: str) -> list[int]:
    value = getattr(config, field)
    if not isinstance(value, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        _refuse(config_name, field, value, f"must be a list of layer ids ({reason}).")
    if list(value) != sorted(set(value)):
        _refuse(config_name, field, value, f"must be strictly increasing layer ids ({reason}).")
    if any(not 0 <= i < num_layers for i in value):
        _refuse(config_name, field, value, f"every id must be in [0, {num_layers}) (the backbone layers): {reason}.")
    return list(value)


@strict
class DeepseekV41TextConfig(PretrainedConfig):
    """The text backbone of DeepSeek-V4.1. Defaults are the released V4.1-Flash values."""

    model_type = "deepseek_v41_text"
    base_config_key = "text_config"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_local_experts": "n_routed_experts", "intermediate_size": "moe_intermediate_size"}
    # transformers' RoPE validation iterates these entries of `rope_parameters`, not the layer types
    _rope_type_labels = ("main", "compress")

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1280
    qk_rope_head_dim: int = 64
    rope_theta: float | int = 10000.0
    compress_rope_theta: float | int = 160000.0
    rope_parameters: dict | None = None
    max_position_embeddings: int = 1048576
    attention_bias: bool = False
    attention_dropout: float | int = 0.0

    sliding_window: int = 128
    compress_ratios: list[int] | None = None
    kv_source_layer_ids: list[int] | None = None
    index_source_layer_ids: list[int] | None = None
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512

    o_groups: int = 8
    o_lora_rank: int = 1024

    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float | int = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float | int = 1.5
    topk_method: str = "noaux_tc"
    swiglu_limit: float | int = 10.0

    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6

    engram_layer_ids: list[int] | None = None
    engram_vocab_size: int = 16000000
    engram_num_embeddings: list[int] | None = None
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092

    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] | None = None
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3

    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rms_norm_eps: float = 1.0e-20
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 1

    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0

    # derived from `kv_source_layer_ids` (transformers main writes it to config.json; a given one must agree)
    layer_types: list[str] | None = None

    # the released schedule, used when `compress_ratios` / the source lists are not given
    default_compress_ratios = [0, 0] + [2] * 18 + [1] * 20
    default_kv_source_layer_ids = [2, 8, 14, 20]
    default_index_source_layer_ids = [2, 8, 14, 20, 24, 28, 32, 36]

    def __post_init__(self, **kwargs):
        PretrainedConfig.__post_init__(self, **kwargs)
        self._fill_defaults()
        self._check_scalars()
        self._check_layer_roles()
        self._check_engram()
        self._check_dspark()
        self._check_rope()

    # ---- defaults, as transformers main derives them ------------------------------------------------------
    def _fill_defaults(self):
        n = self.num_hidden_layers
        if self.compress_ratios is None and isinstance(n, int):
            if n == len(self.default_compress_ratios):
                self.compress_ratios = list(self.default_compress_ratios)
            else:  # the released pattern scaled to n layers: 2 sliding-only, a ratio-2 half, a ratio-1 half
                n_sliding = min(2, n)
                n_encoder = max(0, (n - n_sliding + 1) // 2)
                self.compress_ratios = [0] * n_sliding + [2] * n_encoder + [1] * max(0, n - n_sliding - n_encoder)
        if isinstance(self.compress_ratios, (list, tuple)) and isinstance(self.num_nextn_predict_layers, int):
            ratios = list(self.compress_ratios)
            if len(ratios) == n:  # the draft layers are sliding-only
                ratios += [0] * self.num_nextn_predict_layers
            self.compress_ratios = ratios
        backbone = list(self.compress_ratios or [])[:n] if isinstance(n, int) else []
        if self.kv_source_layer_ids is None:
            if backbone == self.default_compress_ratios[:n]:
                self.kv_source_layer_ids = list(self.default_kv_source_layer_ids)
            else:  # the first layer of each run of one ratio publishes for the run
                self.kv_source_layer_ids = [i for i, r in enumerate(backbone)
                                            if isinstance(r, int) and r > 0 and (i == 0 or backbone[i - 1] != r)]
        if self.index_source_layer_ids is None:
            self.index_source_layer_ids = (list(self.default_index_source_layer_ids)
                                           if self.kv_source_layer_ids == self.default_kv_source_layer_ids
                                           else list(self.kv_source_layer_ids))
        if self.candidate_source_layer_id is None:
            sources = self.kv_source_layer_ids
            self.candidate_source_layer_id = sources[-1] if isinstance(sources, list) and sources else -1
        if self.engram_layer_ids is None:
            self.engram_layer_ids = []
        if self.engram_num_embeddings is None and isinstance(self.engram_layer_ids, (list, tuple)):
            self.engram_num_embeddings = [sum(sum(heads) for heads in layer)
                                          for layer in engram_bucket_primes(self)] if self._engram_sizes_ok() else []
        if self.dspark_target_layer_ids is None and isinstance(n, int):
            kv_sources = self.kv_source_layer_ids if isinstance(self.kv_source_layer_ids, list) else []
            self.dspark_target_layer_ids = [i for i in range(n) if i not in kv_sources][-3:]

    def _engram_sizes_ok(self) -> bool:
        # the prime search needs sane sizes; they are checked (with reasons) right after
        return all(isinstance(getattr(self, f), int) and not isinstance(getattr(self, f), bool)
                   and getattr(self, f) >= 1 for f in ("engram_vocab_size", "engram_max_ngram_size", "engram_n_heads"))

    # ---- single values ----------------------------------------------------------------------------------------
    def _check_scalars(self):
        name = type(self).__name__
        for field, minimum, reason in (
            ("vocab_size", 1, "the embedding and head need at least one row"),
            ("hidden_size", 1, "the residual stream width"),
            ("num_hidden_layers", 1, "the backbone needs a layer"),
            ("num_attention_heads", 1, "query heads of every attention layer"),
            ("q_lora_rank", 1, "the rank of the low-rank query projection"),
            ("qk_rope_head_dim", 2, "RoPE rotates pairs of channels"),
            ("max_position_embeddings", 1, "the longest row the RoPE tables cover"),
            ("sliding_window", 1, "every layer attends at least to its own token"),
            ("candidate_topk_blocks", 1, "the candidate source keeps this many blocks"),
            ("candidate_block_size", 1, "latents per candidate block"),
            ("index_n_heads", 1, "indexer query heads"),
            ("index_topk", 1, "latents each query attends at an index source"),
            ("o_groups", 1, "groups of the grouped output projection wo_a"),
            ("o_lora_rank", 1, "per-group rank of the output projection"),
            ("moe_intermediate_size", 1, "expert hidden width"),
            ("n_routed_experts", 1, "the router picks among them"),
            ("hc_mult", 1, "the number of hyper-connection streams"),
            ("hc_sinkhorn_iters", 1, "DeepSeek's kernel runs at least one Sinkhorn normalisation"),
            ("num_nextn_predict_layers", 0, "the number of DSpark draft layers"),
        ):
            _check_int(name, self, field, minimum, reason)
        _check_int(name, self, "num_key_value_heads", 1, "V4.1 attention has one shared K = V latent head", 1)
        _check_int(name, self, "head_dim", self.qk_rope_head_dim,
                   "RoPE rotates the last qk_rope_head_dim channels of each head")
        _check_int(name, self, "index_head_dim", self.qk_rope_head_dim,
                   "RoPE rotates the last qk_rope_head_dim channels of each indexer head")
        _check_int(name, self, "num_experts_per_tok", 1, "top-k of the router", self.n_routed_experts)
        _check_int(name, self, "n_shared_experts", 1, "DeepSeek's MoE has exactly one shared expert", 1)
        if self.qk_rope_head_dim % 2:
            _refuse(name, "qk_rope_head_dim", self.qk_rope_head_dim, "RoPE rotates adjacent pairs, so it must be even.")
        if self.num_attention_heads % self.o_groups:
            _refuse(name, "o_groups", self.o_groups,
                    f"must divide num_attention_heads ({self.num_attention_heads}): wo_a projects whole head groups.")
        for field, reason in (("rope_theta", "the RoPE base of ratio-0 layers"),
                              ("compress_rope_theta", "the RoPE base of compressed layers"),
                              ("gate_temp", "router logits are divided by it"),
                              ("routed_scaling_factor", "the routed output is scaled by it"),
                              ("hc_eps", "the floor of the Sinkhorn normalisation and of `pre`"),
                              ("rms_norm_eps", "every RMSNorm adds it to the mean square")):
            _check_float(name, self, field, reason)
        _check_float(name, self, "swiglu_limit", "0 means no clamp, as in DeepSeek's inference code", inclusive=True)
        _check_float(name, self, "initializer_range", "the std of fresh weights", inclusive=True)
        _check_float(name, self, "router_aux_loss_coef", "a loss coefficient", inclusive=True)
        for field, allowed, reason in (
            ("scoring_func", SCORING_FUNCS, "the router scores of DeepSeek's inference code"),
            ("topk_method", ("noaux_tc",), "the bias steers expert selection only; no other method is defined"),
            ("hidden_act", ("silu",), "the experts are SwiGLU"),
            ("attention_bias", (False,), "the release's projections have no bias"),
            ("attention_dropout", (0, 0.0), "the reference implements no attention dropout"),
            ("router_jitter_noise", (0, 0.0), "the reference adds no router noise"),
            ("output_router_logits", (False,), "the reference returns no router logits"),
            ("tie_word_embeddings", (False,), "the release has a separate embedding and head"),
            ("norm_topk_prob", (True, False), "it switches the normalisation of the routing weights"),
        ):
            value = getattr(self, field)
            if isinstance(value, bool) != isinstance(allowed[0], bool) or value not in allowed:
                _refuse(name, field, value, f"must be one of {list(allowed)}: {reason}.")

    # ---- CSA2 layer roles -------------------------------------------------------------------------------------
    def _check_layer_roles(self):
        name, n, n_draft = type(self).__name__, self.num_hidden_layers, self.num_nextn_predict_layers
        ratios = self.compress_ratios
        if not isinstance(ratios, (list, tuple)) or any(isinstance(r, bool) or not isinstance(r, int) or r < 0
                                                        for r in ratios):
            _refuse(name, "compress_ratios", ratios, "must be a list of integers >= 0 (0 = sliding window only, "
                    "1 = per-token latents, r > 1 = r tokens pooled per latent).")
        if len(ratios) != n + n_draft:
            _refuse(name, "compress_ratios", ratios, f"needs one entry per layer: num_hidden_layers ({n}), optionally "
                    f"followed by num_nextn_predict_layers ({n_draft}) draft entries, got {len(ratios)}.")
        if any(ratios[n:]):
            _refuse(name, "compress_ratios", ratios, "the DSpark draft layers (the entries after num_hidden_layers) "
                    "attend a sliding window only, so their ratios must be 0.")
        backbone = ratios[:n]
        kv_sources = _check_layer_list(name, self, "kv_source_layer_ids", n, "layers that own a compressor")
        index_sources = _check_layer_list(name, self, "index_source_layer_ids", n, "layers that run the indexer")
        for i in kv_sources:
            if backbone[i] == 0:
                _refuse(name, "kv_source_layer_ids", kv_sources, f"layer {i} has compress_ratios[{i}] = 0, so it has "
                        "no compressed K/V to publish.")
            if i not in index_sources:
                _refuse(name, "index_source_layer_ids", index_sources, f"must contain KV source {i}: the top-k of an "
                        "earlier index source points into a different compressed K/V.")
        for i, ratio in enumerate(backbone):
            if ratio == 0:
                continue
            governing = [s for s in kv_sources if s <= i]
            if not governing:
                _refuse(name, "kv_source_layer_ids", kv_sources, f"layer {i} (compress ratio {ratio}) has no KV source "
                        "at or before it to read compressed K/V from.")
            if backbone[governing[-1]] != ratio:
                _refuse(name, "compress_ratios", ratios, f"layer {i} (ratio {ratio}) reads the compressed K/V of KV "
                        f"source {governing[-1]}, which pools at ratio {backbone[governing[-1]]}.")
        for i in index_sources:
            if backbone[i] == 0:
                _refuse(name, "index_source_layer_ids", index_sources, f"layer {i} has compress_ratios[{i}] = 0, so "
                        "it has no compressed K/V to index.")
        candidate = self.candidate_source_layer_id
        if isinstance(candidate, bool) or not isinstance(candidate, int):
            _refuse(name, "candidate_source_layer_id", candidate, "must be an integer layer id, or -1 for none.")
        if candidate >= 0:
            if candidate not in index_sources:
                _refuse(name, "candidate_source_layer_id", candidate, f"must be one of index_source_layer_ids "
                        f"{index_sources}: the candidate blocks come from an indexer's scores.")
            if any(s > candidate for s in kv_sources):
                _refuse(name, "candidate_source_layer_id", candidate, "no KV source may follow it: its candidate "
                        "blocks index its own compressed K/V, which the later index sources must score.")
            if (self.candidate_topk_blocks - 1) * self.candidate_block_size + 1 < self.index_topk:
                _refuse(name, "candidate_topk_blocks", self.candidate_topk_blocks, "(candidate_topk_blocks - 1) * "
                        "candidate_block_size + 1 must be >= index_topk, or a query can have fewer candidate latents "
                        "than its top-k, which DeepSeek's code then fills with non-candidates in no defined order.")
        elif candidate != -1:
            _refuse(name, "candidate_source_layer_id", candidate, "must be a layer id, or -1 for no candidate source.")
        expected_types = [SHARED_COMPRESSED if i in kv_sources else SLIDING for i in range(n)]
        if self.layer_types is not None and list(self.layer_types) != expected_types:
            _refuse(name, "layer_types", self.layer_types, f"must be {expected_types}: it is derived from "
                    "kv_source_layer_ids.")
        self.layer_types = expected_types

    # ---- Engram -----------------------------------------------------------------------------------------------
    def _check_engram(self):
        name, n = type(self).__name__, self.num_hidden_layers
        layers = _check_layer_list(name, self, "engram_layer_ids", n, "the layers with an Engram lookup")
        _check_int(name, self, "engram_vocab_size", 2, "the hash bucket primes are searched from it")
        _check_int(name, self, "engram_max_ngram_size", 2, "2-grams up to this size are hashed")
        _check_int(name, self, "engram_n_heads", 1, "hash heads per n-gram size")
        _check_int(name, self, "engram_head_dim", 32, "the width of a table row")
        if self.engram_head_dim % 32:
            _refuse(name, "engram_head_dim", self.engram_head_dim, "must be a multiple of 32: the tables carry one "
                    "FP8 scale per 32 channels.")
        _check_int(name, self, "engram_pad_id", 0, "the token that fills n-gram slots before the row start",
                   self.vocab_size - 1)
        _check_int(name, self, "engram_compressed_vocab_size", 1, "the size of the normalised vocabulary",
                   self.vocab_size)
        rows = self.engram_num_embeddings
        if not isinstance(rows, (list, tuple)) or len(rows) != len(layers) or any(
                isinstance(r, bool) or not isinstance(r, int) for r in rows):
            _refuse(name, "engram_num_embeddings", rows, f"needs one integer table size per engram layer "
                    f"({len(layers)}).")
        for layer, size, primes in zip(layers, rows, engram_bucket_primes(self)):
            needed = sum(sum(heads) for heads in primes)
            if size < needed:
                _refuse(name, "engram_num_embeddings", rows, f"the table of layer {layer} needs {needed} rows: its "
                        "hash ids reach the sum of its bucket primes.")

    # ---- DSpark -----------------------------------------------------------------------------------------------
    def _check_dspark(self):
        name, n = type(self).__name__, self.num_hidden_layers
        targets = _check_layer_list(name, self, "dspark_target_layer_ids", n,
                                    "the layers whose attention inputs feed the draft layers")
        if self.num_nextn_predict_layers == 0:
            return
        if not targets:
            _refuse(name, "dspark_target_layer_ids", targets, "DSpark draft layers need at least one target layer.")
        _check_int(name, self, "dspark_block_size", 1, "tokens drafted per block")
        _check_int(name, self, "dspark_noise_token_id", 0, "the token filling the draft block", self.vocab_size - 1)
        _check_int(name, self, "dspark_markov_rank", 1, "the width of the Markov head")
        _check_int(name, self, "dspark_n_routed_experts", 1, "experts of the draft layers' MoE")
        _check_int(name, self, "dspark_num_experts_per_tok", 1, "top-k of the draft layers' router",
                   self.dspark_n_routed_experts)

    # ---- RoPE -------------------------------------------------------------------------------------------------
    def _check_rope(self):
        """`rope_parameters` becomes {"main": ..., "compress": ...}: ratio-0 layers rotate with `rope_theta` and no
        scaling, compressed layers with `compress_rope_theta` and the checkpoint's YaRN (`rope_scaling`)."""
        name = type(self).__name__
        given = self.rope_parameters or {}
        partial = self.qk_rope_head_dim / self.head_dim
        if isinstance(given.get("main"), dict) and isinstance(given.get("compress"), dict):
            main, compress = dict(given["main"]), dict(given["compress"])
        else:
            yarn = {k: v for k, v in given.items() if k not in ("main", "compress")}
            main = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": partial}
            compress = {**yarn, "rope_theta": self.compress_rope_theta, "partial_rotary_factor": partial}
            compress.setdefault("rope_type", compress.pop("type", "default"))
            if compress["rope_type"] == "yarn":
                compress.setdefault("attention_factor", 1.0)
        if main.get("rope_type", "default") != "default":
            _refuse(name, "rope_parameters", given, "the main RoPE (ratio-0 layers) has no scaling in the release.")
        rope_type = compress.get("rope_type", "default")
        if rope_type not in ("default", "yarn"):
            _refuse(name, "rope_parameters", given, f"compressed layers use plain RoPE or YaRN, not {rope_type!r}.")
        unknown = set(compress) - YARN_KEYS
        if unknown:
            _refuse(name, "rope_parameters", given, f"keys {sorted(unknown)} are not read by DeepSeek's RoPE.")
        if rope_type == "yarn":
            for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
                if key not in compress:
                    compress[key] = {"original_max_position_embeddings": self.max_position_embeddings}.get(key)
                value = compress[key]
                if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    _refuse(name, "rope_parameters", given, f"YaRN needs a positive {key}, got {value!r}.")
            if compress.get("attention_factor", 1.0) != 1.0:
                _refuse(name, "rope_parameters", given, "attention_factor must be 1.0: DeepSeek's YaRN does not "
                        "scale cos/sin.")
        self.rope_parameters = {"main": main, "compress": compress}

    def validate_rope(self):
        # checked in _check_rope: transformers' validators do not know the nested main/compress form
        return None

    def validate_layer_type(self):
        # `layer_types` holds transformers main's two V4.1 names, checked in _check_layer_roles
        return None


@strict
class DeepseekV41VisionConfig(PretrainedConfig):
    """The vision tower's fields (the text model does not build it; the config parses so the checkpoint does)."""

    model_type = "deepseek_v41_vision"
    base_config_key = "vision_config"

    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    patch_size: int = 14
    downsample_ratio: int = 3
    rope_theta: float | int = 10000.0
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: int | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        name = type(self).__name__
        for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size",
                      "downsample_ratio", "max_image_tokens", "min_pixels"):
            _check_int(name, self, field, 1, "a size of the vision tower")
        _check_float(name, self, "rope_theta", "the base of the vision RoPE")
        if self.max_wh_ratio is not None:
            _check_int(name, self, "max_wh_ratio", 1, "the largest aspect ratio of an image, or None")


@strict
class DeepseekV41Config(PretrainedConfig):
    """The checkpoint's composite config: `text_config`, `vision_config`, `image_token_id`."""

    model_type = "deepseek_v41"
    sub_configs_defaults = {"text_config": DeepseekV41TextConfig, "vision_config": DeepseekV41VisionConfig}
    keys_to_ignore_at_inference = ["past_key_values"]

    text_config: dict | PretrainedConfig | None = None
    vision_config: dict | PretrainedConfig | None = None
    image_token_id: int = 129264
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if isinstance(self.text_config, dict):
            self.text_config = DeepseekV41TextConfig(**self.text_config)
        elif self.text_config is None:
            self.text_config = DeepseekV41TextConfig()
        if isinstance(self.vision_config, dict):
            self.vision_config = DeepseekV41VisionConfig(**self.vision_config)
        super().__post_init__(**kwargs)
        name = type(self).__name__
        if not isinstance(self.text_config, DeepseekV41TextConfig):
            _refuse(name, "text_config", type(self.text_config).__name__,
                    "must be a DeepseekV41TextConfig or its dict.")
        _check_int(name, self, "image_token_id", 0, "image spans carry this id",
                   self.text_config.vocab_size - 1)
        if self.tie_word_embeddings:
            _refuse(name, "tie_word_embeddings", True, "the release has a separate embedding and head.")


if not TRANSFORMERS_HAS_DEEPSEEK_V41:
    for _config_class in (DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig):
        AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)


# ---------------------------------------------------------------------------------------------------------------
# The Megatron translation
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeepseekV41Args:
    """What the Megatron modules read, flat. The MoE fields carry the names of DeepSeek-V4's `DeepseekV4Args`,
    whose router and experts V4.1 reuses; `text` is the validated text config (its RoPE and Engram hash
    parameters are read through it)."""

    text: DeepseekV41TextConfig
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    gate_temp: float
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    num_draft_layers: int
    draft_num_experts: int
    draft_num_experts_per_tok: int

    @classmethod
    def from_hf(cls, hf: DeepseekV41Config | DeepseekV41TextConfig) -> DeepseekV41Args:
        text = hf.get_text_config()
        return cls(
            text=text, vocab_size=text.vocab_size, hidden_size=text.hidden_size, num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads, head_dim=text.head_dim, q_lora_rank=text.q_lora_rank,
            o_groups=text.o_groups, o_lora_rank=text.o_lora_rank, sliding_window=text.sliding_window,
            index_n_heads=text.index_n_heads, index_head_dim=text.index_head_dim, index_topk=text.index_topk,
            hc_mult=text.hc_mult, hc_sinkhorn_iters=text.hc_sinkhorn_iters, hc_eps=text.hc_eps,
            num_experts=text.n_routed_experts, num_experts_per_tok=text.num_experts_per_tok,
            moe_intermediate_size=text.moe_intermediate_size, scoring_func=text.scoring_func,
            gate_temp=float(text.gate_temp), routed_scaling_factor=float(text.routed_scaling_factor),
            swiglu_limit=float(text.swiglu_limit), rms_norm_eps=text.rms_norm_eps,
            num_draft_layers=text.num_nextn_predict_layers, draft_num_experts=text.dspark_n_routed_experts,
            draft_num_experts_per_tok=text.dspark_num_experts_per_tok)

    def draft_moe(self) -> DeepseekV41Args:
        """The same fields with the DSpark layers' expert count and top-k (their MoE is smaller)."""
        return dataclasses.replace(self, num_experts=self.draft_num_experts,
                                   num_experts_per_tok=self.draft_num_experts_per_tok)


# what the Megatron model does not implement (the reference does): field -> (supported values, why)
MEGATRON_UNSUPPORTED = {
    "scoring_func": (("sqrtsoftplus", "sigmoid"), "the router scores DeepSeek-V4's router implements"),
    "norm_topk_prob": ((True,), "the routed weights are always normalised, as the release does"),
    "n_shared_experts": ((1,), "the release has exactly one shared expert"),
}


def check_supported(hf: DeepseekV41Config, where: str) -> None:
    """One ValueError naming the first text-config value the Megatron model does not implement."""
    text = hf.get_text_config()
    for field, (allowed, why) in MEGATRON_UNSUPPORTED.items():
        value = getattr(text, field)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise ValueError(f"{where}: text_config.{field} is {value!r}; the Megatron model supports "
                             f"{list(allowed)} ({why})")
    if text.num_attention_heads % text.o_groups:
        raise ValueError(f"{where}: text_config.num_attention_heads ({text.num_attention_heads}) must be a multiple "
                         f"of o_groups ({text.o_groups}): each output group projects whole heads")


def check_parallel(hf: DeepseekV41Config, tp: int, ep: int) -> None:
    """The V4.1-specific divisibility rules of a parallel layout, in one sentence."""
    text = hf.get_text_config()
    if text.o_groups % tp:
        raise ValueError(f"deepseek_v41: tensor parallel size {tp} must divide o_groups ({text.o_groups}): wo_a "
                         "is sharded by output group")
    experts = {"n_routed_experts": text.n_routed_experts}
    if text.num_nextn_predict_layers:
        experts["dspark_n_routed_experts"] = text.dspark_n_routed_experts
    for field, count in experts.items():
        if count % ep:
            raise ValueError(f"deepseek_v41: expert parallel size {ep} must divide {field} ({count})")


def transformer_config_fields(hf: DeepseekV41Config) -> dict:
    """Megatron TransformerConfig fields (sizes and flags the parallel layers read)."""
    from modelzoo.provider import SWIGLU_RMSNORM_FIELDS

    text = hf.get_text_config()
    return dict(
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size, ffn_hidden_size=text.moe_intermediate_size,
        num_attention_heads=text.num_attention_heads, kv_channels=text.head_dim,
        num_moe_experts=text.n_routed_experts, moe_router_topk=text.num_experts_per_tok,
        moe_ffn_hidden_size=text.moe_intermediate_size, layernorm_epsilon=text.rms_norm_eps,
        **SWIGLU_RMSNORM_FIELDS, gradient_accumulation_fusion=False, init_method_std=text.initializer_range,
        moe_token_dispatcher_type="alltoall")


__all__ = ["DeepseekV41Args", "DeepseekV41Config", "DeepseekV41TextConfig", "DeepseekV41VisionConfig",
           "TRANSFORMERS_HAS_DEEPSEEK_V41", "check_parallel", "check_supported", "transformer_config_fields"]
