"""Pure tensor functions that run as fused kernels on a GPU and as written elsewhere.

Chains of small elementwise ops (norms, RoPE, clamped SwiGLU, DeepSeek-V4's hyper-connection
mixers with their Sinkhorn iterations) are launch-bound in eager PyTorch: one kernel per op,
forward and backward, each waiting on the host. `@fused` compiles such a function with
torch.compile the first time it meets CUDA tensors and runs the compiled kernels from then on;
on CPU it runs the plain ops, which is what the CPU parity tests compare against transformers.

The compiled kernels compute the same formula, but keep intermediates in registers: where the
eager code rounds an intermediate to bf16 and reads it back, the fused kernel may not, so bf16
results can differ from eager in the last bit (fp32 ones at the 1e-7 level).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

Function = TypeVar("Function", bound=Callable)


def fused(fn: Function | None = None, *, shapes: int | None = None) -> Function:
    """`fn` compiled on first use with CUDA tensors (the first argument decides); eager on CPU.

    Compiled for static shapes: one kernel per distinct input shape, few in training, where the shapes
    repeat every step (past torch's recompile limit, 8 by default, a new shape runs eagerly; `@fused(shapes=N)`
    raises that limit to N for this function's calls alone). torch's
    default makes a dimension symbolic once it has seen two sizes of it. On the H200 (torch 2.11,
    2026-12-03) that default went wrong twice:
    - once the hyper-connection and query kernels had been compiled for another hidden size
      (tests/deepseek_v4/test_fused_gpu.py), DeepSeek-V4's tiny model gave gradients off by up to their
      own size and different on every run, with the forward right; the same comparison passed in a
      fresh process, where each kernel is compiled for the first shapes it sees;
    - a reduction of symbolic length is slower: the attention softmax over 256 and 288 keys (after a
      call with 1280) took 135 / 133 us per call, 90 / 77 us compiled for static shapes (launch included).
    """
    if fn is None:
        return functools.partial(fused, shapes=shapes)
    compiled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=False)
        if shapes is None:
            return compiled(*args, **kwargs)
        with torch._dynamo.config.patch(recompile_limit=shapes):
            return compiled(*args, **kwargs)

    run.eager = fn
    return run
