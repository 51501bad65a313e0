"""Sequence parallelism (`sequence_parallel=True`, TP 2, and TP 2 x CP 2) for Llama, LoopCoder and DeepSeek-V4,
against the HF models.

Oracle: transformers' LlamaForCausalLM and DeepseekV4ForCausalLM and our LoopCoder reference, fp32, full-sequence
forward; for a packed row, each sequence run alone (its gradients summed over the sequences).

Two gloo ranks (TP 2) and four (TP 2 x CP 2: each CP rank's share of a row split again over its TP ranks) run every
architecture, one spawn each, each model wrapped in Megatron's DDP, the gradients summed by Megatron's
`finalize_model_grads` (what trainers call): it sums the gradients of the parameters marked `sequence_parallel`
(norms, DeepSeek-V4's hyper-connection maps and hyper head) over the TP ranks, and with CP every gradient over the CP
ranks (`calculate_per_token_loss`: summed, not averaged).
- Plain rows [2, 64] and a packed row of sequences of lengths 17, 40, 5 and 70 (slots padded to a multiple of the
  TP size: 134 tokens, so the ranks' halves split the last sequence; longer than LoopCoder's window of 8 and
  DeepSeek-V4's window of 16 and compress ratios 4 / 16): log-probabilities within LOGPROB_TOLERANCE = 1e-5 of the
  oracle's (fp32: the same math in another order moves them by ~1e-6, a token that misses part of its sequence by
  > 1e-2); every gradient, the summed norm gradients included, within GRADIENT_TOLERANCE = 1e-4 of the largest
  entry of its tensor (max-norm). LoopCoder's gate is made trainable so that its gradient is checked too. Measured:
  log-probs within 1e-6 (Llama, LoopCoder) and 4.3e-6 (DeepSeek-V4); gradients within 1.2e-6, but DeepSeek-V4's
  layer-0 hyper-connection `scale` at 8.3e-5 on plain rows: a sum with heavy cancellation whose fp32 gradient is
  ~3e-5 off its float64 value in transformers itself, ~7e-5 at TP 2 without sequence parallelism
  (tests/deepseek_v4/test_parallel.py). At TP 2 x CP 2 the same: log-probs within 1e-6 and 3.8e-6, gradients within
  1.1e-6 but that `scale` at 8.3e-5.
- That sequence parallelism is really on: the first layer's per-token input holds S / (2 x CP) tokens on each rank,
  and before finalize_model_grads a norm weight's gradient (its rank's tokens only) is > 1e-3 relative away from
  HF's; the ranks' gradients add up to the finalized one.
- A sequence of odd length is refused in one sentence; so is sequence_parallel at TP 1 (by Megatron's config), and
  LoRA on a sequence-parallel model (checked at TP 2).
- The CLI's `--sp` (with `--tp 2`): `parity` with 41 tokens (plain rows right-padded to 42 with a padding mask, packed
  slots to even lengths) and `logprobs --pack` of DeepSeek-V4 against the HF backend, 1e-5; `--sp` at `--tp 1` is
  refused in one sentence, exit 2, nothing written.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY

from modelzoo import build_provider, runtime
from modelzoo.parity import load_hf_model, logprobs_from_logits
from modelzoo.layers.sequences import pack_sequences

LOGPROB_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4
TP = 2
CONTEXT_PARALLEL_SIZES = (1, 2)
SEQ = 64
LENGTHS = (17, 40, 5, 70)
CHECKPOINTS = {"llama": TINY / "llama-tiny", "loopcoder": TINY / "loopcoder-tiny",
               "deepseek_v4": TINY / "deepseek-v4-tiny"}
OPTIONS = {"loopcoder": {"train_gate": True}}
BUFFERS = ("tid2eid", "e_score_correction_bias", "ffn.gate.bias")  # checkpoint tensors that are buffers
# a norm weight of each model, acting on this rank's tokens: (Megatron name, HF name)
NORMS = {"llama": ("decoder.layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight"),
         "loopcoder": ("decoder.layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight"),
         "deepseek_v4": ("decoder.layers.0.input_layernorm.weight", "model.layers.0.attn_norm.weight")}
# the first module of each model that sees one token at a time (its input: [s, b, h] or [B, S, h_mult, h])
PER_TOKEN = {"llama": ("decoder.layers.0.input_layernorm", 0), "loopcoder": ("decoder.layers.0.input_layernorm", 0),
             "deepseek_v4": ("decoder.layers.0.attn_hc", 1)}


def plain_rows() -> torch.Tensor:
    return torch.randint(0, 250, (2, SEQ), generator=torch.Generator().manual_seed(0))


def packed_sequences() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 250, (length,), generator=generator).tolist() for length in LENGTHS]


def _grads_by_name(provider, model) -> dict[str, torch.Tensor]:
    """Each parameter's DDP gradient (main_grad) exported through the weight mapping: HF names, full tensors."""
    saved = {}
    with torch.no_grad():
        for param in model.parameters():
            saved[param] = param.detach().clone()
            grad = getattr(param, "main_grad", None)
            param.copy_(grad if grad is not None else torch.zeros_like(param))
        grads = {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)
                 if not name.endswith(BUFFERS)}
        for param, value in saved.items():
            param.copy_(value)
    return grads


