"""`tie_word_embeddings: true` and no head tensor in the checkpoint: the output head is the embedding matrix,
for `logprobs --backend hf`, for the Megatron model (TP 1 and 2), in training and through a round trip.

Oracle: the same weights written as an untied checkpoint whose head tensor is an explicit copy of the embedding
matrix, loaded by the architecture's HF class (transformers' own for Llama and DeepSeek-V4): no tying is involved.
LOGPROB_TOLERANCE = 1e-5 on fp32 token log-probabilities: the oracle runs the same math as `--backend hf`
(bit-equal expected) and the Megatron model differs by op order only (~1e-6); a random head is off by > 0.1.
GRAD_TOLERANCE = 1e-4 relative max-norm per tensor, as the architectures' own gradient tests; the embedding
gradient there is the sum of its input and output uses, missing either is an O(1) error.
"""

import json

import pytest
import torch
from tiny_checkpoints import make_tiny as make_tiny_module
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM, LlamaForCausalLM

from modelzoo.conversion.cli import main
from modelzoo import build_provider, runtime
from tiny_checkpoints.deepseek_v4_tiny import DEEPSEEK_V4_TINY, write_deepseek_v4_tiny
from modelzoo.loopcoder.hf_model import IQuestLoopCoderForCausalLM
from modelzoo.parity import logprobs_from_logits

LOGPROB_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4
ARCHITECTURES = ("llama", "loopcoder", "deepseek_v4")
HF_CLASS = {"llama": LlamaForCausalLM, "loopcoder": IQuestLoopCoderForCausalLM, "deepseek_v4": DeepseekV4ForCausalLM}
HEAD = {"llama": "lm_head.weight", "loopcoder": "lm_head.weight", "deepseek_v4": "head.weight"}
BUFFERS = ("ffn.gate.tid2eid", "ffn.gate.bias")  # DeepSeek-V4 checkpoint tensors that are buffers: no gradient


def write_tiny(folder, architecture: str, tie: bool):
    make_tiny = make_tiny_module
    if architecture == "deepseek_v4":
        write_deepseek_v4_tiny(folder, {**DEEPSEEK_V4_TINY, "tie_word_embeddings": tie})
        return folder
    base, shapes = {"llama": (make_tiny.LLAMA_TINY, make_tiny.llama_shapes),
                    "loopcoder": (make_tiny.LOOPCODER_TINY, make_tiny.loopcoder_shapes)}[architecture]
    config = {**base, "tie_word_embeddings": tie}
    make_tiny.write_checkpoint(folder, config, shapes(config))
    return folder


def explicit_head_copy(tied, folder, architecture: str):
    """The tied checkpoint untied: config says so and the head tensor is the embedding matrix, written out."""
    folder.mkdir()
    tensors = load_file(tied / "model.safetensors")
    tensors[HEAD[architecture]] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tied / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return folder


def tokens(architecture: str, seed: int = 0) -> torch.Tensor:
    vocab = DEEPSEEK_V4_TINY["vocab_size"] if architecture == "deepseek_v4" else 256
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(seed))


def hf_logprobs(folder, architecture: str, ids: torch.Tensor):
    """Token log-probs of the HF class on `folder`, after the backward of -mean(log-probs); and the model."""
    model = HF_CLASS[architecture].from_pretrained(folder, dtype=torch.float32).eval()
    logprobs = logprobs_from_logits(model(ids, use_cache=False).logits, ids)
    (-logprobs.mean()).backward()
    return logprobs.detach(), model


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoints(request, tmp_path_factory):
    architecture = request.param
    root = tmp_path_factory.mktemp(architecture)
    tied = write_tiny(root / "tied", architecture, tie=True)
    assert HEAD[architecture] not in load_file(tied / "model.safetensors")
    return architecture, tied, explicit_head_copy(tied, root / "explicit", architecture)


def run_logprobs(tmp_path, folder, ids, backend):
    """`modelzoo logprobs` of `ids`: (exit code, the output file)."""
    token_file, out = tmp_path / "tokens.json", tmp_path / "out.json"
    token_file.write_text(json.dumps(ids.tolist()))
    return main(["logprobs", str(folder), "--tokens", str(token_file), "--out", str(out), "--backend", backend]), out


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_logprobs_use_the_embedding_matrix_as_head(checkpoints, tmp_path, backend):
    architecture, tied, explicit = checkpoints
    ids = tokens(architecture)
    expected, model = hf_logprobs(explicit, architecture, ids)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # the oracle's head: a copy, not a tie
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    code, out = run_logprobs(tmp_path, tied, ids, backend)
    assert code == 0
    ours = torch.tensor(json.loads(out.read_text())["logprobs"])
    assert (ours - expected).abs().max().item() <= LOGPROB_TOLERANCE


def _tp2_rank(rank, folder, ids, overrides):
    with runtime.parallel(tp=2):
        provider = build_provider(folder, **overrides)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        exported = dict(provider.export_hf_weights(model))
        logprobs = provider.token_logprobs(model, ids)
        (-logprobs.mean()).backward()
        for param in model.parameters():  # export the gradients through the weight mapping: HF names, full tensors
            param.data = param.grad if param.grad is not None else torch.zeros_like(param)
        grads = dict(provider.export_hf_weights(model))
        return logprobs.detach(), exported, grads


def test_tp2_logprobs_gradients_and_round_trip(checkpoints, tmp_path):
    architecture, tied, explicit = checkpoints
    ids = tokens(architecture, seed=1)
    expected, _ = hf_logprobs(explicit, architecture, ids)
    # gradient reference: transformers' own tying (one parameter, both uses), named by checkpoint name through
    # save_pretrained of the model with each parameter replaced by its gradient
    _, model = hf_logprobs(tied, architecture, ids)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for param in model.parameters():
        param.data = param.grad if param.grad is not None else torch.zeros_like(param)
    model.save_pretrained(tmp_path / "grads")
    reference_grads = {name: grad for name, grad in load_file(tmp_path / "grads" / "model.safetensors").items()
                       if not name.endswith(BUFFERS)}
    source = load_file(tied / "model.safetensors")
    overrides = {"train_gate": True} if architecture == "loopcoder" else {}  # the HF reference trains its gates
    for logprobs, exported, grads in runtime.spawn(_tp2_rank, 2, tied, ids, overrides):
        assert (logprobs - expected).abs().max().item() <= LOGPROB_TOLERANCE
        assert exported.keys() == source.keys()  # no head written
        assert all(torch.equal(exported[name], tensor) for name, tensor in source.items())
        assert HEAD[architecture] not in grads
        for name, reference in reference_grads.items():
            scale = reference.abs().max().item()
            if scale == 0:  # no gradient path (DeepSeek-V4's indexer: a top-k of indices)
                assert grads[name].abs().max().item() == 0, name
                continue
            error = (grads[name] - reference).abs().max().item() / scale
            assert error <= GRAD_TOLERANCE, (name, error)


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_an_untied_checkpoint_without_its_head_is_refused_by_both_backends(tmp_path, capsys, backend):
    # transformers alone would initialise the missing head at random and only log it
    folder = write_tiny(tmp_path / "llama", "llama", tie=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    code, out = run_logprobs(tmp_path, folder, tokens("llama"), backend)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"modelzoo: error: {folder}") and "missing tensors lm_head.weight" in err
    assert not out.exists()
