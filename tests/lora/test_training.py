"""LoRA training: only adapters train, the reference model is untouched, and checkpoint/resume is bit-exact.

Resume is compared with exact equality (losses and adapter bytes): fp32 on CPU, one process, the same ops in
the same order, so an uninterrupted run and a resumed one must agree bit for bit. Dropout (0.1) makes the RNG
restore matter, AdamW the optimizer moments, the step-dependent learning rate the step; the control resumes the
adapters alone and must differ.
"""

import pytest
import torch
from lora_helpers import CHECKPOINTS, batch

from modelzoo import build_provider, runtime
from modelzoo.lora import (
    LoRAConfig,
    adapter_parameters,
    apply_lora,
    load_adapter_checkpoint,
    lora_layers,
    resume_training,
    save_training_checkpoint,
)

CONFIG = LoRAConfig(rank=4, alpha=8.0, dropout=0.1)
TOTAL_STEPS, SAVED_AT = 6, 4


def test_only_adapters_train_and_a_reference_model_from_the_same_provider_is_untouched():
    with runtime.parallel(tp=1):
        provider = build_provider(CHECKPOINTS["loopcoder"])
        policy = provider.provide()
        provider.load_hf_weights(policy, progress=False)
        adapted = apply_lora(policy, provider, CONFIG)
        reference = provider.provide()  # after the policy was adapted: nothing leaks into a new model
        provider.load_hf_weights(reference, progress=False)

        assert len(adapted) == 4 * 2
        assert {n for n, p in policy.named_parameters() if p.requires_grad} == set(adapter_parameters(policy))
        assert not list(lora_layers(reference))
        assert {n for n, p in reference.named_parameters() if not p.requires_grad} == {
            f"decoder.layers.{i}.self_attention.loop_gate.{p}" for i in range(2) for p in ("weight", "bias")}
        policy.eval()  # no dropout: zero B must give the reference's logits exactly
        assert torch.equal(provider.gathered_logits(policy, batch()), provider.gathered_logits(reference, batch()))

        policy.train()
        before = {name: p.detach().clone() for name, p in policy.named_parameters()}
        optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)  # handed every parameter
        (-provider.token_logprobs(policy, batch()).mean()).backward()
        optimizer.step()
        for name, param in policy.named_parameters():
            changed = not torch.equal(param, before[name])
            # B moves on the first step; A only once B is non-zero, so it keeps its value here
            assert changed == name.endswith(".lora.B"), f"{name}: changed={changed}"


def _train(provider, model, optimizer, first_step: int, last_step: int) -> list[float]:
    losses = []
    for step in range(first_step, last_step):
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * (step + 1) / TOTAL_STEPS
        ids = torch.randint(0, 256, (2, 24))  # from the global generator: its state is part of the checkpoint
        loss = -provider.token_logprobs(model, ids).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _session(folder, first_step: int, last_step: int, restore: str | None):
    """One run in a fresh parallel state (the generators start from the same seed every time)."""
    with runtime.parallel(tp=1):
        provider = build_provider(CHECKPOINTS["loopcoder"])
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        apply_lora(model, provider, CONFIG)
        optimizer = torch.optim.AdamW(adapter_parameters(model).values(), lr=1e-2, weight_decay=0.01)
        if restore == "everything":
            assert resume_training(model, folder, optimizer) == first_step
        elif restore == "adapters-only":
            load_adapter_checkpoint(model, folder)
        losses = _train(provider, model, optimizer, first_step, last_step)
        if restore is None and last_step == SAVED_AT:
            save_training_checkpoint(model, provider, folder, optimizer, step=last_step)
        return losses, {name: p.detach().clone() for name, p in adapter_parameters(model).items()}


@pytest.mark.parametrize("restore", ["everything", "adapters-only"], ids=["resume", "control-adapters-only"])
def test_resume_continues_bit_for_bit(tmp_path, restore):
    uninterrupted_losses, uninterrupted_adapters = _session(None, 0, TOTAL_STEPS, None)
    first_losses, _ = _session(tmp_path / "checkpoint", 0, SAVED_AT, None)
    resumed_losses, resumed_adapters = _session(tmp_path / "checkpoint", SAVED_AT, TOTAL_STEPS, restore)

    assert first_losses == uninterrupted_losses[:SAVED_AT]
    identical = (first_losses + resumed_losses == uninterrupted_losses
                 and all(torch.equal(resumed_adapters[n], t) for n, t in uninterrupted_adapters.items()))
    assert identical == (restore == "everything")
