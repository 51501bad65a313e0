"""DeepSeek-V4 training step on one GPU: our Megatron model against transformers' eager implementation.

    python benchmarks/bench_deepseek_v4.py [--config small|large] [--seq 4096] [--paths exact,fast]
                                           [--out FILE] [--steps 5]
    python benchmarks/bench_deepseek_v4.py --profile --paths fast   # top CUDA / CPU ops of that path instead

`--paths fast+graphs` times the fast path with the decoder layers replayed as CUDA graphs
(`DeepseekV4Model.capture_cuda_graphs`; the capture is part of the first step); `--paths ""` times transformers'
model alone. `--recompute full` also turns on transformers' gradient checkpointing (its only kind of recompute).

`small`, the config of the performance issue: hidden 1024, 6 layers (2 sliding, 2 CSA, 2 HCA), 16 heads x
256, 16 experts top-4, hc_mult 4. `large`, about 1B active parameters: hidden 2048, 12 layers, 16 heads x
512, 16 experts top-6 (+1 shared) of 1024. Both at release attention ratios (window 128, compress ratios
4 / 128, index top-k 512); bf16, forward + backward of the mean token loss, batch 1 x `--seq`; peak memory is
`max_memory_reserved` (what the allocator holds from the GPU). Both models
get the same random weights (our tiny checkpoint generator at this config). MFU counts the matmul
parameters a token goes through (attention projections, the active experts and the shared expert, the
head) x 6, plus attention over the window and the visible compressed entries x 3 (forward + backward);
compressor, indexer and hyper-connection matmuls are left out, so it is a lower bound.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from harness import (check_recompute_layers, hf_step, matmul_peak_tflops, megatron_step, random_tokens,
                     recompute_settings, results_file, run_record, scratch_folder, time_steps, write_run)

BATCH = 1
RELEASE_ATTENTION = dict(
    sliding_window=128, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    index_topk=512, max_position_embeddings=65536, num_nextn_predict_layers=0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1},
)
CONFIGS = {
    "small": dict(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, head_dim=256,
        partial_rotary_factor=0.25, q_lora_rank=512, o_groups=8, o_lora_rank=256,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * 2,
        index_n_heads=16, index_head_dim=128, n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=1024, mlp_layer_types=["hash_moe"] + ["moe"] * 5, **RELEASE_ATTENTION),
    "large": dict(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, head_dim=512,
        partial_rotary_factor=0.125, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * 4,
        index_n_heads=32, index_head_dim=128, n_routed_experts=16, num_experts_per_tok=6,
        moe_intermediate_size=1024, mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 10, **RELEASE_ATTENTION),
}


def model_config(name: str, seq: int) -> dict:
    """`--config` `name` over the tiny checkpoint's fields, with positions for a row of `seq` tokens: the release
    attention's 65536, or `seq` where longer (the model refuses a row past its positions; RoPE costs the same)."""
    from tiny_checkpoints.deepseek_v4_tiny import DEEPSEEK_V4_TINY

    config = {**DEEPSEEK_V4_TINY, **CONFIGS[name]}
    return {**config, "max_position_embeddings": max(config["max_position_embeddings"], seq)}


def active_parameters(c: dict) -> float:
    """Matmul parameters a token goes through: attention projections, active + shared experts, the head."""
    hidden, heads, head_dim, layers = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["num_hidden_layers"]
    attention_params = (hidden * c["q_lora_rank"] + c["q_lora_rank"] * heads * head_dim + hidden * head_dim
                        + heads * head_dim * c["o_lora_rank"] + c["o_groups"] * c["o_lora_rank"] * hidden)
    expert_params = 3 * hidden * c["moe_intermediate_size"] * (c["num_experts_per_tok"] + 1)  # + shared expert
    return layers * (attention_params + expert_params) + hidden * c["vocab_size"]


