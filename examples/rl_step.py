"""One GRPO-style RL step on a CPU, the way a Megatron-based RL trainer runs it: rollouts from an inference engine,
a packed batch through Megatron's schedule, a policy loss on the response tokens, an optimizer step, a weight sync.

    .venv/bin/python examples/rl_step.py [--checkpoint tiny_checkpoints/loopcoder-tiny] [--modes lora,full]

- The engine stand-in is the Hugging Face model of the current weights (what vLLM / SGLang would serve): it samples
  a group of responses to each prompt and reports their log-probabilities, as engines do for RL.
- The trainer packs the prompt + response samples of variable length into THD rows and runs them through
  `megatron.core.pipeline_parallel.get_forward_backward_func()` with GPTModel's call (`labels` -> per-token loss),
  in two micro-batches: once forward-only for its log-probs, once to train on a clipped policy loss (GRPO
  advantages: each sample's reward against its group's) over the response tokens.
- An optimizer step (AdamW): `lora` trains LoRA adapters on every linear layer and syncs the merged weights
  W + (alpha/r) B A, `full` trains every parameter (LoopCoder's loop gate stays frozen) and syncs them.
- `modelzoo.sync.WeightSync` streams the weights to the engine in size-bounded chunks (no fused pair split).

Printed for each mode: the train/rollout log-prob gap, mean |log p_train - log p_rollout| over response tokens, the
figure RL users watch: before training (fp32 rounding), after the step without a sync (the engine is stale) and
after the sync (rounding again). The last line is JSON with the three gaps per mode.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch

from modelzoo import build_provider, lora, runtime
from modelzoo.parity import load_hf_model
from modelzoo.layers.sequences import pack_sequences
from modelzoo.sync import WeightSync

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP = 2, 4            # GRPO: a group of sampled responses per prompt
MICRO_BATCHES = 2
CLIP = 0.2


# --- the engine stand-in --------------------------------------------------------------------------------------
class Engine:
    """What the trainer talks to in place of vLLM / SGLang: sampling, log-probs, and load_weights."""

    def __init__(self, checkpoint: Path):
        self.model = load_hf_model(checkpoint)

    @torch.no_grad()
    def sample(self, prompt: list[int], max_new: int, generator: torch.Generator) -> list[int]:
        tokens = list(prompt)
        for _ in range(max_new):
            logits = self.model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
            tokens.append(int(torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)))
        return tokens[len(prompt):]

    @torch.no_grad()
    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """log p(t[i+1] | t[:i+1]), as engines report prompt log-probs."""
        ids = torch.tensor([tokens])
        logits = self.model(ids, use_cache=False).logits.float()
        return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]

    def load_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict()
        unknown = sorted(name for name, _ in tensors if name not in state)
        if unknown:
            raise KeyError(f"the engine has no weights named {unknown[:3]}")
        with torch.no_grad():
            for name, tensor in tensors:
                state[name].copy_(tensor)


# --- rollouts -------------------------------------------------------------------------------------------------
def rollouts(engine: Engine, vocab: int, seed: int):
    """Prompts of several lengths, GROUP sampled responses each (3 to 12 tokens), a toy reward, GRPO advantages."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for prompt_number in range(PROMPTS):
        prompt = torch.randint(0, vocab, (int(torch.randint(4, 20, (1,), generator=generator)),),
                               generator=generator).tolist()
        group = []
        for _ in range(GROUP):
            response = engine.sample(prompt, int(torch.randint(3, 13, (1,), generator=generator)), generator)
            reward = sum(token % 2 == 0 for token in response) / len(response)    # toy: the share of even tokens
            group.append({"prompt": prompt, "response": response, "reward": reward})
        rewards = torch.tensor([sample["reward"] for sample in group])
        for sample, advantage in zip(group, (rewards - rewards.mean()) / (rewards.std() + 1e-6)):
            sample["advantage"] = float(advantage)
            sample["rollout_logprobs"] = engine.logprobs(sample["prompt"] + sample["response"])
        samples += group
    return samples