def _architecture(architecture: str, cp: int) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    provider = build_provider(CHECKPOINTS[architecture], sequence_parallel=True, **OPTIONS.get(architecture, {}))
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    model.config.calculate_per_token_loss = True  # read by DDP: each rank's gradient is of its tokens' loss, summed
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    per_token_inputs = []
    module, dim = PER_TOKEN[architecture]
    model.get_submodule(module).register_forward_hook(
        lambda _, inputs, output: per_token_inputs.append(inputs[0].shape[dim]))
    norm = dict(model.named_parameters())[NORMS[architecture][0]]

    def run(logprobs_of) -> dict:
        ddp.zero_grad_buffer()
        logprobs = logprobs_of().flatten()
        (-logprobs.sum()).backward()
        norm_grad_of_this_rank = norm.main_grad.clone()
        finalize_model_grads([ddp])
        tokens = per_token_inputs[0]
        per_token_inputs.clear()
        return dict(logprobs=logprobs.detach(), grads=_grads_by_name(provider, model), tokens=tokens,
                    norm_grad_of_this_rank=norm_grad_of_this_rank, norm_grad=norm.main_grad.clone())

    ids = plain_rows()
    plain = run(lambda: provider.token_logprobs(ddp, ids))
    # slots: each CP rank's 2 chunks of a slot together split over the TP ranks
    batch = pack_sequences(packed_sequences(), divisor=TP if cp == 1 else 2 * cp * TP)
    packed = run(lambda: torch.cat(provider.token_logprobs(ddp, batch.input_ids,
                                                           packed_seq_params=batch.packed_seq_params)))
    if cp > 1:
        return dict(plain=plain, packed=packed, packed_tokens=batch.input_ids.shape[1])
    try:
        with torch.no_grad():
            ddp(ids[:, :SEQ - 1])
        odd_length = None
    except ValueError as error:
        odd_length = str(error)
    return dict(plain=plain, packed=packed, packed_tokens=batch.input_ids.shape[1], odd_length=odd_length,
                lora=_lora_refusal(provider, model))


def _lora_refusal(provider, model) -> str | None:
    from modelzoo.lora import LoRAConfig, apply_lora

    try:
        apply_lora(model, provider, LoRAConfig(targets=("all-linear",)))
    except ValueError as error:
        return str(error)
    return None


def _rank(rank: int, cp: int) -> dict:
    results = {}
    for architecture in CHECKPOINTS:
        with runtime.parallel(tp=TP, cp=cp):
            results[architecture] = _architecture(architecture, cp)
    return results


def _hf_logprobs_and_grads(architecture: str, rows: list[torch.Tensor], scratch) -> tuple[torch.Tensor, dict]:
    """The HF model's log-probs of `rows` (concatenated) and the gradients of minus their sum, by checkpoint name
    (save_pretrained of the model with its parameters replaced by their gradients names them as the checkpoint)."""
    from safetensors.torch import load_file

    model = load_hf_model(CHECKPOINTS[architecture])
    logprobs = []
    for row in rows:
        row_logprobs = logprobs_from_logits(model(row, use_cache=False).logits, row).flatten()
        (-row_logprobs.sum()).backward()
        logprobs.append(row_logprobs.detach())
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.grad if param.grad is not None else torch.zeros_like(param)
    model.save_pretrained(scratch)
    grads = {name: grad for name, grad in load_file(scratch / "model.safetensors").items()
             if not name.endswith(BUFFERS)}
    return torch.cat(logprobs), grads


@pytest.fixture(scope="module")
def spawned():
    return {cp: runtime.spawn(_rank, TP * cp, cp) for cp in CONTEXT_PARALLEL_SIZES}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def case(request, spawned, tmp_path_factory):
    architecture = request.param
    ids = plain_rows()
    references = {
        "plain": _hf_logprobs_and_grads(architecture, [ids], tmp_path_factory.mktemp("plain")),
        "packed": _hf_logprobs_and_grads(architecture, [torch.tensor([s]) for s in packed_sequences()],
                                         tmp_path_factory.mktemp("packed")),
    }
    layouts = {cp: [rank[architecture] for rank in ranks] for cp, ranks in spawned.items()}
    return architecture, layouts, references


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def _relative_errors(grads: dict, reference: dict) -> dict[str, float]:
    # transformers builds no MTP layers; ours are frozen (their loss is off): no gradient
    unreferenced = grads.keys() - reference.keys()
    assert all(name.startswith("mtp.") and grads[name].abs().max().item() == 0 for name in unreferenced)
    assert reference.keys() <= grads.keys()
    errors = {}
    for name, expected in reference.items():
        scale = expected.abs().max().item()
        if scale == 0:  # no gradient path (DeepSeek-V4's indexer: a top-k of indices)
            assert ".indexer." in name and grads[name].abs().max().item() == 0, name
            continue
        errors[name] = _max_diff(grads[name], expected) / scale
    return errors


