"""DeepSeek-V4.1's fast attention (`attention="fast"`: each query over its window keys and its picked latents, V4's
window attention) against the exact path (dense [S, S + T] masks, the reference's ops), layer by layer.

Every attention layer of deepseek-v41-tiny (sliding-only, ratio-2 and ratio-1 KV sources, reuse, re-index, the
candidate source) runs both paths on the same inputs inside one forward: the attention output and the gradients of a
fixed random probe of it with respect to the layer's input (through the compressor of a KV source), its queries
and its window keys. Plain rows [2, 64] (past the window 8, the top-k 8 and the candidate budget) and a packed row
of sequences of 3, 21 and 34 tokens (each sequence a right-padded row of its own). LAYER_TOLERANCE = 1e-5 of each
tensor's largest magnitude: the same fp32 math summed in another order (measured at most 3.3e-7 on the outputs); a
window key or pick missed or added moves the output by a whole key's share of the softmax (~1e-1). Each path reads
the state in its own form (the fast path's picks are ids: the exact path's masks turned into ids), and what the index
sources publish must be the same picks: the fast path's ids mark exactly the exact path's masks, scored a few
queries at a time (`PICK_CHUNK_SCORES` made small, so that every row is scored in several chunks).

Where a GPU is present (the model's device: `runtime.device()`) the same comparison runs the fast path's picks through V4's sparse Triton kernels (fp32
products in IEEE precision) and the window-only layers through the dense blocks.

On the fast path memory grows linearly with the length: in a training step no op returns a tensor that grows faster
than the row, with the per-chunk budgets (the picks' and V4's CPU window blocks') made small so that rows of 512 and
1024 tokens are past them.

The model-level checks (log-probs against the reference, gradients, context parallelism, recompute) run the fast
path in test_v41_context_parallel.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from dsv41_helpers import V41_TINY, random_rows

from modelzoo import build_provider, runtime
from modelzoo.deepseek_v41.hf_model import CompressedState
from modelzoo.deepseek_v41.model import attention as attention_module
from modelzoo.deepseek_v41.model.attention import (DeepseekV41Attention, latents_in_blocks, picked_mask,
                                                   state_values)
from modelzoo.layers.sequences import pack_sequences

LAYER_TOLERANCE = 1e-5
LENGTHS = (3, 21, 34)
CHUNK_SCORES = 1000  # rows of 16 to 64 latents scored 7 to 31 queries at a time


def mask_ids(mask: torch.Tensor, k: int) -> torch.Tensor:
    """A mask [..., T] as ids [..., min(k, T)] of its set entries, -1 for an empty slot (it holds at most k)."""
    chosen, ids = mask.to(torch.uint8).topk(min(k, mask.shape[-1]), dim=-1)
    return torch.where(chosen.bool(), ids, -1)


def as_ids(read: tuple, attention: DeepseekV41Attention) -> tuple:
    """The exact path's state values with its masks as the fast path's ids."""
    state = CompressedState(*read)
    if state.selected is not None:
        state.selected = mask_ids(state.selected, attention.index_topk)
    if state.candidates is not None:  # a block's latents are all in or all out: its first says which
        blocks = state.candidates[..., ::attention.candidate_block_size]
        state.candidates = mask_ids(blocks, attention.candidate_topk_blocks)
    return state_values(state)


def _both_paths(records: list, original):
    """A `DeepseekV41Attention.core` that also runs both paths on detached copies of the inputs and records
    (layer, {path: (output, input grads...)}, {path: the state it publishes}, its candidate block size); the forward goes on with the exact
    path's output."""

    def core(self, x, q_residual, queries, keys, shares, *read):
        results, published = {}, {}
        for path in ("exact", "fast"):
            self.attention = path
            inputs = [tensor.detach().requires_grad_() for tensor in (x, queries, keys)]
            with torch.enable_grad():
                attended, *after = original(self, inputs[0], q_residual, *inputs[1:], shares,
                                            *(as_ids(read, self) if path == "fast" else read))
                probe = torch.randn(attended.shape, generator=torch.Generator().manual_seed(self.layer_idx))
                probe = probe.to(attended.device)
                attended.backward(probe)
            results[path] = (attended.detach(), *(tensor.grad for tensor in inputs))
            published[path] = CompressedState(*after)
        records.append((self.layer_idx, results, published, self.candidate_block_size))
        self.attention = "exact"
        return original(self, x, q_residual, queries, keys, shares, *read)

    return core