def micro_batches(samples):
    """Packed THD micro-batches: tokens, labels, which targets are response tokens, their advantages and
    rollout log-probs (per target position)."""
    batches = []
    per_batch = len(samples) // MICRO_BATCHES
    for first in range(0, len(samples), per_batch):
        chunk = samples[first:first + per_batch]
        packed = pack_sequences([s["prompt"] + s["response"] for s in chunk], divisor=4)
        labels, _ = packed.labels()
        response = torch.zeros(labels.shape)
        advantages = torch.zeros(labels.shape)
        rollout = torch.zeros(labels.shape)
        for sample, start in zip(chunk, packed.offsets):
            # target position t predicts token t + 1: the response's tokens are predicted from len(prompt) - 1 on
            targets = slice(start + len(sample["prompt"]) - 1, start + len(sample["prompt"]) + len(sample["response"]) - 1)
            response[0, targets] = 1.0
            advantages[0, targets] = sample["advantage"]
            rollout[0, targets] = sample["rollout_logprobs"][len(sample["prompt"]) - 1:]
        batches.append(dict(packed=packed, labels=labels, response=response, advantages=advantages, rollout=rollout))
    return batches


# --- the trainer --------------------------------------------------------------------------------------------
def forward_step(data_iterator, model):
    """SkyRL's / Megatron-Bridge's forward_step shape: the model call, and the loss function to apply to it."""
    batch = next(data_iterator)
    packed = batch["packed"]
    token_loss = model(packed.input_ids, None, None, labels=batch["labels"], packed_seq_params=packed.packed_seq_params)
    return token_loss, partial(policy_loss, batch)


def policy_loss(batch, token_loss):
    """Clipped policy-gradient loss over the response tokens (mean over them), and the tokens' log-probs."""
    logprobs = -token_loss
    mask = batch["response"]
    ratio = torch.exp(logprobs - batch["rollout"])
    objective = torch.minimum(ratio * batch["advantages"], ratio.clamp(1 - CLIP, 1 + CLIP) * batch["advantages"])
    loss = -(objective * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach(), "logprobs": logprobs.detach(), "response": mask}


def run_schedule(model, batches, forward_only: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model], num_microbatches=len(batches),
        seq_length=max(b["packed"].input_ids.shape[1] for b in batches), micro_batch_size=1, forward_only=forward_only)


def gap(outputs, rollout_batches) -> float:
    """Mean |log p_train - log p_rollout| over the response tokens."""
    total, count = 0.0, 0.0
    for output, batch in zip(outputs, rollout_batches):
        mask = output["response"]
        total += float(((output["logprobs"] - batch["rollout"]).abs() * mask).sum())
        count += float(mask.sum())
    return total / count


def engine_view(engine: Engine, samples, batches):
    """The batches with the engine's current log-probs as the rollout log-probs."""
    for sample in samples:
        sample["rollout_logprobs"] = engine.logprobs(sample["prompt"] + sample["response"])
    fresh = micro_batches(samples)
    return [{**batch, "rollout": new["rollout"]} for batch, new in zip(batches, fresh)]


def one_step(checkpoint: Path, mode: str, lr: float, seed: int) -> dict[str, float]:
    engine = Engine(checkpoint)
    provider = build_provider(checkpoint)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    if mode == "lora":
        lora.apply_lora(model, provider, lora.LoRAConfig(targets=("all-linear",), rank=8, alpha=16.0))
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    sync = WeightSync(provider, chunk_bytes=1 << 16, lora="merged" if mode == "lora" else "none")

    samples = rollouts(engine, provider.vocab_size, seed)
    batches = micro_batches(samples)
    gaps = {"before training": gap(run_schedule(model, batches, forward_only=True), batches)}

    model.zero_grad(set_to_none=True)
    trained = run_schedule(model, batches, forward_only=False)
    optimizer.step()
    print(f"[{mode}] policy loss per micro-batch {[round(float(output['loss']), 4) for output in trained]}; "
          f"{sum(p.numel() for p in trainable):,} parameters trained")

    after = run_schedule(model, batches, forward_only=True)
    gaps["after the step, engine not synced"] = gap(after, engine_view(engine, samples, batches))
    chunks = 0
    for chunk in sync.chunks(model):
        engine.load_weights(chunk.tensors)
        chunks += 1
    gaps["after the sync"] = gap(after, engine_view(engine, samples, batches))
    for name, value in gaps.items():
        print(f"[{mode}] train/rollout log-prob gap {name:<36} {value:.3e}")
    print(f"[{mode}] synced in {chunks} chunks (version {sync.version})")
    return gaps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "tiny_checkpoints" / "loopcoder-tiny"))
    parser.add_argument("--modes", default="lora,full")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    started = time.perf_counter()
    results = {}
    with runtime.parallel(tp=1):
        for mode in args.modes.split(","):
            results[mode] = one_step(Path(args.checkpoint), mode, args.lr, args.seed)
    print(f"{time.perf_counter() - started:.1f} s")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
