"""Fewer KV heads than TP ranks (Llama and LoopCoder): each rank holds a copy of the KV head its query heads read.

Against the HF model (transformers' Llama, our LoopCoder reference), fp32 on CPU:
- LOGPROB_TOLERANCE = 1e-5 on token log-probabilities: the same math in another order (~1e-6); a wrong copy or
  a query head reading the wrong KV head moves them by > 1e-2.
- GRAD_TOLERANCE = 1e-4 relative max-norm per tensor, as the other gradient tests. Every rank's K/V rows are
  compared with HF's gradient of its KV head: a copy that kept only its own query heads' part is off by O(1).
- round trips (HF -> Megatron -> HF, and a torch_dist checkpoint written with copies loaded at TP 1): bit-exact.
"""

import json

import pytest
import torch
from tiny_checkpoints import make_tiny as make_tiny_module
from safetensors.torch import load_file

from modelzoo.conversion import megatron_ckpt
from modelzoo.conversion.cli import main
from modelzoo import build_provider, lora, runtime
from modelzoo.parity import logprobs_from_logits

LOGPROB_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4
CASES = [("llama", 1, 2), ("loopcoder", 1, 2), ("loopcoder", 2, 4)]  # (architecture, KV heads, TP)


def write_checkpoint(folder, architecture: str, kv_heads: int):
    make_tiny = make_tiny_module
    base, shapes = {"llama": (make_tiny.LLAMA_TINY, make_tiny.llama_shapes),
                    "loopcoder": (make_tiny.LOOPCODER_TINY, make_tiny.loopcoder_shapes)}[architecture]
    config = {**base, "num_key_value_heads": kv_heads}
    make_tiny.write_checkpoint(folder, config, shapes(config))
    return folder


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def hf_logprobs_and_grads(folder, scratch):
    """The HF model's token log-probs and the gradients of -mean(log-probs), by checkpoint name."""
    provider = build_provider(folder)
    model = provider.hf_model_class().from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ids = tokens()
    logprobs = logprobs_from_logits(model(ids, use_cache=False).logits, ids)
    (-logprobs.mean()).backward()
    for param in model.parameters():
        param.data = param.grad
    model.save_pretrained(scratch)
    return logprobs.detach(), load_file(scratch / "model.safetensors")


def _case(folder, checkpoint) -> dict:
    from megatron.core import parallel_state

    provider = build_provider(folder, **({"train_gate": True} if folder.name == "loopcoder" else {}))
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    exported = dict(provider.export_hf_weights(model))
    megatron_ckpt.save(model, checkpoint, metadata={"architecture": provider.name})
    reloaded = provider.provide()
    megatron_ckpt.load(reloaded, checkpoint)
    logprobs = provider.token_logprobs(model, tokens())
    (-logprobs.mean()).backward()
    qkv = {name: module for name, module in model.named_modules() if name.endswith("linear_qkv")}
    local_kv_grads = {name: module.weight.grad[module.q_rows:].clone() for name, module in qkv.items()}
    for param in model.parameters():  # gradients through the weight mapping: HF names, full tensors
        param.data = param.grad
    grads = dict(provider.export_hf_weights(model))
    with pytest.raises(ValueError) as refusal:
        lora.apply_lora(model, provider, lora.LoRAConfig(targets=("all-linear",)))
    return dict(logprobs=logprobs.detach(), exported=exported, reloaded=dict(provider.export_hf_weights(reloaded)),
                grads=grads, local_kv_grads=local_kv_grads, kv_head=next(iter(qkv.values())).kv_head,
                tp_rank=parallel_state.get_tensor_model_parallel_rank(), lora_refusal=str(refusal.value))


def _rank(rank: int, tp: int, folders: list, checkpoints: list) -> list[dict]:
    # one group of processes for every case at this TP size: process start-up is most of the cost
    with runtime.parallel(tp=tp):
        return [_case(folder, checkpoint) for folder, checkpoint in zip(folders, checkpoints)]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """{case: (folder, checkpoint, results of every rank)}, one spawn per TP size."""
    root = tmp_path_factory.mktemp("replicated-kv")
    cases = {}
    for tp in sorted({tp for *_, tp in CASES}):
        at_tp = [(architecture, kv_heads) for architecture, kv_heads, case_tp in CASES if case_tp == tp]
        folders = [write_checkpoint(root / f"kv{k}-tp{tp}" / a, a, k) for a, k in at_tp]
        checkpoints = [folder.parent / f"{folder.name}-megatron" for folder in folders]
        per_rank = runtime.spawn(_rank, tp, tp, folders, checkpoints)
        for index, (architecture, kv_heads) in enumerate(at_tp):
            cases[architecture, kv_heads, tp] = (folders[index], checkpoints[index], [r[index] for r in per_rank])
    return cases


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-kv{k}-tp{t}" for a, k, t in CASES])
def case(request, spawned, tmp_path_factory):
    architecture, kv_heads, tp = request.param
    folder, checkpoint, results = spawned[request.param]
    reference, reference_grads = hf_logprobs_and_grads(folder, tmp_path_factory.mktemp("hf-grads"))
    return dict(folder=folder, kv_heads=kv_heads, tp=tp, reference=reference, reference_grads=reference_grads,
                results=results, checkpoint=checkpoint)


