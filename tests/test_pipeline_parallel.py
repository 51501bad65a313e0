"""Pipeline stages (PP 2; on 4 ranks PP 2 x TP 2, PP 2 x TP 2 with sequence parallelism, PP 2 x CP 2) for Llama and
DeepSeek-V4 through Megatron's schedules on gloo.

Oracle: transformers' LlamaForCausalLM and DeepseekV4ForCausalLM, full-sequence forward in fp32, on the same
micro-batches. One spawn per world size (2 ranks: PP 2, the checkpoint round trips and DeepSeek-V4's MTP; 4 ranks:
the mixes). Under context parallelism each rank's forward step takes its share of the micro-batch
(`context_parallel.split_for_rank`) and the last stage gathers the per-token loss back.

- Forward-only through `get_forward_backward_func()` with 3 micro-batches: the last stage's per-token loss (with
  `labels`) is minus the HF log-probs, LOGPROB_TOLERANCE = 1e-5 (fp32; the same math in another order moves them by
  ~1e-6, a layer missing or run twice by > 1e-1).
- Training through the same schedule (Megatron's DDP and finalize_model_grads): the gradient of the summed loss,
  exported by checkpoint name from every stage, equals transformers' gradient of the same loss (GRADIENT_TOLERANCE =
  1e-4 relative to the largest entry of each tensor, the project's gradient tolerance).
- DeepSeek-V4 with its MTP loss on (the MTP layers and a copy of the word embedding on the last stage): the
  gradients at PP 2 equal those at PP 1 (same tolerance); the embedding's includes the MTP layers' part, which
  finalize_model_grads adds from the last stage.
- A torch_dist checkpoint written at PP 2 loads at PP 1 and one written at PP 1 loads at PP 2: the weights exported
  after loading are bit-identical to the HF checkpoint's.
- Every rank's export at PP 2 yields every tensor of the checkpoint once (each stage's under its global layer
  number), and `provider.token_logprobs` (the forward-only schedule inside) gives the same log-probs on every rank.
- Llama with `tie_word_embeddings` at PP 2: the last stage's head is a copy of the first stage's embedding (built on
  the CPU through modelzoo.compat, on the meta device without the all-reduce that starts the copies equal); the
  log-probs and gradients equal transformers' (the embedding's gradient is the sum of both stages' uses).
- `provider.token_logprobs` (the forward-only schedule inside) at PP 2 x TP 2 + SP and PP 2 x CP 2 equals the HF
  log-probs on every rank; the CLI's `parity` passes at `--pp 2 --cp 2` and `--pp 2 --tp 2 --sp`.
- LoopCoder refuses PP > 1 in one sentence (the provider and the CLI, exit 2); P2P over gloo works once
  modelzoo.compat gives p2p_communication CPU receive buffers (tests/test_compat.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import TINY, write_llama_variant
from safetensors.torch import load_file

from modelzoo.conversion import megatron_ckpt
from modelzoo import build_provider, runtime
from modelzoo.layers import context_parallel
from modelzoo.parity import load_hf_model, logprobs_from_logits

LOGPROB_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4
CHECKPOINTS = {"llama": TINY / "llama-tiny", "deepseek_v4": TINY / "deepseek-v4-tiny"}
BUFFERS = ("ffn.gate.tid2eid", "ffn.gate.bias")  # DeepSeek-V4 checkpoint tensors that are buffers, not parameters
MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ = 3, 2, 24


def micro_batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, 250, (MICRO_BATCH_SIZE, SEQ + 1), generator=generator)
        batches.append(dict(tokens=tokens, input_ids=tokens[:, :-1], labels=tokens[:, 1:],
                            position_ids=torch.arange(SEQ).expand(MICRO_BATCH_SIZE, SEQ)))
    return batches


def hf_reference(folder, scratch) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """transformers' log-probs of each micro-batch and the gradients of the schedule's loss (the mean over
    micro-batches of each one's summed -log-probs), by checkpoint name (save_pretrained of the gradients)."""
    model = load_hf_model(folder)
    logprobs = [logprobs_from_logits(model(batch["tokens"], use_cache=False).logits, batch["tokens"])
                for batch in micro_batches()]
    (-sum(lp.sum() for lp in logprobs) / MICRO_BATCHES).backward()
    for param in model.parameters():
        param.data = param.grad if param.grad is not None else torch.zeros_like(param)
    model.save_pretrained(scratch)
    grads = {name: grad for name, grad in load_file(scratch / "model.safetensors").items() if not name.endswith(BUFFERS)}
    return [lp.detach() for lp in logprobs], grads


# --- the ranks -------------------------------------------------------------------------------------------------------
def _loss(output_tensor):
    # the schedule multiplies this rank's loss by the CP size, DDP averages over the CP ranks: their sum remains
    return output_tensor.sum(), {"per_token_loss": context_parallel.gather_from_ranks(output_tensor.detach())}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    input_ids, position_ids, labels = (context_parallel.split_for_rank(batch[key])
                                       for key in ("input_ids", "position_ids", "labels"))
    return model(input_ids, position_ids, None, labels=labels), _loss


def _schedule(provider, ddp, forward_only: bool) -> list[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(micro_batches()), model=[ddp],
        num_microbatches=MICRO_BATCHES, seq_length=provider.pipeline_seq_length(SEQ),
        micro_batch_size=MICRO_BATCH_SIZE, forward_only=forward_only)


def _trained(folder, **options) -> dict:
    """Forward-only then one forward-backward through the schedule; per-token losses (last stage) and gradients."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    provider = build_provider(folder, **options)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func, model.config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    with torch.no_grad():
        forward_only = [output["per_token_loss"] for output in _schedule(provider, ddp, forward_only=True)]
    ddp.zero_grad_buffer()
    _schedule(provider, ddp, forward_only=False)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.main_grad if getattr(param, "main_grad", None) is not None else torch.zeros_like(param))
        grads = {name: tensor.clone() for name, tensor in provider.export_hf_weights(model) if not name.endswith(BUFFERS)}
    return dict(forward_only=forward_only, grads=grads)


def _exported(provider, model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in provider.export_hf_weights(model)}


def _checkpoint_round_trips(folder, scratch) -> dict:
    """Written at PP 2 and read at PP 1, written at PP 1 and read at PP 2: the weights exported after each load."""
    results = {}
    for written_at, read_at in ((2, 1), (1, 2)):
        checkpoint = scratch / f"{folder.name}-pp{written_at}"
        with runtime.parallel(pp=written_at):
            provider = build_provider(folder)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            megatron_ckpt.save(model, checkpoint, metadata={"architecture": provider.name}, progress=False)
        with runtime.parallel(pp=read_at):
            model = provider.provide()
            megatron_ckpt.load(model, checkpoint)
            results[written_at, read_at] = _exported(provider, model)
    return results


def _two_ranks(rank: int, scratch, tied_llama) -> dict:
    results = {}
    with runtime.parallel(pp=2):
        skeleton = build_provider(tied_llama).provide_skeleton()
        results["tied_llama", "skeleton_devices"] = sorted({param.device.type for param in skeleton.parameters()})
        results["tied_llama"] = _trained(tied_llama)
    for architecture, folder in CHECKPOINTS.items():
        with runtime.parallel(pp=2):
            results[architecture] = _trained(folder)
            provider = build_provider(folder)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            with torch.no_grad():
                results[architecture, "token_logprobs"] = provider.token_logprobs(model, micro_batches()[0]["tokens"])
            results[architecture, "export"] = list(_exported(provider, model))
        results[architecture, "checkpoints"] = _checkpoint_round_trips(folder, scratch)
    for pp in (1, 2):  # two data-parallel replicas of the same micro-batches at PP 1
        with runtime.parallel(pp=pp):
            results["mtp", pp] = _trained(CHECKPOINTS["deepseek_v4"], mtp_loss_scale=0.3)["grads"]
    return results


FOUR_RANK_LAYOUTS = {"pp2-tp2": (dict(tp=2, pp=2), {}), "pp2-tp2-sp": (dict(tp=2, pp=2), dict(sequence_parallel=True)),
                     "pp2-cp2": (dict(cp=2, pp=2), {})}


def _four_ranks(rank: int) -> dict:
    results = {}
    for layout, (sizes, options) in FOUR_RANK_LAYOUTS.items():
        for architecture, folder in CHECKPOINTS.items():
            with runtime.parallel(**sizes):
                results[layout, architecture] = _trained(folder, **options)
                if layout != "pp2-tp2":
                    provider = build_provider(folder, **options)
                    model = provider.provide()
                    provider.load_hf_weights(model, progress=False)
                    with torch.no_grad():
                        results[layout, architecture, "token_logprobs"] = provider.token_logprobs(
                            model, micro_batches()[0]["input_ids"])  # SEQ tokens: the SP and CP ranks split them
    return results


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory, make_tiny):
    """The tiny Llama with `tie_word_embeddings: true` (no lm_head tensor)."""
    return write_llama_variant(tmp_path_factory.mktemp("llama-tied"), make_tiny, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def references(tmp_path_factory, tied_llama):
    return {architecture: hf_reference(folder, tmp_path_factory.mktemp(f"hf-grads-{architecture}"))
            for architecture, folder in {**CHECKPOINTS, "tied_llama": tied_llama}.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tied_llama):
    return runtime.spawn(_two_ranks, 2, tmp_path_factory.mktemp("pp-checkpoints"), tied_llama)


@pytest.fixture(scope="module")
def four_ranks():
    return runtime.spawn(_four_ranks, 4)


def _layouts(two_ranks, four_ranks, architecture):
    """(layout, rank, result) of every rank that ran the schedule for `architecture`."""
    for rank, result in enumerate(two_ranks):
        yield "pp2", rank, result[architecture]
    for layout in FOUR_RANK_LAYOUTS:
        for rank, result in enumerate(four_ranks):
            yield layout, rank, result[layout, architecture]


def _max_diff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def _relative_error(ours: torch.Tensor, reference: torch.Tensor, name: str) -> float:
    scale = reference.abs().max().item()
    if scale == 0:  # no gradient path (DeepSeek-V4's indexer: a top-k of indices)
        assert ours.abs().max().item() == 0, name
        return 0.0
    return _max_diff(ours, reference) / scale


@pytest.mark.parametrize("architecture", list(CHECKPOINTS))
def test_forward_only_schedule_gives_the_hf_logprobs_on_the_last_stage(architecture, references, two_ranks, four_ranks):
    reference, _ = references[architecture]
    for layout, rank, result in _layouts(two_ranks, four_ranks, architecture):
        last_stage = rank >= len(two_ranks if layout == "pp2" else four_ranks) // 2  # ranks of stage 1 come last
        assert len(result["forward_only"]) == (MICRO_BATCHES if last_stage else 0), (layout, rank)
        for number, (loss, theirs) in enumerate(zip(result["forward_only"], reference)):
            assert _max_diff(-loss, theirs) <= LOGPROB_TOLERANCE, (layout, rank, number)


@pytest.mark.parametrize("architecture", list(CHECKPOINTS))
def test_gradients_through_the_schedule_equal_transformers(architecture, references, two_ranks, four_ranks):
    _, reference = references[architecture]
    for layout, rank, result in _layouts(two_ranks, four_ranks, architecture):
        grads = result["grads"]
        assert set(reference) <= set(grads), (layout, sorted(set(reference) - set(grads))[:3])
        for name, expected in reference.items():
            assert _relative_error(grads[name], expected, name) <= GRADIENT_TOLERANCE, (layout, rank, name)


def test_llama_with_tied_embeddings_at_pp_2_equals_transformers(references, two_ranks):
    reference_logprobs, reference_grads = references["tied_llama"]
    assert "lm_head.weight" not in reference_grads
    for rank, result in enumerate(two_ranks):
        assert result["tied_llama", "skeleton_devices"] == ["meta"]
        trained = result["tied_llama"]
        assert len(trained["forward_only"]) == (MICRO_BATCHES if rank == 1 else 0)
        for loss, theirs in zip(trained["forward_only"], reference_logprobs):
            assert _max_diff(-loss, theirs) <= LOGPROB_TOLERANCE, rank
        for name, expected in reference_grads.items():
            assert _relative_error(trained["grads"][name], expected, name) <= GRADIENT_TOLERANCE, (rank, name)


def test_mtp_on_the_last_stage_gives_the_one_stage_gradients(two_ranks):
    for result in two_ranks:
        one_stage, two_stages = result["mtp", 1], result["mtp", 2]
        assert one_stage.keys() == two_stages.keys()
        assert any(name.startswith("mtp.") and grad.abs().max() > 0 for name, grad in one_stage.items())
        for name, expected in one_stage.items():
            assert _relative_error(two_stages[name], expected, name) <= GRADIENT_TOLERANCE, name


@pytest.mark.parametrize("architecture", list(CHECKPOINTS))
def test_every_rank_exports_every_tensor_once_and_gets_the_logprobs(architecture, references, two_ranks):
    reference, _ = references[architecture]
    checkpoint = load_file(CHECKPOINTS[architecture] / "model.safetensors")
    for result in two_ranks:
        names = result[architecture, "export"]
        assert len(names) == len(set(names)) and set(names) == set(checkpoint)
        assert _max_diff(result[architecture, "token_logprobs"], reference[0]) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("architecture", list(CHECKPOINTS))
def test_torch_dist_checkpoints_move_between_pp_1_and_pp_2_bit_exactly(architecture, two_ranks):
    checkpoint = load_file(CHECKPOINTS[architecture] / "model.safetensors")
    for result in two_ranks:
        for (written_at, read_at), exported in result[architecture, "checkpoints"].items():
            assert exported.keys() == checkpoint.keys(), (written_at, read_at)
            for name, tensor in checkpoint.items():
                assert torch.equal(exported[name], tensor), (written_at, read_at, name)


def test_loopcoder_refuses_pipeline_stages_saying_why():
    provider = build_provider(TINY / "loopcoder-tiny")
    with pytest.raises(ValueError, match=r"^LoopCoder: pipeline parallel size 2 .*loop 2 of layer l .*loop 1"):
        provider.check_parallel_layout(1, pp=2)
    with runtime.parallel():
        provider.check_parallel_layout(1, pp=1)


def test_a_pipeline_size_that_does_not_divide_the_layers_is_refused():
    provider = build_provider(CHECKPOINTS["llama"])
    layers = provider.hf_config.num_hidden_layers
    with pytest.raises(ValueError, match=rf"^pipeline parallel size {layers + 1} must divide the {layers} decoder"):
        provider.check_parallel_layout(1, pp=layers + 1)


@pytest.mark.parametrize("architecture", list(CHECKPOINTS))
def test_token_logprobs_with_sequence_or_context_parallel_stages_equal_transformers(architecture, references,
                                                                                   four_ranks):
    reference, _ = references[architecture]
    for layout in FOUR_RANK_LAYOUTS.keys() - {"pp2-tp2"}:
        for rank, result in enumerate(four_ranks):
            ours = result[layout, architecture, "token_logprobs"]  # the first SEQ - 1 of the reference's SEQ
            assert _max_diff(ours, reference[0][:, :-1]) <= LOGPROB_TOLERANCE, (layout, rank)


def test_cli_import_at_pp_2_then_export_at_pp_1_is_bit_exact(tmp_path):
    from modelzoo.conversion.cli import main

    folder = CHECKPOINTS["deepseek_v4"]
    assert main(["import", str(folder), str(tmp_path / "megatron"), "--pp", "2"]) == 0
    assert megatron_ckpt.read_metadata(tmp_path / "megatron")["written_at_pp"] == 2
    assert main(["export", str(tmp_path / "megatron"), str(tmp_path / "hf")]) == 0
    original, exported = load_file(folder / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())


def test_cli_parity_and_logprobs_at_pp_2(tmp_path, references):
    import json

    from modelzoo.conversion.cli import main

    assert main(["parity", str(CHECKPOINTS["llama"]), "--pp", "2", "--seq-len", "24", "--tolerance",
                 str(LOGPROB_TOLERANCE)]) == 0
    tokens = micro_batches()[0]["tokens"]
    (tmp_path / "tokens.json").write_text(json.dumps(tokens.tolist()))
    assert main(["logprobs", str(CHECKPOINTS["deepseek_v4"]), "--tokens", str(tmp_path / "tokens.json"),
                 "--out", str(tmp_path / "logprobs.json"), "--pp", "2", "--pack"]) == 0
    ours = torch.tensor(json.loads((tmp_path / "logprobs.json").read_text())["logprobs"])
    assert _max_diff(ours, references["deepseek_v4"][0][0]) <= LOGPROB_TOLERANCE


def test_cli_refuses_a_pipeline_size_that_does_not_divide_the_layers(capsys):
    from modelzoo.conversion.cli import main

    assert main(["parity", str(CHECKPOINTS["llama"]), "--pp", "3"]) == 2
    assert "pipeline parallel size 3 must divide the 2 decoder layers" in capsys.readouterr().err


@pytest.mark.parametrize("layout", [["--pp", "2", "--cp", "2"], ["--pp", "2", "--tp", "2", "--sp"]])
def test_cli_parity_with_sequence_or_context_parallel_stages(layout):
    from modelzoo.conversion.cli import main

    assert main(["parity", str(CHECKPOINTS["deepseek_v4"]), *layout, "--seq-len", "24", "--tolerance",
                 str(LOGPROB_TOLERANCE)]) == 0
