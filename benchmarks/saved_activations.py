"""What one forward of our DeepSeek-V4 keeps for its backward, per module, in KiB per token.

    python benchmarks/saved_activations.py [--config large] [--seq 8192] [--recompute none]

The model is bench_deepseek_v4.py's `--config` (random weights, bf16, batch 1 x `--seq`, attention "fast"), with
its `--recompute` setting. Every tensor autograd saves is attributed to the innermost module running when it is
saved (a storage counted once, at its first save; parameters not counted; layers grouped by their attention
kind), and the table lists the largest; the total is checked against the allocator (memory allocated after the
forward minus before). This is the memory a long row needs per token: what recompute settings trade for time.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch

from bench_deepseek_v4 import CONFIGS, RECOMPUTE, model_config, our_model
from harness import recompute_settings, scratch_folder


def saved_bytes_by_module(model: torch.nn.Module, forward) -> tuple[dict[str, int], object]:
    """(bytes of the storages autograd saves during `forward()`, by innermost module name; forward's result)."""
    names = {module: name for name, module in model.named_modules()}
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    kinds = {f"layers.{index}": layer.layer_type for index, layer in enumerate(layers)}

    def group(name: str) -> str:
        return re.sub(r"layers\.(\d+)", lambda m: f"layers[{kinds.get(m.group(0), m.group(1))}]", name) or "(model)"

    stack, by_module = [], defaultdict(int)
    seen = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}   # weights are not activations

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            by_module[group(names.get(stack[-1], "?") if stack else "(outside modules)")] += storage.nbytes()
        return tensor

    def enter(module, args):
        stack.append(module)

    def leave(module, args, output):   # returns None: the output stays as it is
        stack.pop()

    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    post = torch.nn.modules.module.register_module_forward_hook(leave)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = forward()
    finally:
        pre.remove()
        post.remove()
    return by_module, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", choices=sorted(CONFIGS), default="large")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--recompute", choices=sorted(RECOMPUTE), default="none")
    parser.add_argument("--rows", type=int, default=30, help="modules listed")
    args = parser.parse_args()

    from modelzoo import runtime
    from tiny_checkpoints.deepseek_v4_tiny import write_deepseek_v4_tiny

    config = model_config(args.config, args.seq)
    recompute, setting = recompute_settings(RECOMPUTE, args.recompute, None)
    ids = torch.randint(0, config["vocab_size"], (1, args.seq), device="cuda")
    with scratch_folder("saved-activations") as folder, runtime.parallel(tp=1):
        write_deepseek_v4_tiny(folder, config)
        provider, model = our_model(folder, "fast", recompute)
        (-provider.token_logprobs(model, ids).mean()).backward()   # compiles the fused pieces, tunes the kernels
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        by_module, loss = saved_bytes_by_module(model, lambda: -provider.token_logprobs(model, ids).mean())
        held = torch.cuda.memory_allocated() - before
        loss.backward()

    total = sum(by_module.values())
    print(f"config {args.config}, {args.seq} tokens, recompute {setting}: saved {total / args.seq / 2**10:.1f} KiB "
          f"per token in all; the allocator holds {held / args.seq / 2**10:.1f} KiB per token after the forward")
    print(f"{'module (innermost)':<70}{'KiB/token':>10}{'share':>8}")
    for name, size in sorted(by_module.items(), key=lambda item: -item[1])[:args.rows]:
        print(f"{name:<70}{size / args.seq / 2**10:>10.1f}{size / total:>8.1%}")


if __name__ == "__main__":
    main()