def test_logprobs_match_the_hf_model(case):
    for result in case["results"]:
        assert (result["logprobs"] - case["reference"]).abs().max().item() <= LOGPROB_TOLERANCE


def test_every_gradient_matches_and_every_kv_copy_has_its_heads_whole_gradient(case):
    reference = case["reference_grads"]
    for result in case["results"]:
        assert result["grads"].keys() == reference.keys()
        for name, expected in reference.items():
            error = (result["grads"][name] - expected).abs().max().item() / expected.abs().max().item()
            assert error <= GRAD_TOLERANCE, (name, error)
    d = json.loads((case["folder"] / "config.json").read_text())["head_dim"]
    copies = case["tp"] // case["kv_heads"]
    for result in case["results"]:
        assert result["kv_head"] == result["tp_rank"] // copies
        head = slice(result["kv_head"] * d, (result["kv_head"] + 1) * d)
        for name, local in result["local_kv_grads"].items():
            layer = name.split(".")[2]
            expected = torch.cat([reference[f"model.layers.{layer}.self_attn.{p}_proj.weight"][head] for p in "kv"])
            scale = expected.abs().max().item()
            assert (local - expected).abs().max().item() <= GRAD_TOLERANCE * scale, (name, result["tp_rank"])
    first, *others = case["results"]  # the copies' gradients are the same sum: bit-equal on every rank of a head
    for result in others:
        if result["kv_head"] == first["kv_head"]:
            assert all(torch.equal(result["local_kv_grads"][n], g) for n, g in first["local_kv_grads"].items())


def test_hf_megatron_hf_round_trip_is_bit_exact(case):
    source = load_file(case["folder"] / "model.safetensors")
    for result in case["results"]:
        for exported in (result["exported"], result["reloaded"]):  # and through torch_dist at the same TP
            assert exported.keys() == source.keys()
            assert all(torch.equal(exported[name], tensor) for name, tensor in source.items())


def test_torch_dist_checkpoint_with_copies_loads_at_tp1(case):
    source = load_file(case["folder"] / "model.safetensors")
    with runtime.parallel():
        provider = build_provider(case["folder"])
        model = provider.provide()
        megatron_ckpt.load(model, case["checkpoint"])
        exported = dict(provider.export_hf_weights(model))
    assert all(torch.equal(exported[name], tensor) for name, tensor in source.items())


def test_lora_refuses_a_linear_qkv_with_kv_copies(case):
    for result in case["results"]:
        assert "linear_qkv" in result["lora_refusal"] and "copies of" in result["lora_refusal"]


def test_streamed_import_and_export_at_tp2(tmp_path):
    """The CLI's streaming conversion writes a model with copies through torch_dist and reads it back."""
    folder = write_checkpoint(tmp_path / "loopcoder", "loopcoder", 1)
    assert main(["import", str(folder), str(tmp_path / "megatron"), "--tp", "2"]) == 0
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "hf"), "--tp", "2"]) == 0
    source, exported = load_file(folder / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == source.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in source.items())


@pytest.mark.parametrize("heads, kv_heads, tp, allowed", [(4, 1, 2, True), (4, 2, 4, True), (12, 4, 6, False),
                                                          (4, 1, 8, False)])
def test_tp_must_divide_or_be_a_multiple_of_the_kv_heads(heads, kv_heads, tp, allowed):
    make_tiny = make_tiny_module
    provider = build_provider({**make_tiny.LLAMA_TINY, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                               "hidden_size": 16 * heads})
    if allowed:
        provider.check_parallel_layout(tp)
        return
    with pytest.raises(ValueError, match=f"tensor parallel size {tp} must divide the attention heads \\({heads}\\) "
                                         f"and divide or be a multiple of the key/value heads \\({kv_heads}\\)"):
        provider.check_parallel_layout(tp)
