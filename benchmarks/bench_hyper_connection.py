"""One DeepSeek-V4 layer's hyper-connections, forward + backward, on one GPU: the Triton kernels
(`hc_kernels.py`, what `HyperConnection` runs on a GPU) against the compiled plain composition the
model ran before them (`linear_fp32`, then the map's scale, mixing weights, Sinkhorn iterations and
collapse as one `@fused` function, and the `@fused` residual; autograd sums the streams' three
gradient terms).

    python benchmarks/bench_hyper_connection.py [--hidden 2048] [--seq 4096] [--replays 50]

A layer's pattern: map + collapse, (block), residual, map + collapse, (block), residual, with a
stand-in for the blocks (collapsed * 2). Each variant is captured in a CUDA graph (the model replays
these kernels in one) and timed over `--replays` replays; bf16 streams, fp32 maps, the large benchmark
config's shapes by default.
"""

from __future__ import annotations

import argparse

import torch

from modelzoo.deepseek_v4.model.hyper_connection import (HyperConnection, hc_residual, map_mixes, mixing_weights,
                                                         plain_collapse, plain_residual, plain_sinkhorn)
from modelzoo.deepseek_v4.model.layers import linear_fp32
from modelzoo.layers.fused import fused


@fused
def _compiled_mix(streams, projected, base, scale, hc: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    pre, post, comb_logits = mixing_weights.eager(map_mixes(streams, projected, norm_eps), base, scale, hc, hc_eps)
    comb = plain_sinkhorn(comb_logits, sinkhorn_iters, hc_eps)
    return post, comb, plain_collapse(pre, streams)


_compiled_residual = fused(plain_residual)


def compiled_composition(first: HyperConnection, second: HyperConnection, streams: torch.Tensor) -> torch.Tensor:
    for hc in (first, second):
        post, comb, collapsed = _compiled_mix(streams, linear_fp32(streams.flatten(2), hc.fn), hc.base, hc.scale,
                                              hc.hc_mult, hc.sinkhorn_iters, hc.hc_eps, hc.norm_eps)
        streams = _compiled_residual(post, comb, collapsed * 2, streams)
    return streams


def triton_kernels(first: HyperConnection, second: HyperConnection, streams: torch.Tensor) -> torch.Tensor:
    for hc in (first, second):
        post, comb, collapsed, streams = hc(streams)
        streams = hc_residual(post, comb, collapsed * 2, streams)
    return streams


def time_graphed(layer, first, second, streams, output_grad, replays: int) -> float:
    """ms per forward + backward, replayed from a CUDA graph."""
    params = [*first.parameters(), *second.parameters()]

    def step():
        out = layer(first, second, streams)
        torch.autograd.grad(out, [streams, *params], output_grad)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compiles, then warms up
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def profile_kernels(name, layer, first, second, streams, output_grad) -> None:
    from torch.profiler import ProfilerActivity, profile

    params = [*first.parameters(), *second.parameters()]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(layer(first, second, streams), [streams, *params], output_grad)
        torch.cuda.synchronize()
    print(f"{name}: kernels of one eager step")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="also profile one eager step of each and print its kernels")
    args = parser.parse_args()
    torch.manual_seed(0)
    first, second = (HyperConnection(args.hidden, 4, 20, 1e-6, 1e-6).cuda() for _ in range(2))
    streams = torch.randn(1, args.seq, 4, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    output_grad = torch.randn_like(streams)
    timings = {name: time_graphed(layer, first, second, streams, output_grad, args.replays)
               for name, layer in (("compiled composition", compiled_composition), ("Triton kernels", triton_kernels))}
    if args.profile:
        for name, layer in (("compiled composition", compiled_composition), ("Triton kernels", triton_kernels)):
            profile_kernels(name, layer, first, second, streams, output_grad)
    baseline = timings["compiled composition"]
    print(f"hyper-connections of one layer, forward + backward, streams [1, {args.seq}, 4, {args.hidden}] bf16")
    for name, ms in timings.items():
        print(f"  {name:<22} {ms:8.3f} ms  {baseline / ms:5.2f}x")


if __name__ == "__main__":
    main()
