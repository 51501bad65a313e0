"""Causal attention kernels at the dense benchmark's shape (16 query heads, 4 key/value heads, head_dim 128, bf16):
forward + backward time of each scaled_dot_product_attention backend and of flex_attention, as ratios to the
flash backend measured in the same run.

    python3 benchmarks/bench_attention.py --seq 131072 [--steps 3]

Grouped keys and values go to each kernel as it takes them: `enable_gqa=True` where the backend accepts it, else
copied to every query head (`repeat_interleave`, inside the timed step, so the copy and its backward count).
TFLOP/s counts QK^T and PV over the causal half, forward + backward as 3 x the forward. Each kernel's output and
gradients are compared with the flash backend's (both bf16, so differences of a few bf16 ulps are expected).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness import results_file, run_record, write_run

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128


def sdpa(backend: SDPBackend, gqa: bool):
    def run(q, k, v):
        if not gqa:
            k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return run


def flex_causal(seq: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, q, k: k <= q, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device="cuda",
                             _compile=True)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True)


def timed(kernel, q, k, v, grad, steps: int) -> tuple[float, list[torch.Tensor]]:
    def step():
        for t in (q, k, v):
            t.grad = None
        out = kernel(q, k, v)
        out.backward(grad)
        return out
    out = step()  # warm-up (and compilation)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, [out.detach(), q.grad, k.grad, v.grad]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/attention_seq<S>_<gpu>.json")
    args = parser.parse_args()
    seq = args.seq
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, KV_HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn_like(q)
    flops = 3 * 4 * HEADS * HEAD_DIM * seq * (seq + 1) / 2
    kernels = {
        "flash (enable_gqa)": sdpa(SDPBackend.FLASH_ATTENTION, True),
        "cudnn (enable_gqa)": sdpa(SDPBackend.CUDNN_ATTENTION, True),
        "cudnn (kv copied per head)": sdpa(SDPBackend.CUDNN_ATTENTION, False),
        "efficient (enable_gqa)": sdpa(SDPBackend.EFFICIENT_ATTENTION, True),
        "flex_attention (causal block mask)": flex_causal(seq),
    }
    results, reference, baseline_ms = [], None, None
    for name, kernel in kernels.items():
        try:
            ms, tensors = timed(kernel, q, k, v, grad, args.steps)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as error:  # a backend that refuses the shape
            results.append({"kernel": name, "error": str(error).splitlines()[0][:200]})
            print(f"{name:<38} not run: {results[-1]['error']}")
            torch.cuda.empty_cache()
            continue
        if reference is None:
            reference, baseline_ms = tensors, ms
        diffs = [((t.float() - r.float()).abs().max() / r.float().abs().max()).item()
                 for t, r in zip(tensors, reference)]
        results.append({"kernel": name, "ms": ms, "tflops": flops / ms / 1e9, "speedup_vs_flash": baseline_ms / ms,
                        "max_rel_diff_vs_flash_out_dq_dk_dv": diffs})
        print(f"{name:<38}{ms:>10.1f} ms{flops / ms / 1e9:>8.0f} TFLOP/s{baseline_ms / ms:>7.2f}x  "
              f"max |diff| / max |flash| (out, dq, dk, dv): {', '.join(f'{d:.1e}' for d in diffs)}")
        del tensors
        torch.cuda.empty_cache()
    write_run(args.out or results_file(f"attention_seq{seq}"),
              {**run_record("bench_attention.py"), "seq": seq, "heads": HEADS, "kv_heads": KV_HEADS,
               "head_dim": HEAD_DIM, "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()
