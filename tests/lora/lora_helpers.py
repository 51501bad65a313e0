"""Shared pieces of the LoRA tests: checkpoints, adapters with non-zero B, the Megatron-side scenario, PEFT side."""

from __future__ import annotations

import contextlib
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from modelzoo.conversion.engine import ShardLayout
from modelzoo import build_provider, lora, runtime
from modelzoo.parity import logprobs_from_logits

TINY = Path(__file__).resolve().parents[2] / "tiny_checkpoints"
CHECKPOINTS = {"llama": TINY / "llama-tiny", "loopcoder": TINY / "loopcoder-tiny"}
# loopcoder adapts part of each fused layer (q, v of qkv; gate of gate/up), so masked B rows are exercised too
CONFIGS = {
    "llama": lora.LoRAConfig(targets=("all-linear",), rank=4, alpha=8.0),
    "loopcoder": lora.LoRAConfig(targets=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"), rank=4, alpha=8.0),
}
# fused Megatron layers share one A: its gradient is the sum of PEFT's per-projection A gradients
FUSED_GROUP = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def batch(seq: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seed))


def set_nonzero_B(model, provider, std: float = 0.05) -> None:
    """Give every adapter a B drawn per HF projection (seeded by its HF name), laid out by the weight mapping,
    so the adapter is the same at every TP size."""
    from megatron.core import parallel_state

    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    mapping = provider.mapping()
    for name, layer in lora.lora_layers(model):
        rule, indices = mapping.for_megatron(f"{name}.weight")
        full_out = ShardLayout(layer.weight).full_shape(layer.weight)[0]
        rows = [t.shape[0] for t in rule.transform.to_hf(torch.empty(full_out, 1, device="meta"), tp)]
        parts = [torch.randn(n, layer.lora.B.shape[1], generator=torch.Generator().manual_seed(zlib.crc32(hf.encode())))
                 * std for n, hf in zip(rows, rule.hf_names(indices))]
        full = rule.transform.to_megatron(parts, torch.Size([full_out, layer.lora.B.shape[1]]), tp)
        if getattr(layer.lora.B, "tensor_model_parallel", False):
            full = full.chunk(tp, dim=layer.lora.B.partition_dim)[rank]
        with torch.no_grad():
            layer.lora.B.copy_(full)


@contextlib.contextmanager
def counted_all_reduces():
    """Count torch.distributed.all_reduce calls (Megatron's and ours both look it up at call time)."""
    counts = {"calls": 0}
    original = dist.all_reduce

    def counting(*args, **kwargs):
        counts["calls"] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield counts
    finally:
        dist.all_reduce = original


def _write_merged(tensors: dict, source: Path, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_bytes((source / "config.json").read_bytes())


def _scenario(arch: str, tp: int, workdir: Path) -> dict:
    """Everything the adapter tests check, for one architecture at one TP size (rank 0's view is returned)."""
    checkpoint = CHECKPOINTS[arch]
    provider = build_provider(checkpoint)
    ids = batch()
    base = provider.provide()
    provider.load_hf_weights(base, progress=False)
    with counted_all_reduces() as base_collectives:
        (-provider.token_logprobs(base, ids).mean()).backward()
    base_logits = provider.gathered_logits(base, ids)

    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    lora.apply_lora(model, provider, CONFIGS[arch])
    zero_adapter_logits = provider.gathered_logits(model, ids)
    set_nonzero_B(model, provider)
    with counted_all_reduces() as lora_collectives:
        logprobs = provider.token_logprobs(model, ids)
        (-logprobs.mean()).backward()
    adapter_logits = provider.gathered_logits(model, ids)

    merged_dir = workdir / f"{arch}-tp{tp}-merged"
    merged = dict(lora.export_merged_hf_weights(model, provider))
    if dist.get_rank() == 0:
        _write_merged(merged, checkpoint, merged_dir)
    dist.barrier()
    merged_model = provider.provide()
    provider.load_hf_weights(merged_model, merged_dir, progress=False)
    merged_logits = provider.gathered_logits(merged_model, ids)

    lora.save_adapter(model, provider, workdir / f"{arch}-tp{tp}-adapter")
    lora.save_training_checkpoint(model, provider, workdir / f"{arch}-tp{tp}-checkpoint")
    with torch.no_grad():  # export the gradients through the adapter export: PEFT names, full tensors
        for param in lora.adapter_parameters(model).values():
            param.copy_(param.grad)
    gradients = dict(lora.adapter_hf_weights(model, provider))
    return dict(base_logits=base_logits, zero_adapter_logits=zero_adapter_logits, adapter_logits=adapter_logits,
                merged_logits=merged_logits, logprobs=logprobs.detach(), gradients=gradients,
                collectives=(base_collectives["calls"], lora_collectives["calls"]))


def run_scenarios(rank: int, tp: int, workdir: str) -> dict:
    with runtime.parallel(tp=tp):
        return {arch: _scenario(arch, tp, Path(workdir)) for arch in CHECKPOINTS}


def peft_logprobs_and_gradients(arch: str, adapter_dir: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The HF oracle (transformers' Llama / our LoopCoder reference) with the adapter loaded by `peft`."""
    import warnings

    from peft import PeftModel

    provider = build_provider(CHECKPOINTS[arch])
    hf_model = provider.hf_model_class().from_pretrained(CHECKPOINTS[arch], dtype=torch.float32,
                                                         attn_implementation="eager")
    with warnings.catch_warnings():  # adapter_config.json's packed_modules_mapping is for vLLM; PEFT warns
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(hf_model, adapter_dir, is_trainable=True)
    ids = batch()
    logprobs = logprobs_from_logits(model(ids, use_cache=False).logits, ids)
    (-logprobs.mean()).backward()
    gradients = {name.replace(".default", ""): param.grad for name, param in model.named_parameters()
                 if param.requires_grad}
    return logprobs.detach(), gradients


def shared_a_gradients(peft_gradients: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT gradients as the Megatron adapters see them: A gradients summed over each fused group."""
    sums: dict[str, torch.Tensor] = {}
    for name, grad in peft_gradients.items():
        if ".lora_A." in name:
            module, _ = name.split(".lora_A.")
            prefix, leaf = module.rsplit(".", 1)
            key = f"{prefix}.{FUSED_GROUP.get(leaf, leaf)}"
            sums[key] = sums.get(key, 0) + grad
    shared = {}
    for name, grad in peft_gradients.items():
        if ".lora_A." in name:
            prefix, leaf = name.split(".lora_A.")[0].rsplit(".", 1)
            shared[name] = sums[f"{prefix}.{FUSED_GROUP.get(leaf, leaf)}"]
        else:
            shared[name] = grad
    return shared
