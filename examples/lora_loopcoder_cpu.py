"""Fine-tune the tiny LoopCoder with LoRA on a CPU: a few AdamW steps, then a checkpoint and a PEFT adapter.

    .venv/bin/python examples/lora_loopcoder_cpu.py --out /tmp/lora-run [--steps 40]

The task is counting: every sequence is start, start+1, ... (mod 256) from a random start, which the random
tiny model cannot do and its adapters learn within a few dozen steps. The last line printed is JSON with the
loss of every step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from modelzoo import build_provider, lora, runtime

CHECKPOINT = Path(__file__).resolve().parents[1] / "tiny_checkpoints" / "loopcoder-tiny"


def counting_batch(generator: torch.Generator, batch: int = 8, seq: int = 24) -> torch.Tensor:
    starts = torch.randint(0, 256, (batch, 1), generator=generator)
    return (starts + torch.arange(seq)) % 256


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="new folder for the checkpoint and the adapter")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)
    out = Path(args.out)
    torch.set_num_threads(2)

    start = time.perf_counter()
    losses = []
    with runtime.parallel(tp=1):
        provider = build_provider(CHECKPOINT)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        config = lora.LoRAConfig(targets=("all-linear",), rank=8, alpha=16.0, dropout=0.05)
        adapted = lora.apply_lora(model, provider, config)
        adapters = lora.adapter_parameters(model)
        print(f"adapted {len(adapted)} layers; trainable {sum(p.numel() for p in adapters.values()):,} of "
              f"{sum(p.numel() for p in model.parameters()):,} parameters")
        optimizer = torch.optim.AdamW(adapters.values(), lr=args.lr, weight_decay=0.0)
        data = torch.Generator().manual_seed(0)
        for step in range(args.steps):
            loss = -provider.token_logprobs(model, counting_batch(data)).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            print(f"step {step:3d}  loss {loss.item():.4f}")
        lora.save_training_checkpoint(model, provider, out / "checkpoint", optimizer, step=args.steps)
        lora.save_adapter(model, provider, out / "adapter")
    print(f"wrote {out / 'checkpoint'} (resume with modelzoo.lora.resume_training) and {out / 'adapter'} (PEFT); "
          f"{time.perf_counter() - start:.1f} s")
    print(json.dumps({"losses": losses}))
    return losses


if __name__ == "__main__":
    main()
