"""DeepSeek-V4.1 training step on one GPU: our Megatron model against our reference (`DeepseekV41ForCausalLM`,
eager) in the same run.

    python benchmarks/bench_deepseek_v41.py [--config small|large] [--seq 4096] [--paths exact,fast]
                                            [--out FILE] [--steps 5] [--fake-quant]
    python benchmarks/bench_deepseek_v41.py --profile --paths exact   # top CUDA / CPU ops of that path instead
    python benchmarks/bench_deepseek_v41.py --device cpu --dtype float32 --seq 256 --steps 1 --warmup 0 \
        --paths exact --out /tmp/v41.json   # on the CPU: a check that it runs and the losses agree, not a timing

`--paths` are our provider's attention paths (`exact`, `fast`); `--paths ""` times the reference alone. The
reference has no activation recompute: it runs without one under any `--recompute`. `--fake-quant` rounds the
window K/V to FP8 and the compressed K/V and indexer queries and keys to FP4 in both models, as the release's
inference stores them.

`small`: hidden 1024, 6 layers (2 window-only, a ratio-2 KV source and a reuse, a ratio-1 KV and candidate source
and a re-index), 16 heads x 256, index 16 heads x 128, 16 experts top-4 of 1024, Engram at layers 1 and 2.
`large`, about 1B active parameters: hidden 2048, 16 heads x 512, q_lora_rank 1024, o_groups 8 x o_lora_rank
1024, index 32 heads x 128, 16 experts top-6 (+1 shared) of 1024, and the release's 40 layers of ratios and roles
scaled to 12 (release layers in brackets), Engram at layers 1 and 5 (1, 14):

    layer  0-1     2       3-4    5        6      7                   8      9        10     11
    ratio  0       2       2      2        2      1                   1      1        1      1
    role   window  KV src  reuse  KV src   reuse  KV + candidate src  reuse  reindex  reuse  reindex
           (0-1)   (2)            (8, 14)         (20)                       (24-36)

Both at the release's attention (window 128, index top-k 512, candidates: top 2048 blocks of 8 latents; compress
RoPE theta 160000 with YaRN factor 16), MoE scoring, hyper-connections (4 streams) and Engram (2- to 4-grams, 8
heads of 256 channels), with a vocabulary of 32000, hash tables of a few thousand rows per head (the release: 16M)
and no DSpark layers (frozen while the backbone trains: not in its step); bf16 (`--dtype`), forward + backward of
the mean token loss, batch 1 x `--seq`; peak memory is `max_memory_reserved` (what the allocator holds from the
GPU). Both models get the same random weights (our tiny checkpoint generator at this config, with a tokenizer.json
of the config's vocabulary for the Engram's normalised classes), so their losses agree. MFU counts the matmul
parameters a token goes through (attention projections, the active experts and the shared expert, the Engram's wkv
at its layers, the head) x 6, plus attention over the window and, on a layer of compress ratio r, the min(index
top-k, seq / r / 2) latents its queries select x 3 (forward + backward); compressor, indexer and hyper-connection
matmuls are left out, so it is a lower bound.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from bench_deepseek_v4 import (BATCH, RECOMPUTE, active_parameters as v4_active_parameters, our_model, print_results,
                               profile_our_model, step_arguments, timed_result, training_flops)
from harness import (check_recompute_layers, hf_step, matmul_peak_tflops, megatron_step, random_tokens,
                     recompute_settings, results_file, run_record, scratch_folder, write_run)

PATHS = ("exact", "fast")
RELEASE = dict(  # the release's values (DeepseekV41TextConfig's defaults) of what the configs keep
    sliding_window=128, index_topk=512, candidate_topk_blocks=2048, candidate_block_size=8, rope_theta=10000.0,
    compress_rope_theta=160000.0, max_position_embeddings=1048576, gate_temp=1.0, swiglu_limit=10.0,
    engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256,
)
# the compressed layers' RoPE scaling in the release's config.json
RELEASE_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32,
                "beta_slow": 1}
# below the release in both configs: the vocabulary, the hash tables' rows (16M a head there), no DSpark layers
SCALED_DOWN = dict(vocab_size=32000, engram_vocab_size=4096, num_nextn_predict_layers=0, dspark_target_layer_ids=[])
CONFIGS = {
    "small": dict(
        hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, head_dim=256, qk_rope_head_dim=64,
        q_lora_rank=512, o_groups=8, o_lora_rank=256, compress_ratios=[0, 0, 2, 2, 1, 1], kv_source_layer_ids=[2, 4],
        index_source_layer_ids=[2, 4, 5], candidate_source_layer_id=4, index_n_heads=16, index_head_dim=128,
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=1024, engram_layer_ids=[1, 2]),
    "large": dict(
        hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, head_dim=512, qk_rope_head_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, compress_ratios=[0, 0] + [2] * 5 + [1] * 5,
        kv_source_layer_ids=[2, 5, 7], index_source_layer_ids=[2, 5, 7, 9, 11], candidate_source_layer_id=7,
        index_n_heads=32, index_head_dim=128, n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=1024,
        engram_layer_ids=[1, 5]),
}


def model_config(name: str, seq: int) -> dict:
    """The checkpoint config of `--config` `name`: the tiny checkpoint's with these text fields, the Engram classes
    of the generator's tokenizer at this vocabulary, tables just large enough for the hash ids (the sums of their
    bucket primes), and positions for a row of `seq` tokens (the release's 1M, or `seq` where longer)."""
    from modelzoo.deepseek_v41.config import DeepseekV41TextConfig
    from tiny_checkpoints.deepseek_v41_tiny import DEEPSEEK_V41_TINY, DEEPSEEK_V41_TINY_TEXT, engram_classes

    text = {**DEEPSEEK_V41_TINY_TEXT, **RELEASE, "rope_scaling": RELEASE_YARN, **SCALED_DOWN, **CONFIGS[name],
            "engram_num_embeddings": None}  # the config's default: the sums of the bucket primes
    text["engram_compressed_vocab_size"] = engram_classes(text["vocab_size"])
    text["max_position_embeddings"] = max(text["max_position_embeddings"], seq)
    text["engram_num_embeddings"] = DeepseekV41TextConfig(**text).engram_num_embeddings
    return {**DEEPSEEK_V41_TINY, "text_config": text}


def active_parameters(text: dict) -> float:
    """Matmul parameters a token goes through: attention projections, active + shared experts and the head (as in
    DeepSeek-V4), and the Engram's wkv (the looked-up rows to the keys and the value) at its layers."""
    looked_up = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"] * text["engram_head_dim"]  # channels
    engram_wkv = looked_up * text["hidden_size"] * (text["hc_mult"] + 1)
    return v4_active_parameters(text) + len(text["engram_layer_ids"]) * engram_wkv


def step_flops(text: dict, seq: int) -> float:
    """A training step's FLOPs: a query attends its window and, at a compress ratio r, the latents it selects."""
    window = min(text["sliding_window"], seq / 2)
    entries = sum(window + (min(text["index_topk"], seq / ratio / 2) if ratio else 0)  # mean over positions
                  for ratio in text["compress_ratios"][:text["num_hidden_layers"]])
    return training_flops(text, seq, active_parameters(text), entries)


def our_step(folder: Path, ids: torch.Tensor, path: str, recompute: dict, dtype: torch.dtype, fake_quant: bool):
    """The training step of our model on attention path `path` (inside runtime.parallel)."""
    return megatron_step(*our_model(folder, path, recompute, dtype, fake_quant=fake_quant), ids)


def main() -> None:
    parser = step_arguments(CONFIGS, "deepseek_v41", "the reference")
    parser.add_argument("--paths", default="exact,fast", type=lambda names: list(filter(None, names.split(","))),
                        help=f"our attention paths to time, comma-separated: {PATHS}")
    parser.add_argument("--fake-quant", action="store_true",
                        help="both models round the K/V and the indexer's queries and keys as the release stores them")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: hide the GPUs and run both models on the CPU (a check, not a timing; give --out)")
    args = parser.parse_args()
    check_recompute_layers(parser, args)
    if unknown := set(args.paths) - set(PATHS):
        parser.error(f"--paths: unknown {sorted(unknown)}; the paths are {PATHS}")
    if args.profile and not args.paths:
        parser.error("--profile profiles our model on the first of --paths: name one")
    if args.device == "cpu":
        if args.out is None:
            parser.error("--device cpu needs --out: the default result file is named after the GPU")
        if args.profile:
            parser.error("--profile profiles the GPU's kernels: not with --device cpu")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks for a GPU: runtime builds our model on the CPU
    elif not torch.cuda.is_available():
        parser.error("no GPU here: run with --device cpu")
    with scratch_folder("deepseek-v41-bench") as folder:
        run(args, folder)


def run(args, folder: Path) -> None:
    """Write the random checkpoint of `args.config` to `folder`, then time (or profile) the models on it."""
    from modelzoo import runtime
    from modelzoo.parity import load_hf_model
    from modelzoo.registry import build_provider
    from tiny_checkpoints.deepseek_v41_tiny import write_deepseek_v41_tiny

    config = model_config(args.config, args.seq)
    text = config["text_config"]
    write_deepseek_v41_tiny(folder, config)
    ids = random_tokens(text["vocab_size"], (BATCH, args.seq))
    dtype = getattr(torch, args.dtype)
    recompute, setting = recompute_settings(RECOMPUTE, args.recompute, args.recompute_layers)
    if args.profile:
        profile_our_model(lambda: our_step(folder, ids, args.paths[0], recompute, dtype, args.fake_quant),
                          args.profile_steps, args.warmup)
        return
    peak = matmul_peak_tflops() if torch.cuda.is_available() else None
    flops = step_flops(text, args.seq)
    results = []

    def record(name, step):
        results.append(timed_result(name, step, flops, peak, BATCH * args.seq, args.steps, args.warmup))

    if not args.no_hf:
        provider = build_provider(folder, params_dtype=dtype, fake_quant=args.fake_quant)
        reference = load_hf_model(folder, dtype, provider).to(runtime.device())
        record("reference DeepseekV41 (eager)", hf_step(reference, ids, **provider.oracle_forward_kwargs()))
        del reference
    with runtime.parallel(tp=1):
        for path in args.paths:
            record(f"megatron deepseek_v41 ({path}, recompute {setting})",
                   our_step(folder, ids, path, recompute, dtype, args.fake_quant))

    print_results(results, args.config, active_parameters(text), peak, args.seq, with_hf=not args.no_hf)
    suffix = "" if setting == "none" else f"_{setting}_recompute"
    write_run(args.out or results_file(f"deepseek_v41_{args.config}_seq{args.seq}{suffix}"),
              {**run_record("bench_deepseek_v41.py"), "peak_tflops": peak, "config_name": args.config, "seq": args.seq,
               "recompute": setting, "dtype": args.dtype, "fake_quant": args.fake_quant, "config": config,
               "results": results})


if __name__ == "__main__":
    main()