def layer_records() -> dict[str, list]:
    """Per form, each attention layer's (layer, {path: (output, input grads...)}) from one forward of the model."""
    device = runtime.device()
    rows = random_rows(2, 64, seed=0).to(device)
    batch = pack_sequences([random_rows(1, length, seed=length)[0].tolist() for length in LENGTHS])
    recorded = {"rows": [], "packed": []}
    original = DeepseekV41Attention.core
    with runtime.parallel(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_module, "PICK_CHUNK_SCORES", CHUNK_SCORES)
        provider = build_provider(V41_TINY)
        model = provider.provide()
        provider.load_hf_weights(model, progress=False)
        with torch.no_grad():
            patch.setattr(DeepseekV41Attention, "core", _both_paths(recorded["rows"], original))
            model(rows)
            patch.setattr(DeepseekV41Attention, "core", _both_paths(recorded["packed"], original))
            model(batch.input_ids.to(device), packed_seq_params=batch.packed_seq_params)
    return recorded


def check(records: dict[str, list], form: str) -> None:
    layers = records[form]
    assert [layer for layer, *_ in layers] == list(range(10))
    for layer, results, published, block_size in layers:
        exact, fast = published["exact"], published["fast"]
        if exact.selected is not None:
            width = exact.selected.shape[-1]
            assert torch.equal(picked_mask(fast.selected, width), exact.selected), (form, layer)
        if exact.candidates is not None:
            assert torch.equal(latents_in_blocks(fast.candidates, width, block_size), exact.candidates), (form, layer)
        for name, exact, fast in zip(("output", "x grad", "query grad", "key grad"), results["exact"],
                                     results["fast"], strict=True):
            if name == "x grad" and exact is None:  # only a KV source's compressor reads x with a gradient
                assert fast is None and layer not in (2, 4, 6), (form, layer)
                continue
            scale = exact.abs().max().item()
            assert scale > 0, (form, layer, name)
            assert (fast - exact).abs().max().item() <= LAYER_TOLERANCE * scale, (form, layer, name)


@pytest.fixture(scope="module")
def records():
    return layer_records()


@pytest.mark.parametrize("form", ["rows", "packed"])
def test_every_layer_attends_alike_on_both_paths(records, form):
    check(records, form)


def test_the_kernels_attend_alike_in_triton_interpreter(run_in_triton_interpreter):
    """CPU tensors through Triton's interpreter: the fast path's picks through V4's sparse attention kernels and the
    index sources' scores through its masked-index kernel, as on a GPU."""
    run_in_triton_interpreter(__file__)


def test_ids_mark_their_latents_and_blocks():
    ids = torch.tensor([[[-1, -1, -1], [4, 1, -1], [0, 5, 2]]])
    assert picked_mask(ids, 6).tolist() == [[[False] * 6, [False, True, False, False, True, False],
                                             [True, False, True, False, False, True]]]
    blocks = torch.tensor([[[2, -1], [0, 1]]])  # blocks of 3 latents, the last one partly filled
    assert latents_in_blocks(blocks, 7, 3).int().tolist() == [[[0, 0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1, 0]]]


class LargestTensor(TorchDispatchMode):
    """The most numbers any op returned while active, and that op's (name, shape)."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.numel:
                self.numel, self.op = tensor.numel(), (str(func), tuple(tensor.shape))
        return out


def test_the_fast_path_holds_nothing_that_grows_with_the_square_of_the_length(tmp_path, monkeypatch):
    """A training step (forward + backward) of one row of 512 and of 1024 tokens (1024 latents at the ratio-1
    layers): the largest tensor any op returns doubles on the fast path (measured: a [1, S, 4, 4, 64]
    product) and quadruples on the exact path (its [heads, S, S + T] scores), the probe's check that
    it sees a quadratic term. The picks score 2^14 query-latent pairs at a time and V4's window blocks 2^16 scores."""
    from modelzoo.deepseek_v4.model import window_attention

    monkeypatch.setattr(attention_module, "PICK_CHUNK_SCORES", 1 << 14)
    monkeypatch.setattr(window_attention, "SCORE_BUDGET", 1 << 16)
    folder = tmp_path / "deepseek-v41-tiny-1024"
    shutil.copytree(V41_TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 1024
    (folder / "config.json").write_text(json.dumps(config))
    largest = {}
    with runtime.parallel():
        for path in ("fast", "exact"):
            provider = build_provider(folder, attention=path)
            model = provider.provide()
            provider.load_hf_weights(model, progress=False)
            for length in (512, 1024):
                rows = random_rows(1, length, seed=0).to(runtime.device())
                probe = LargestTensor()
                with probe:
                    model(rows, labels=rows).sum().backward()
                largest[path, length] = probe.numel
    assert largest["fast", 1024] <= 2 * largest["fast", 512], largest
    assert largest["exact", 1024] >= 3.9 * largest["exact", 512], largest


if __name__ == "__main__":  # under TRITON_INTERPRET=1 (the test above): the kernels on CPU tensors
    from unittest import mock

    from modelzoo.deepseek_v4.model import index_kernels, indexer, sparse_attention_kernels, window_attention

    with mock.patch.object(window_attention, "_sparse_kernels", lambda q, kv: sparse_attention_kernels), \
            mock.patch.object(indexer, "index_kernels_for", lambda q: index_kernels):
        recorded = layer_records()
    for form in recorded:
        check(recorded, form)
