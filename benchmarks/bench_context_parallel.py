"""Weak scaling of context parallelism: one GPU on a row of `--seq` tokens against `--cp` GPUs on a row of
`--cp` x `--seq` tokens, the tokens each GPU trains per second compared in one run.

    python benchmarks/bench_context_parallel.py --model loopcoder --seq 32768 --cp 2 --recompute full
    python benchmarks/bench_context_parallel.py --model deepseek_v4 --seq 16384 --cp 2
    python benchmarks/bench_context_parallel.py --model tiny_checkpoints/llama-tiny --seq 256 --dtype float32 \
        --steps 1 --warmup 0 --out /tmp/cp.json   # the same code on CPU ranks (gloo): a check, not a timing

Models: `llama` and `loopcoder` are bench_dense.py's configs, `deepseek_v4` is bench_deepseek_v4.py's `large`
(random weights), or a checkpoint folder. Each rank runs what a trainer runs under Megatron's context parallelism:
its share of the row in the load-balanced 2 x CP chunk layout (`context_parallel.split_for_rank`), the GPTModel call
with `labels`, the backward of the summed token loss over the whole row's tokens, and the sum of the parameter
gradients over the context-parallel group (one all-reduce of a flat buffer, which Megatron's DDP would overlap with
the backward). Each world size runs in its own processes (`runtime.spawn`, NCCL on GPUs). The figure is the
whole row's tokens per second per GPU; attention over a row twice as long costs each GPU more per token, so the
efficiency (CP tokens/s per GPU over one GPU's) includes that. Peak memory is `max_memory_reserved` per rank.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench_dense import LLAMA, LOOPCODER, RECOMPUTE, VOCAB
from harness import results_file, run_record, scratch_folder, write_run

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build(model: str, folder: Path | None, seq: int, dtype: torch.dtype, recompute: str):
    """(provider, module) on this rank's device, inside runtime.parallel."""
    from bench_deepseek_v4 import our_model

    from modelzoo import build_provider

    if model not in ("llama", "loopcoder"):  # a checkpoint's weights
        return our_model(folder, "fast", RECOMPUTE[recompute], dtype)
    config = {**(LLAMA if model == "llama" else LOOPCODER),
              "max_position_embeddings": max(LLAMA["max_position_embeddings"], seq)}
    provider = build_provider(config, params_dtype=dtype, attention="fast", **RECOMPUTE[recompute])
    return provider, provider.provide()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rank(rank: int, args: dict, folder: str | None, cp: int) -> dict:
    from megatron.core import parallel_state

    from modelzoo import runtime
    from modelzoo.layers import context_parallel

    seq = cp * args["seq"]
    with runtime.parallel(cp=cp):
        provider, model = build(args["model"], folder and Path(folder), seq, DTYPES[args["dtype"]], args["recompute"])
        device = runtime.device()
        ids = torch.randint(0, min(VOCAB, provider.vocab_size), (1, seq), generator=torch.Generator().manual_seed(0))
        labels = ids.roll(-1, dims=1)
        local_ids, local_labels = (context_parallel.split_for_rank(t).to(device) for t in (ids, labels))
        parameters = [p for p in model.parameters() if p.requires_grad]
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(local_ids, None, None, labels=local_labels).sum() / seq
            loss.backward()
            grads = [p.grad for p in parameters if p.grad is not None]
            flat = torch._utils._flatten_dense_tensors(grads)
            torch.distributed.all_reduce(flat, group=group)
            for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(summed)

        for _ in range(args["warmup"]):
            step()
        _synchronize()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        for _ in range(args["steps"]):
            step()
        _synchronize()
        seconds = (time.perf_counter() - started) / max(1, args["steps"])
        memory = torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None
    return {"gpus": cp, "seq": seq, "ms_per_step": 1e3 * seconds, "tokens_per_s_per_gpu": seq / seconds / cp,
            "peak_memory_gib": memory}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="loopcoder",
                        help="llama, loopcoder (bench_dense.py's configs), deepseek_v4 (bench_deepseek_v4.py's large) "
                             "or a checkpoint folder")
    parser.add_argument("--seq", type=int, default=32768, help="tokens per GPU: one GPU's row, 1/cp of the CP row")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--recompute", choices=sorted(RECOMPUTE), default="none")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/context_parallel_<model>_<gpu>.json")
    args = parser.parse_args()
    if torch.cuda.is_available() and torch.cuda.device_count() < args.cp:
        parser.error(f"--cp {args.cp} needs {args.cp} GPUs; this machine has {torch.cuda.device_count()}")
    if not torch.cuda.is_available() and args.out is None:
        parser.error("on CPU ranks give --out: the default result file is named after the GPU")

    from modelzoo import runtime

    with scratch_folder("deepseek-v4-bench") as scratch:
        folder = args.model if Path(args.model).is_dir() else None
        if args.model == "deepseek_v4":
            from bench_deepseek_v4 import model_config

            from tiny_checkpoints.deepseek_v4_tiny import write_deepseek_v4_tiny

            write_deepseek_v4_tiny(scratch, model_config("large", args.cp * args.seq))
            folder = str(scratch)
        elif folder is None and args.model not in ("llama", "loopcoder"):
            parser.error(f"--model {args.model!r}: not llama, loopcoder, deepseek_v4 or a checkpoint folder")
        settings = vars(args)
        [alone] = runtime.spawn(_rank, 1, {**settings, "seq": args.seq}, folder, 1)
        spread = runtime.spawn(_rank, args.cp, settings, folder, args.cp)[0]  # rank 0's figures
    efficiency = spread["tokens_per_s_per_gpu"] / alone["tokens_per_s_per_gpu"]
    print(f"{'GPUs':>5}{'row tokens':>12}{'ms/step':>10}{'tok/s per GPU':>15}{'peak GiB':>10}")
    for r in (alone, spread):
        memory = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
        print(f"{r['gpus']:>5}{r['seq']:>12}{r['ms_per_step']:>10.1f}{r['tokens_per_s_per_gpu']:>15.0f}{memory:>10}")
    print(f"CP {args.cp} weak-scaling efficiency: {efficiency:.1%} of one GPU's tokens/s per GPU")
    name = Path(args.model).name if folder and args.model != "deepseek_v4" else args.model
    write_run(args.out or results_file(f"context_parallel_{name}_seq{args.seq}_cp{args.cp}"),
              {**run_record("bench_context_parallel.py"), **settings, "one_gpu": alone, "context_parallel": spread,
               "efficiency": efficiency})


if __name__ == "__main__":
    main()
