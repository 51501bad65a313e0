"""One DeepSeek-V4 layer's hyper-connections, forward + backward, on one GPU: `HyperConnection` (whose own
backward sums the streams' gradient terms, `_HyperMix`) against autograd through the plain composition of
the same functions (`linear_fp32`, `hc_mix`, `hc_residual`), which sums them in separate passes.

    python benchmarks/bench_hyper_connection.py [--hidden 2048] [--seq 4096] [--replays 50]

A layer's pattern: mix, (block), residual + mix, (block), residual, with a stand-in for the blocks
(collapsed * 2). Each variant is captured in a CUDA graph (the model replays these kernels in one) and
timed over `--replays` replays; bf16 streams, fp32 maps, the large benchmark config's shapes by default.
"""

from __future__ import annotations

import argparse

import torch

from modelzoo.deepseek_v4.model.hyper_connection import HyperConnection, hc_mix, hc_residual
from modelzoo.deepseek_v4.model.layers import linear_fp32


def composed(first: HyperConnection, second: HyperConnection, streams: torch.Tensor) -> torch.Tensor:
    def mix(hc, streams):
        return hc_mix(streams, linear_fp32(streams.flatten(2), hc.fn), hc.base, hc.scale, *hc.settings())
    post, comb, collapsed = mix(first, streams)
    streams = hc_residual(post, comb, collapsed * 2, streams)
    post, comb, collapsed = mix(second, streams)
    return hc_residual(post, comb, collapsed * 2, streams)


def fused_backward(first: HyperConnection, second: HyperConnection, streams: torch.Tensor) -> torch.Tensor:
    post, comb, collapsed = first(streams)
    streams, post, comb, collapsed = second.after_residual(post, comb, collapsed * 2, streams)
    return hc_residual(post, comb, collapsed * 2, streams)


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    first, second = (HyperConnection(args.hidden, 4, 20, 1e-6, 1e-6).cuda() for _ in range(2))
    streams = torch.randn(1, args.seq, 4, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    output_grad = torch.randn_like(streams)
    timings = {name: time_graphed(layer, first, second, streams, output_grad, args.replays)
               for name, layer in (("autograd composition", composed), ("HyperConnection", fused_backward))}
    baseline = timings["autograd composition"]
    print(f"hyper-connections of one layer, forward + backward, streams [1, {args.seq}, 4, {args.hidden}] bf16")
    for name, ms in timings.items():
        print(f"  {name:<22} {ms:8.3f} ms  {baseline / ms:5.2f}x")


if __name__ == "__main__":
    main()
