"""Training-step throughput of the dense models on one GPU, measured side by side in one run.

    python benchmarks/bench_dense.py [--out FILE] [--steps 10]     # FILE: benchmarks/results/dense_<gpu>.json

Models (bf16, forward + backward of the mean token loss, batch 2 x 4096, the Llama config of the
performance issue: hidden 2048, 16 layers, 16 / 4 heads, intermediate 5632):
  hf-llama-sdpa        transformers LlamaForCausalLM, SDPA attention (the baseline)
  megatron-llama-fast  our Llama provider (Megatron GPTModel) with attention="fast"
  megatron-loopcoder   our LoopCoder provider, loop_num 2, window 64, attention="fast"
  hf-loopcoder         our HF LoopCoder reference (sdpa), use_cache=False
MFU is against a bf16 matmul peak measured in the same run. FLOPs count every matmul the model runs
(6 x parameters-in-matmuls per token, both loops for LoopCoder) plus attention over the entries
actually attended (causal: s(s+1)/2 pairs; window W: about s*W pairs), x3 for forward + backward.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

VOCAB = 32000
LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 128, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
LOOPCODER = {**LLAMA, "model_type": "iquestloopcoder", "architectures": ["IQuestLoopCoderForCausalLM"],
             "loop_num": 2, "loop_window_size": 64}
BATCH, SEQ = 2, 4096
RESULTS = Path(__file__).resolve().parent / "results"


def results_file(name: str) -> str:
    """benchmarks/results/<name>_<gpu>.json, e.g. dense_h200.json: one file per benchmark, config and GPU."""
    gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ").split()[0].lower()
    return str(RESULTS / f"{name}_{gpu}.json")


def matmul_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def step_flops(config: dict, loops: int) -> float:
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    layer_matmul_params = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    tokens = BATCH * SEQ
    dense = 6 * tokens * (loops * layers * layer_matmul_params + hidden * config["vocab_size"])
    causal_pairs = SEQ * (SEQ + 1) / 2
    pairs_per_layer = causal_pairs if loops == 1 else 2 * causal_pairs + SEQ * config["loop_window_size"]
    attention = 3 * 4 * BATCH * heads * head_dim * layers * pairs_per_layer  # QK^T and PV, fwd + bwd
    return dense + attention


def time_steps(step, steps: int) -> tuple[float, float]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    # reserved, not allocated: what the caching allocator holds from the GPU (CUDA graph pools included)
    return (time.perf_counter() - start) / steps, torch.cuda.max_memory_reserved() / 2**30


def hf_step(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()
    return step


def megatron_step(provider, model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        loss = -provider.token_logprobs(model, ids).mean()
        loss.backward()
        return loss.detach()
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="default: benchmarks/results/dense_<gpu>.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from modelzoo import build_provider, runtime
    from modelzoo.loopcoder import IQuestLoopCoderConfig, IQuestLoopCoderForCausalLM

    peak = matmul_peak_tflops()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
    results = []

    def record(name, config, loops, step_fn):
        seconds, memory = time_steps(step_fn, args.steps)
        tflops = step_flops(config, loops) / seconds / 1e12
        results.append({"model": name, "ms_per_step": 1e3 * seconds, "tokens_per_s": BATCH * SEQ / seconds,
                        "tflops": tflops, "mfu": tflops / peak, "peak_memory_gib": memory})
        torch.cuda.empty_cache()

    def wanted(name):
        return args.only is None or name in args.only

    for name, model_class, config_class, config, loops in (
        ("hf-llama-sdpa", LlamaForCausalLM, LlamaConfig, LLAMA, 1),
        ("hf-loopcoder", IQuestLoopCoderForCausalLM, IQuestLoopCoderConfig, LOOPCODER, 2),
    ):
        if not wanted(name):
            continue
        with torch.device("cuda"):
            model = model_class._from_config(config_class.from_dict(config), attn_implementation="sdpa",
                                             dtype=torch.bfloat16)
        record(name, config, loops, hf_step(model, ids))
        del model
    with runtime.parallel(tp=1):
        for name, config, loops in (("megatron-llama-fast", LLAMA, 1), ("megatron-loopcoder", LOOPCODER, 2)):
            if not wanted(name):
                continue
            provider = build_provider(config, params_dtype=torch.bfloat16, attention="fast")
            model = provider.provide()
            record(name, config, loops, megatron_step(provider, model, ids))
            del model

    baseline = next((r for r in results if r["model"] == "hf-llama-sdpa"), None)
    print(f"bf16 matmul peak measured: {peak:.0f} TFLOP/s; batch {BATCH} x {SEQ}")
    print(f"{'model':<22}{'ms/step':>9}{'tok/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'mem GiB':>9}{'tok/s vs HF':>13}{'mem vs HF':>11}")
    for r in results:
        ratio = r["tokens_per_s"] / baseline["tokens_per_s"] if baseline else float("nan")
        memory_ratio = r["peak_memory_gib"] / baseline["peak_memory_gib"] if baseline else float("nan")
        r.update(tokens_per_s_vs_hf_llama=ratio, memory_vs_hf_llama=memory_ratio)
        print(f"{r['model']:<22}{r['ms_per_step']:>9.1f}{r['tokens_per_s']:>10.0f}{r['tflops']:>9.0f}"
              f"{r['mfu']:>7.1%}{r['peak_memory_gib']:>9.1f}{ratio:>13.2f}{memory_ratio:>11.2f}")
    with open(args.out or results_file("dense"), "w") as handle:
        json.dump({"peak_tflops": peak, "batch": BATCH, "seq": SEQ, "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