@pytest.mark.parametrize("cp", CONTEXT_PARALLEL_SIZES)
@pytest.mark.parametrize("form", ["plain", "packed"])
def test_logprobs_equal_the_hf_models(case, form, cp):
    _, layouts, references = case
    for result in layouts[cp]:
        assert _max_diff(result[form]["logprobs"], references[form][0]) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("cp", CONTEXT_PARALLEL_SIZES)
@pytest.mark.parametrize("form", ["plain", "packed"])
def test_every_gradient_equals_the_hf_models_after_finalize_model_grads(case, form, cp):
    _, layouts, references = case
    for result in layouts[cp]:
        for name, error in _relative_errors(result[form]["grads"], references[form][1]).items():
            assert error <= GRADIENT_TOLERANCE, (form, name, error)


@pytest.mark.parametrize("cp", CONTEXT_PARALLEL_SIZES)
@pytest.mark.parametrize("form", ["plain", "packed"])
def test_tokens_are_split_and_norm_gradients_are_summed_over_the_ranks(case, form, cp):
    architecture, layouts, references = case
    ranks = layouts[cp]
    tokens = SEQ if form == "plain" else ranks[0]["packed_tokens"]
    hf_norm_grad = references[form][1][NORMS[architecture][1]]
    scale = hf_norm_grad.abs().max().item()
    for result in ranks:
        assert result[form]["tokens"] == tokens // (TP * cp)
        assert _max_diff(result[form]["norm_grad_of_this_rank"], hf_norm_grad) / scale > 1e-3
    assert torch.allclose(sum(result[form]["norm_grad_of_this_rank"] for result in ranks), ranks[0][form]["norm_grad"],
                          rtol=0, atol=1e-6 * scale)


def test_a_sequence_the_ranks_cannot_split_is_refused(case):
    architecture, layouts, _ = case
    for result in layouts[1]:
        assert result["odd_length"] is not None
        assert f"with sequence parallelism the sequence length ({SEQ - 1}) must be a multiple of the " \
               f"tensor-parallel size ({TP})" in result["odd_length"]


def test_lora_on_a_sequence_parallel_model_is_refused(case):
    _, layouts, _ = case
    for result in layouts[1]:
        assert result["lora"] == ("LoRA: sequence parallelism is not supported; build the model with "
                                  "sequence_parallel=False")


@pytest.mark.parametrize("architecture", list(CHECKPOINTS))
def test_sequence_parallel_at_tp1_is_refused(architecture):
    with runtime.parallel(tp=1):
        provider = build_provider(CHECKPOINTS[architecture], sequence_parallel=True)
        with pytest.raises(ValueError, match="Cannot use sequence parallelism without tensor parallelism"):
            provider.provide()


# --- the CLI: `--sp` beside `--tp` -----------------------------------------------------------------------------------
def test_cli_parity_with_sp_pads_rows_the_ranks_cannot_split(capsys):
    from modelzoo.conversion.cli import main

    # 41 tokens: plain rows are right-padded to 42 with a padding mask, the packed slots to even lengths
    assert main(["parity", str(CHECKPOINTS["loopcoder"]), "--tp", "2", "--sp", "--seq-len", "41", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["sp"] and report["packed_lengths"] == [1, 5, 13, 41]
    assert report["max_abs_diff_logprobs"] <= LOGPROB_TOLERANCE
    assert report["max_abs_diff_logprobs_packed"] <= LOGPROB_TOLERANCE


def test_cli_packed_logprobs_with_sp_equal_the_hf_backend(tmp_path):
    from modelzoo.conversion.cli import main

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(packed_sequences()))
    checkpoint = str(CHECKPOINTS["deepseek_v4"])
    assert main(["logprobs", checkpoint, "--tokens", str(tokens), "--out", str(tmp_path / "sp.json"), "--pack",
                 "--tp", "2", "--sp"]) == 0
    assert main(["logprobs", checkpoint, "--tokens", str(tokens), "--out", str(tmp_path / "hf.json"),
                 "--backend", "hf"]) == 0
    ours = json.loads((tmp_path / "sp.json").read_text())["logprobs"]
    reference = json.loads((tmp_path / "hf.json").read_text())["logprobs"]
    assert [len(sequence) for sequence in ours] == [length - 1 for length in LENGTHS]
    for mine, theirs in zip(ours, reference):
        assert max(abs(a - b) for a, b in zip(mine, theirs)) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("command", ["parity", "logprobs"])
def test_cli_sp_without_two_tensor_parallel_ranks_is_refused(tmp_path, capsys, command):
    from modelzoo.conversion.cli import main

    extra = ["--tokens", str(tmp_path / "tokens.json"), "--out", str(tmp_path / "out.json")]
    if command == "parity":
        extra = []
    assert main([command, str(CHECKPOINTS["llama"]), "--sp", *extra]) == 2
    error = capsys.readouterr().err.strip()
    assert error == ("modelzoo: error: --sp splits each sequence over the tensor-parallel ranks and needs --tp 2 or "
                     "more, got --tp 1")
    assert not (tmp_path / "out.json").exists()
