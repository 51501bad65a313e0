"""What LoopCoder's pipeline stages would hold and run (docs/loopcoder.md, "Pipeline stages"): the time of a
forward + backward with one loop and with two, and the bytes of one layer's loop-1 K/V against the [S, B, H]
tensor sent between stages. CPU or GPU, fp32.

    python benchmarks/loopcoder_loops.py
"""

from __future__ import annotations

import time

import torch

from modelzoo import build_provider, runtime
from modelzoo.loopcoder.config import IQuestLoopCoderConfig

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, SEQ = 512, 8, 8, 2, 64, 1024


def config(loop_num: int) -> dict:
    fields = IQuestLoopCoderConfig.from_pretrained("tiny_checkpoints/loopcoder-tiny").to_dict()
    fields.update(hidden_size=HIDDEN, intermediate_size=3 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=1024, max_position_embeddings=4 * SEQ,
                  loop_num=loop_num)
    return fields


def step_seconds(model, ids: torch.Tensor, repeats: int = 3) -> float:
    model(ids, None, None).float().sum().backward()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids, None, None).float().sum().backward()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ids = torch.randint(0, 1000, (1, SEQ), device=runtime.device())
    with runtime.parallel():
        seconds = {loops: step_seconds(build_provider(config(loops)).provide(), ids) for loops in (1, 2)}
        model = build_provider(config(2)).provide()
        kv_bytes = []
        model.decoder.layers[0].register_forward_hook(
            lambda module, args, output: kv_bytes.append(sum(t.numel() * t.element_size() for t in output[1])))
        model(ids, None, None)
    boundary = SEQ * HIDDEN * 4
    print(f"forward + backward: loop_num 1 {seconds[1]:.2f} s, loop_num 2 {seconds[2]:.2f} s "
          f"(loop 2 is {1 - seconds[1] / seconds[2]:.0%})")
    print(f"loop-1 K/V of one layer: {kv_bytes[0] / 2**20:.2f} MiB; stage boundary [S, B, H]: {boundary / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