def step_flops(c: dict, seq: int) -> float:
    entries = 0.0  # attended keys per query, summed over layers (mean over positions)
    for kind in c["layer_types"]:
        window = min(c["sliding_window"], seq / 2)
        if kind == "compressed_sparse_attention":
            entries += window + min(c["index_topk"], seq / c["compress_rates"][kind] / 2)
        elif kind == "heavily_compressed_attention":
            entries += window + seq / c["compress_rates"][kind] / 2
        else:
            entries += window
    return training_flops(c, seq, active_parameters(c), entries)


def training_flops(c: dict, seq: int, parameters: float, entries: float) -> float:
    """FLOPs of a training step (forward + backward: 3 x the forward's) on `BATCH` rows of `seq` tokens: 2 per matmul
    parameter and token, and 2 x 2 per query head channel and attended key (QK^T, PV); `entries`: the keys a query
    attends, summed over the layers."""
    tokens = BATCH * seq
    return 6 * tokens * parameters + 3 * 4 * tokens * c["num_attention_heads"] * c["head_dim"] * entries


RECOMPUTE = {  # --recompute: Megatron's TransformerConfig settings
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "moe"]),
    "selective-attention": dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm"]),
    "selective-moe": dict(recompute_granularity="selective", recompute_modules=["moe", "layernorm"]),
}


def our_model(folder: Path, attention: str, recompute: dict | None = None, dtype: torch.dtype = torch.bfloat16,
              **options):
    """(provider, model) of our model of the checkpoint in `folder` (DeepSeek-V4 here) in `dtype` with its weights
    (inside runtime.parallel); `recompute`: Megatron's recompute settings (`recompute_settings`); `options`: more
    `build_provider` keywords of the architecture."""
    from modelzoo.registry import build_provider

    provider = build_provider(folder, params_dtype=dtype, attention=attention, perform_initialization=False,
                              **(recompute or {}), **options)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    return provider, model


def our_step(folder: Path, ids: torch.Tensor, path: str, recompute: dict | None = None):
    """(model, training step) of one `--paths` entry: an attention path, then options joined by "+": "graphs" to
    capture the decoder layers' CUDA graphs in the first step, "dense-csa" to run the CSA layers' attention as the
    dense blocks of window_attention.py instead of the kernels over each query's picks (the kernels' baseline),
    "keep-attention" to keep the attention's output across a full recompute (`keep_attention_output`)."""
    from modelzoo.deepseek_v4.model import window_attention

    attention, *options = path.split("+")
    if unknown := set(options) - {"graphs", "dense-csa", "keep-attention"}:
        raise SystemExit(f"bench_deepseek_v4: unknown option(s) {sorted(unknown)} in --paths entry {path!r}")
    if "keep-attention" in options:
        recompute = {**(recompute or {}), "keep_attention_output": True}
    provider, model = our_model(folder, attention, recompute)
    step = megatron_step(provider, model, ids)
    if "graphs" in options:
        plain_step = step

        def step():  # the capture is part of the first step
            if model.layer_graphs is None:
                model.capture_cuda_graphs(ids)
            return plain_step()
    if "dense-csa" in options:
        kernels_step = step

        def step():
            with mock.patch.object(window_attention, "_sparse_kernels", lambda q, kv: None):
                return kernels_step()
    return model, step


def profile_our_model(make_step, steps: int, warmup: int = 3) -> None:
    """Profile `steps` training steps of our model after 1 + `warmup` untimed ones and print the top ops;
    `make_step()` builds the model and returns its step (inside runtime.parallel)."""
    from torch.profiler import ProfilerActivity, profile

    from modelzoo import runtime

    with runtime.parallel(tp=1):
        step = make_step()
        for _ in range(1 + warmup):
            step()
        torch.cuda.synchronize()
        # verbose=True: without it torch 2.11's profiler records no Python frames for group_by_stack_n
        stacks = torch._C._profiler._ExperimentalConfig(verbose=True)
        # several steps back to back, as in training: the host prepares a step while the GPU runs the last
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                     experimental_config=stacks, record_shapes=True) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    print_gpu_idle(prof)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=40,
                                                             max_name_column_width=40, max_shapes_column_width=80))
    # which source lines own the GPU time (eager paths; a replayed graph is one opaque entry)
    print(prof.key_averages(group_by_stack_n=4).table(sort_by="self_cuda_time_total", row_limit=60,
                                                      max_name_column_width=40, max_src_column_width=90))


