"""Training-step throughput of the dense models on one GPU, measured side by side in one run.

    python benchmarks/bench_dense.py [--out FILE] [--steps 10]     # FILE: benchmarks/results/dense_<gpu>.json
    python benchmarks/bench_dense.py --batch 1 --seq 131072 --recompute full --only megatron-loopcoder --steps 1

Models (bf16, forward + backward of the mean token loss, batch 2 x 4096 unless `--batch` / `--seq` say
otherwise, the Llama config of the performance issue: hidden 2048, 16 layers, 16 / 4 heads, intermediate 5632):
  hf-llama-sdpa        transformers LlamaForCausalLM, SDPA attention (the baseline)
  megatron-llama-fast  our Llama provider (Megatron GPTModel) with attention="fast"
  megatron-loopcoder   our LoopCoder provider, loop_num 2, window 64, attention="fast"
  hf-loopcoder         our HF LoopCoder reference (sdpa), use_cache=False
MFU is against a bf16 matmul peak measured in the same run. FLOPs count every matmul the model runs
(6 x parameters-in-matmuls per token, both loops for LoopCoder) plus attention over the entries
actually attended (causal: s(s+1)/2 pairs; window W: about s*W pairs), x3 for forward + backward; recomputed
work is not counted. `--recompute`: Megatron's `selective` (core attention), `selective-mlp` (the MLP) or `full`
(every layer) for our models, transformers' gradient checkpointing (its only kind) for `full` on theirs;
`--recompute full --recompute-layers N` recomputes only the first N layers (Megatron's `recompute_method="block"`,
ours alone). A model that runs out of GPU memory is recorded as such and the run goes on.
"""

from __future__ import annotations

import argparse

import torch
from harness import (check_recompute_layers, hf_step, matmul_peak_tflops, megatron_step, random_tokens,
                     recompute_settings, results_file, run_record, time_steps, write_run)

VOCAB = 32000
LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 128, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
LOOPCODER = {**LLAMA, "model_type": "iquestloopcoder", "architectures": ["IQuestLoopCoderForCausalLM"],
             "loop_num": 2, "loop_window_size": 64}
RECOMPUTE = {  # --recompute: Megatron's TransformerConfig settings
    "none": {},
    "selective": dict(recompute_granularity="selective"),                                     # core_attn
    "selective-mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def step_flops(config: dict, loops: int, batch: int, seq: int) -> float:
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    layer_matmul_params = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    tokens = batch * seq
    dense = 6 * tokens * (loops * layers * layer_matmul_params + hidden * config["vocab_size"])
    causal_pairs = seq * (seq + 1) / 2
    pairs_per_layer = causal_pairs if loops == 1 else 2 * causal_pairs + seq * config["loop_window_size"]
    attention = 3 * 4 * batch * heads * head_dim * layers * pairs_per_layer  # QK^T and PV, fwd + bwd
    return dense + attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="default: benchmarks/results/dense_<gpu>.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--recompute", choices=sorted(RECOMPUTE), default="none")
    parser.add_argument("--recompute-layers", type=int, default=None,
                        help="with --recompute full: only the first N layers (recompute_method='block'); "
                             "transformers' models are skipped")
    args = parser.parse_args()
    batch, seq = args.batch, args.seq
    check_recompute_layers(parser, args)
    recompute, setting = recompute_settings(RECOMPUTE, args.recompute, args.recompute_layers)
    default_shape = (batch, seq, setting) == (2, 4096, "none")
    result_name = "dense" if default_shape else f"dense_b{batch}_seq{seq}_recompute_{setting}"

    from transformers import LlamaConfig, LlamaForCausalLM

    from modelzoo import build_provider, runtime
    from modelzoo.loopcoder import IQuestLoopCoderConfig, IQuestLoopCoderForCausalLM

    positions = {"max_position_embeddings": max(LLAMA["max_position_embeddings"], seq)}  # RoPE covers the row
    llama, loopcoder = {**LLAMA, **positions}, {**LOOPCODER, **positions}
    peak = matmul_peak_tflops()
    ids = random_tokens(VOCAB, (batch, seq))
    results = []

    def record(name, config, loops, step_fn):
        try:
            seconds, memory = time_steps(step_fn, args.steps, args.warmup)
        except torch.cuda.OutOfMemoryError:
            results.append({"model": name, "out_of_memory": True,
                            "peak_memory_gib": torch.cuda.max_memory_reserved() / 2**30})
            return
        finally:
            torch.cuda.empty_cache()
        tflops = step_flops(config, loops, batch, seq) / seconds / 1e12
        results.append({"model": name, "ms_per_step": 1e3 * seconds, "tokens_per_s": batch * seq / seconds,
                        "tflops": tflops, "mfu": tflops / peak, "peak_memory_gib": memory})

    def wanted(name):
        return args.only is None or name in args.only

    for name, model_class, config_class, config, loops in (
        ("hf-llama-sdpa", LlamaForCausalLM, LlamaConfig, llama, 1),
        ("hf-loopcoder", IQuestLoopCoderForCausalLM, IQuestLoopCoderConfig, loopcoder, 2),
    ):
        if not wanted(name):
            continue
        with torch.device("cuda"):
            model = model_class._from_config(config_class.from_dict(config), attn_implementation="sdpa",
                                             dtype=torch.bfloat16)
        if args.recompute == "full":
            model.gradient_checkpointing_enable()
            model.train()  # transformers checkpoints only in training mode
        if args.recompute in ("none", "full") and args.recompute_layers is None:  # transformers: all or none
            record(name, config, loops, hf_step(model, ids))
        del model
    with runtime.parallel(tp=1):
        for name, config, loops in (("megatron-llama-fast", llama, 1), ("megatron-loopcoder", loopcoder, 2)):
            if not wanted(name):
                continue
            provider = build_provider(config, params_dtype=torch.bfloat16, attention="fast", **recompute)
            model = provider.provide()
            record(name, config, loops, megatron_step(provider, model, ids))
            del model

    baseline = next((r for r in results if r["model"] == "hf-llama-sdpa" and "tokens_per_s" in r), None)
    print(f"bf16 matmul peak measured: {peak:.0f} TFLOP/s; batch {batch} x {seq}; recompute {setting}")
    print(f"{'model':<22}{'ms/step':>9}{'tok/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'mem GiB':>9}{'tok/s vs HF':>13}{'mem vs HF':>11}")
    for r in results:
        if r.get("out_of_memory"):
            print(f"{r['model']:<22} out of memory ({r['peak_memory_gib']:.1f} GiB reserved at the peak)")
            continue
        ratio = r["tokens_per_s"] / baseline["tokens_per_s"] if baseline else float("nan")
        memory_ratio = r["peak_memory_gib"] / baseline["peak_memory_gib"] if baseline else float("nan")
        r.update(tokens_per_s_vs_hf_llama=ratio, memory_vs_hf_llama=memory_ratio)
        print(f"{r['model']:<22}{r['ms_per_step']:>9.1f}{r['tokens_per_s']:>10.0f}{r['tflops']:>9.0f}"
              f"{r['mfu']:>7.1%}{r['peak_memory_gib']:>9.1f}{ratio:>13.2f}{memory_ratio:>11.2f}")
    write_run(args.out or results_file(result_name), {**run_record("bench_dense.py"), "peak_tflops": peak,
                                                      "batch": batch, "seq": seq, "recompute": setting,
                                                      "results": results})


if __name__ == "__main__":
    main()
