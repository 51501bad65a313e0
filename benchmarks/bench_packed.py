"""Packed sequences on one GPU: a THD row of variable-length samples against the same tokens unpacked or padded.

    python benchmarks/bench_packed.py [--models loopcoder,deepseek_v4,deepseek_v41] [--steps 2] [--out FILE]

16 samples with lengths log-uniform in [256, 16384] (seed 10, the first seed whose draws total about 64k tokens:
64,793 tokens, 623 to 15,389 per sample), bf16, forward + backward of the
summed per-token loss (the GPTModel call with `labels`), fast attention, three ways:
- packed: one row [1, T] with `packed_seq_params` (each slot padded to a multiple of 128);
- unpacked: one plain sequence with as many tokens as the samples have;
- padded: the samples right-padded to the longest, with a [b, 1, 1, s] padding mask, in micro-batches of
  `--padded-micro-batch` rows (a trainer's micro-batches; all 16 rows at once do not fit);
each timed as the mean of `--steps` steps after one warm-up step, with torch.compile's caches emptied before it (a
form's kernels compile for its shapes, not fall back to eager past the recompile limit another form used up). The figure is real (sample) tokens per second.
Models: LoopCoder at the dense benchmark's config (hidden 2048, 16 layers, both loops) with full activation
recompute (one layer per checkpoint: at 64k tokens it does not fit without), DeepSeek-V4 at the `small`
config of bench_deepseek_v4.py (release attention ratios) and DeepSeek-V4.1 at the `small` config of
bench_deepseek_v41.py, no recompute. Peak memory is `max_memory_reserved`.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from bench_dense import LOOPCODER
from bench_deepseek_v4 import model_config, our_model
from harness import results_file, run_record, scratch_folder, write_run

SAMPLES, SHORTEST, LONGEST = 16, 256, 16384


def sample_lengths(seed: int = 10) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    logs = torch.empty(SAMPLES).uniform_(math.log(SHORTEST), math.log(LONGEST), generator=generator)
    return [int(length) for length in logs.exp().round()]


def build(name: str):
    """(provider, model) in bf16 with random weights (inside runtime.parallel)."""
    from modelzoo import build_provider

    if name == "loopcoder":
        config = {**LOOPCODER, "max_position_embeddings": LONGEST * SAMPLES}
        provider = build_provider(config, params_dtype=torch.bfloat16, attention="fast",
                                  recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        return provider, provider.provide()
    if name == "deepseek_v41":
        from bench_deepseek_v41 import model_config as checkpoint_config
        from tiny_checkpoints.deepseek_v41_tiny import write_deepseek_v41_tiny as write
    else:
        from tiny_checkpoints.deepseek_v4_tiny import write_deepseek_v4_tiny as write
        checkpoint_config = model_config
    with scratch_folder(f"{name}-bench") as folder:  # the model holds its weights once loaded
        write(folder, checkpoint_config("small", 0))
        return our_model(folder, "fast")


def training_step(model, micro_batches):
    """One step over micro-batches of (input_ids, call kwargs, labels, loss_mask): summed token loss, backward."""
    def step():
        model.zero_grad(set_to_none=True)
        total = 0.0
        for ids, call, labels, loss_mask in micro_batches:
            loss = (model(ids, labels=labels, **call) * loss_mask).sum()
            loss.backward()
            total += float(loss.detach())
        return total
    return step


def packed_batches(samples):
    from modelzoo.layers.sequences import pack_sequences

    batch = pack_sequences(samples, divisor=128, device="cuda")
    labels, loss_mask = batch.labels()
    return [(batch.input_ids, dict(packed_seq_params=batch.packed_seq_params), labels, loss_mask)]


def unpacked_batches(tokens: int, vocab: int):
    ids = torch.randint(0, vocab, (1, tokens), device="cuda")
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = torch.ones(ids.shape, device="cuda")
    loss_mask[0, -1] = 0
    return [(ids, {}, labels, loss_mask)]


def padded_batches(samples, rows_per_batch: int):
    longest = max(len(sample) for sample in samples)
    batches = []
    for first in range(0, len(samples), rows_per_batch):
        rows = samples[first:first + rows_per_batch]
        ids = torch.zeros(len(rows), longest, dtype=torch.long, device="cuda")
        padding = torch.ones(len(rows), 1, 1, longest, dtype=torch.bool, device="cuda")
        labels = torch.zeros_like(ids)
        loss_mask = torch.zeros(ids.shape, device="cuda")
        for row, sample in enumerate(rows):
            ids[row, :len(sample)] = torch.tensor(sample, device="cuda")
            padding[row, 0, 0, :len(sample)] = False
            labels[row, :len(sample) - 1] = ids[row, 1:len(sample)]
            loss_mask[row, :len(sample) - 1] = 1
        batches.append((ids, dict(attention_mask=padding), labels, loss_mask))
    return batches


def measure(step, steps: int) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        loss = step()                      # warm-up: compiles kernels for these shapes
        torch.cuda.synchronize()
        first = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"out_of_memory": True}
    seconds = (time.perf_counter() - started) / steps
    result = {"seconds_per_step": seconds, "first_step_s": first, "loss": loss,
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="loopcoder,deepseek_v4,deepseek_v41")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--padded-micro-batch", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/packed_<gpu>.json")
    args = parser.parse_args()

    from modelzoo import runtime

    lengths = sample_lengths()
    real_tokens = sum(lengths)
    generator = torch.Generator().manual_seed(1)
    report = {**run_record("bench_packed.py"), "lengths": lengths, "real_tokens": real_tokens, "steps": args.steps,
              "padded_micro_batch": args.padded_micro_batch, "models": {}}
    with runtime.parallel(tp=1):
        for name in args.models.split(","):
            provider, model = build(name)
            vocab = provider.vocab_size
            samples = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
            results = {}
            for form, batches in (("packed", packed_batches(samples)),
                                  ("unpacked", unpacked_batches(real_tokens, vocab)),
                                  ("padded", padded_batches(samples, args.padded_micro_batch))):
                torch._dynamo.reset()  # each form compiles for its own shapes, whatever ran before it
                results[form] = measure(training_step(model, batches), args.steps)
                if "seconds_per_step" in results[form]:
                    results[form]["real_tokens_per_s"] = real_tokens / results[form]["seconds_per_step"]
                print(name, form, json.dumps(results[form]), flush=True)
            for baseline in ("unpacked", "padded"):
                if "real_tokens_per_s" in results["packed"] and "real_tokens_per_s" in results[baseline]:
                    results[f"packed_vs_{baseline}"] = (results["packed"]["real_tokens_per_s"]
                                                        / results[baseline]["real_tokens_per_s"])
            report["models"][name] = results
            del model
            torch.cuda.empty_cache()

    print(f"{real_tokens} real tokens in {SAMPLES} samples of {min(lengths)}..{max(lengths)}; {report['machine']}")
    print(f"{'model':<12}{'form':<10}{'s/step':>9}{'real tok/s':>12}{'peak GiB':>10}")
    for name, results in report["models"].items():
        for form in ("packed", "unpacked", "padded"):
            r = results[form]
            if r.get("out_of_memory"):
                print(f"{name:<12}{form:<10}  out of memory")
                continue
            print(f"{name:<12}{form:<10}{r['seconds_per_step']:>9.3f}{r['real_tokens_per_s']:>12.0f}"
                  f"{r['peak_reserved_gib']:>10.1f}")
        for baseline in ("unpacked", "padded"):
            if f"packed_vs_{baseline}" in results:
                print(f"{name:<12}packed / {baseline}: {results[f'packed_vs_{baseline}']:.2f}x")
    write_run(args.out or results_file("packed"), report)


if __name__ == "__main__":
    main()