def print_gpu_idle(prof, gaps: int = 15) -> None:
    """GPU busy time against the profiled span, and the longest gaps between kernels (with their neighbours).

    The tables sum kernel times; a graphed or host-bound step also has time where no kernel runs.
    """
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    busy, end, previous, idle = 0.0, kernels[0][0], kernels[0][2], []
    for start, stop, name in kernels:
        if start > end:
            idle.append((start - end, previous, name))
        busy += max(0.0, stop - max(start, end))
        if stop >= end:
            end, previous = stop, name
    span = end - kernels[0][0]
    print(f"GPU: {len(kernels)} kernels, busy {busy / 1e3:.1f} ms of a {span / 1e3:.1f} ms span, "
          f"idle {(span - busy) / 1e3:.1f} ms in {len(idle)} gaps")
    for gap, before, after in sorted(idle, reverse=True)[:gaps]:
        print(f"  {gap:8.1f} us  after {before[:70]}  before {after[:70]}")


def timed_result(name: str, step, flops: float, peak: float | None, tokens: int, steps: int, warmup: int) -> dict:
    """The figures of `name`'s training `step` (flops each; `peak`: the matmul TFLOP/s of the GPU, None without
    one): its first step apart (its loss is the check that the models compute the same thing: same weights, same
    tokens), then `steps` timed ones after `warmup`. Running out of GPU memory is a figure in itself (the Hugging
    Face model's eager attention at long rows)."""
    started = time.perf_counter()
    try:
        loss = float(step())
        first_step = time.perf_counter() - started  # includes compiling, for the fused paths
        seconds, memory = time_steps(step, steps, warmup)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"model": name, "out_of_memory": True,
                "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30}
    torch.cuda.empty_cache()
    tflops = flops / seconds / 1e12
    return {"model": name, "ms_per_step": 1e3 * seconds, "tokens_per_s": tokens / seconds,
            "tflops_lower_bound": tflops, "mfu_lower_bound": None if peak is None else tflops / peak,
            "peak_memory_gib": memory, "loss": loss, "first_step_s": first_step}


