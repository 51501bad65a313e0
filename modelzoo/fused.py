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


def fused(fn: Function | None = None, *, static_shapes: bool = False):
    """`fn` compiled on first use with CUDA tensors (the first argument decides); eager on CPU.

    By default torch.compile makes a dimension symbolic once it has seen two sizes of it, and a
    reduction of symbolic length compiles to a slower kernel: DeepSeek-V4's attention softmax over 256
    and 288 keys (after a call with 1280) took 135 / 133 us per call, 90 / 77 us compiled for static
    shapes (H200, 2026-12-03, launch included). `@fused(static_shapes=True)` compiles one kernel per
    distinct shape instead: few in training, where the shapes repeat every step; past torch's
    recompile limit (8 by default) a new shape runs eagerly.
    """
    if fn is None:
        return functools.partial(fused, static_shapes=static_shapes)
    compiled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=False if static_shapes else None)
        return compiled(*args, **kwargs)

    run.eager = fn
    return run
