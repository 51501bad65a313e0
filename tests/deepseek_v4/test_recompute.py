"""DeepSeek-V4 activation recompute, named as Megatron's TransformerConfig names it.

Recompute re-runs the same operations on the same inputs in the backward, so on the CPU the loss and every
gradient must equal the run without recompute bit for bit (no tolerance): exact and fast attention, a plain
batch and a packed row. Each setting must also recompute what it names (the module runs again in the
backward), except the indexer, whose picks the recompute gets back from the forward (it runs once), and a name
this model has no piece for is refused by name. With `keep_attention_output` the recompute gets the attention's
output from the forward: the attention runs once per layer, and the loss and gradients are still bit-equal.
"""

from unittest import mock

import pytest
import torch
from dsv4_helpers import provider_for, random_tokens, write_tiny

from modelzoo import runtime
from modelzoo.deepseek_v4.model import window_attention
from modelzoo.layers.sequences import pack_sequences

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
SETTINGS = {
    "full-uniform-2": FULL,
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective-all": dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "moe"]),
}


# what the hooks count in each layer, as calls begin (a recompute stops once it holds every tensor the backward
# needs, so a module's call may begin and not return)
PIECES = ("self_attention", "self_attention.compressor", "input_layernorm", "mlp")
INDEXER = "self_attention.compressor.indexer"
COUNTED = PIECES + (INDEXER,)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("dsv4-recompute") / "deepseek-v4-tiny")


def _step(tiny, attention: str, packed: bool, **overrides):
    """The summed per-token loss and every gradient, and how often each layer's pieces ran."""
    provider = provider_for(tiny, attention=attention, **overrides)
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    calls: dict[str, int] = {}
    for name, module in model.named_modules():
        if name.startswith("decoder.layers.") and name.count(".") >= 3 and name.split(".", 3)[3] in COUNTED:
            module.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    if packed:
        batch = pack_sequences([random_tokens(1, n, seed=n)[0].tolist() for n in (17, 40, 5)])
        ids, kwargs = batch.input_ids, dict(packed_seq_params=batch.packed_seq_params)
    else:
        ids, kwargs = random_tokens(batch=2, seq=48), {}
    loss = model(ids, None, None, labels=torch.roll(ids, -1, dims=1), **kwargs).sum()
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    return loss.detach(), grads, calls


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("attention", ["exact", "fast"])
def test_recompute_gives_the_same_loss_and_gradients(tiny, attention, packed):
    with runtime.parallel():
        loss, grads, calls = _step(tiny, attention, packed)
        assert set(calls.values()) == {1}
        for setting, overrides in SETTINGS.items():
            recomputed_loss, recomputed_grads, recomputed_calls = _step(tiny, attention, packed, **overrides)
            assert torch.equal(recomputed_loss, loss), setting
            assert recomputed_grads.keys() == grads.keys(), setting
            unequal = [name for name in grads if not torch.equal(recomputed_grads[name], grads[name])]
            assert not unequal, f"{setting}: gradients differ in {unequal}"
            indexers = {name: count for name, count in recomputed_calls.items() if name.endswith(INDEXER)}
            assert indexers and set(indexers.values()) == {1}, f"{setting}: indexer calls {indexers}"
            ran_twice = {name for name, count in recomputed_calls.items() if count == 2}
            if setting == "full-uniform-2":      # every layer, in runs of two
                assert ran_twice == set(calls) - indexers.keys(), setting
            elif setting == "full-block-1":      # the first layer only
                first_layer = {name for name in calls if name.startswith("decoder.layers.0.")}
                assert ran_twice == first_layer - indexers.keys(), setting
            else:  # inside each layer: the compressor with the attention core, the norms, the MoE; not the projections
                assert ran_twice == {name for name in calls if name.endswith((".compressor", ".input_layernorm",
                                                                                ".mlp"))}, setting
                assert any(name.endswith(".compressor") for name in ran_twice)


def test_a_recompute_module_this_model_does_not_have_is_refused(tiny):
    with runtime.parallel():
        provider = provider_for(tiny, recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
        with pytest.raises(ValueError, match="DeepSeek-V4: recompute_modules 'mlp' names no piece of this model; "
                                             "it recomputes 'core_attn' .*'layernorm' .*'moe'"):
            provider.provide()


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_kept_attention_outputs_are_not_recomputed(tiny, packed):
    def attends(**overrides):
        with mock.patch.object(window_attention, "_attend", wraps=window_attention._attend) as attend:
            return *_step(tiny, "fast", packed, **overrides)[:2], attend.call_count

    with runtime.parallel():
        loss, grads, calls = attends()
        _, _, recomputed_calls = attends(**FULL)
        assert recomputed_calls > calls                           # the oracle: full recompute attends again
        kept_loss, kept_grads, kept_calls = attends(**FULL, keep_attention_output=True)
        assert kept_calls == calls
        assert torch.equal(kept_loss, loss)
        assert kept_grads.keys() == grads.keys()
        assert not [name for name in grads if not torch.equal(kept_grads[name], grads[name])]


@pytest.mark.parametrize("overrides", [dict(attention="exact", **FULL), dict(attention="fast")], ids=["exact", "no-recompute"])
def test_keeping_attention_outputs_without_a_full_recompute_of_the_fast_path_is_refused(tiny, overrides):
    with pytest.raises(ValueError, match="DeepSeek-V4: keep_attention_output=True keeps the fast attention's output "
                                         "across a full recompute: it needs attention='fast' and "
                                         "recompute_granularity='full'"):
        provider_for(tiny, keep_attention_output=True, **overrides)