def print_results(results: list[dict], config_name: str, parameters: float, peak: float | None, seq: int,
                  with_hf: bool) -> None:
    """The table of `timed_result`s; with `with_hf` the first is the Hugging Face model, whose tokens/s the others
    are compared with (each gets `tokens_per_s_vs_hf`, unless it ran out of memory). "-": not measured (on the CPU,
    MFU and memory)."""
    def figure(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    baseline = results[0] if with_hf else {"out_of_memory": True}
    print(f"config {config_name}: {parameters / 1e9:.2f}B active matmul parameters; bf16 matmul peak measured: "
          f"{figure(peak, '.0f')} TFLOP/s; batch {BATCH} x {seq}")
    print(f"{'model':<34}{'ms/step':>9}{'tok/s':>9}{'TFLOP/s>=':>11}{'MFU>=':>7}{'mem GiB':>9}{'x HF':>7}"
          f"{'loss':>9}{'1st step s':>11}")
    for r in results:
        if r.get("out_of_memory"):
            print(f"{r['model']:<34}  out of memory on a {r['gpu_memory_gib']:.1f} GiB GPU")
            continue
        ratio = "n/a"
        if not baseline.get("out_of_memory"):
            r["tokens_per_s_vs_hf"] = r["tokens_per_s"] / baseline["tokens_per_s"]
            ratio = f"{r['tokens_per_s_vs_hf']:.2f}"
        print(f"{r['model']:<34}{r['ms_per_step']:>9.1f}{r['tokens_per_s']:>9.0f}{r['tflops_lower_bound']:>11.0f}"
              f"{figure(r['mfu_lower_bound'], '.1%'):>7}{figure(r['peak_memory_gib'], '.1f'):>9}{ratio:>7}"
              f"{r['loss']:>9.4f}{r['first_step_s']:>11.1f}")


def step_arguments(configs: dict, results_name: str, baseline: str,
                   recompute_layers_note: str = "") -> argparse.ArgumentParser:
    """The options of the DeepSeek training-step benchmarks (this one and bench_deepseek_v41.py) but `--paths`:
    `configs` the model configs by name, `results_name` names the default result file, `baseline` the model timed
    against ours."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", choices=sorted(configs), default="small")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--out", default=None,
                        help=f"default: benchmarks/results/{results_name}_<config>_seq<seq>_<gpu>.json")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first, before the timed ones")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing, profile --profile-steps steps of our model on the first of --paths and "
                             "print the top ops")
    parser.add_argument("--profile-steps", type=int, default=1)
    parser.add_argument("--recompute", choices=sorted(RECOMPUTE), default="none",
                        help="activation recompute of our model: full (every layer), selective (core_attn, layernorm, "
                             "moe), selective-attention (core_attn, layernorm) or selective-moe (moe, layernorm)")
    parser.add_argument("--recompute-layers", type=int, default=None,
                        help="with --recompute full: only the first N layers (recompute_method='block')"
                             + recompute_layers_note)
    parser.add_argument("--no-hf", action="store_true", help=f"skip {baseline} (e.g. where it cannot fit)")
    return parser


def main() -> None:
    parser = step_arguments(CONFIGS, "deepseek_v4", "transformers' model", "; transformers' model is skipped")
    parser.add_argument("--paths", default="exact,fast",
                        help="our attention paths to time, comma-separated; '+graphs' (e.g. fast+graphs) replays "
                             "the decoder layers as CUDA graphs, '+dense-csa' runs the CSA attention as dense "
                             "blocks (the baseline of its kernels), '+keep-attention' keeps the attention's output across a "
                             "full recompute")
    args = parser.parse_args()
    check_recompute_layers(parser, args)
    with scratch_folder("deepseek-v4-bench") as folder:
        run(args, folder)


def run(args, folder: Path) -> None:
    """Write the random checkpoint of `args.config` to `folder`, then time (or profile) the models on it."""
    from transformers import DeepseekV4ForCausalLM

    from modelzoo import runtime
    from tiny_checkpoints.deepseek_v4_tiny import write_deepseek_v4_tiny

    config = model_config(args.config, args.seq)
    write_deepseek_v4_tiny(folder, config)
    ids = random_tokens(config["vocab_size"], (BATCH, args.seq))
    recompute, setting = recompute_settings(RECOMPUTE, args.recompute, args.recompute_layers)
    if args.profile:
        path = args.paths.split(",")[0]
        profile_our_model(lambda: our_step(folder, ids, path, recompute)[1], args.profile_steps, args.warmup)
        return
    peak = matmul_peak_tflops()
    flops = step_flops(config, args.seq)
    results = []

    def record(name, step):
        results.append(timed_result(name, step, flops, peak, BATCH * args.seq, args.steps, args.warmup))

    with_hf = not args.no_hf and args.recompute_layers is None  # transformers recomputes every layer or none
    if with_hf:
        hf = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
        if args.recompute == "full":
            hf.gradient_checkpointing_enable()
            hf.train()  # transformers checkpoints only in training mode
        record("transformers DeepseekV4 (eager)", hf_step(hf, ids))
        del hf
    with runtime.parallel(tp=1):
        for path in filter(None, args.paths.split(",")):
            model, step = our_step(folder, ids, path, recompute)
            record(f"megatron deepseek_v4 ({path}, recompute {setting})", step)
            model.release_cuda_graphs()
            del model, step

    print_results(results, args.config, active_parameters(config), peak, args.seq, with_hf)
    suffix = "" if setting == "none" else f"_{setting}_recompute"
    write_run(args.out or results_file(f"deepseek_v4_{args.config}_seq{args.seq}{suffix}"),
              {**run_record("bench_deepseek_v4.py"), "peak_tflops": peak, "config_name": args.config, "seq": args.seq,
               "recompute": setting, "config": config, "results": results})


if __name__ == "__main__":
    main()
