"""Megatron's training machinery on modelzoo's models, on the CPU (gloo): the schedules, DDP, the distributed
optimizer and finalize_model_grads, driven the way Megatron-based trainers (SkyRL, Megatron-Bridge) drive them.

Four gloo ranks run every (architecture, layout) case in one spawn (process start-up and imports are most of its
cost, and four ranks cost the same wall time as two): TP 1 (four data-parallel replicas), TP 2 (two replicas of two
shards) and, for DeepSeek-V4, EP 2 (four data-parallel replicas; each expert lives on two of them, its
expert-data-parallel group). The oracle is one plain process at TP 1 without Megatron's wrappers: autograd,
`torch.nn.utils.clip_grad_norm_` and `torch.optim.AdamW` on the same micro-batches.

- The schedule (`get_forward_backward_func()`, 3 micro-batches per rank, DDP without the distributed optimizer so
  that its grad buffer holds whole reduced gradients): forward-only gives each micro-batch's per-token loss (1e-5
  absolute: the same fp32 math in another order moves it by ~1e-6). Training leaves in the grad buffer the gradient
  of the loss over every rank's micro-batches that the oracle differentiates, for both forms of `loss_func`:
  SkyRL's micro-batch mean (the schedule divides it by the micro-batch count, DDP averages over ranks) and
  Megatron-Bridge's token sum with its count (`calculate_per_token_loss`: finalize_model_grads divides by the count
  over all micro-batches and ranks). 1e-4 relative to the largest entry, the project's gradient tolerance:
  DeepSeek-V4's layer-0 hyper-connection scale is a sum with heavy cancellation, ~7e-5 from its float64 value at
  TP 2 (tests/deepseek_v4/test_parallel.py).
- Two steps of DDP + the distributed optimizer (Adam, weight decay, gradient clipping active, Megatron's scheduler
  setting each group's lr and weight decay) on 4 micro-batches per step, split over the data-parallel ranks, give
  the weights of two plain AdamW steps on the mean loss of the same 4 micro-batches: 1e-6 relative (max |difference|
  / max |weight| per tensor); the gradient norms agree to 1e-6 relative too. Megatron's conventions, which the
  oracle follows: no weight decay on biases and 1-D parameters; every trainable parameter has a gradient (DeepSeek-V4
  freezes its indexers and, with its loss off, its MTP layer: the loss reaches neither). Both with
  Megatron's default DDP settings and with the ones trainers use (overlapped reduce-scatter and all-gather, several
  buckets, fp32 reduction, averaging in the collective).
  Adam's eps is 1e-4 (about a tenth of a typical gradient entry here), not 1e-8: Adam divides each entry by
  sqrt(v) + eps, so an entry whose gradient is at fp32 rounding level (~1e-9, as cancellation makes in DeepSeek-V4's
  layer-0 `hc_attn_fn`) gets a step of up to lr from rounding alone, and any two summation orders (micro-batches,
  TP shards) then differ by that much. Measured with eps 1e-8: 4e-6 (Llama, TP 1) to 1.1e-3 (DeepSeek-V4,
  `hc_attn_fn`) relative on the weights, while the gradient norms still agree to 1e-7.
- LoopCoder's frozen loop gate is in no grad buffer and no optimizer, and is bit-identical after the steps.
- DeepSeek-V4's experts (`allreduce=False`) are in DDP's expert-parallel buffers, reduced over the
  expert-data-parallel group, and in the expert optimizer, as Megatron treats expert parameters.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import TINY

from modelzoo import build_provider, runtime

CHECKPOINTS = {"llama": TINY / "llama-tiny", "loopcoder": TINY / "loopcoder-tiny",
               "deepseek_v4": TINY / "deepseek-v4-tiny"}
WORLD_SIZE = 4
CASES = (("llama", 1, 1), ("llama", 2, 1), ("loopcoder", 1, 1), ("loopcoder", 2, 1), ("deepseek_v4", 1, 2),
         ("deepseek_v4", 2, 1))  # (architecture, tp, ep)
BUFFERS = ("ffn.gate.tid2eid", "ffn.gate.bias")  # DeepSeek-V4 checkpoint tensors that are buffers, not parameters

MICRO_BATCH_SIZE, SEQ = 2, 32
SCHEDULE_MICRO_BATCHES = 3           # per rank
STEP_MICRO_BATCHES, STEPS = 4, 2     # per step, split over the data-parallel ranks
LR, WEIGHT_DECAY, CLIP_GRAD, BETAS, EPS = 1e-3, 0.1, 0.5, (0.9, 0.95), 1e-4

# DistributedDataParallelConfig beyond use_distributed_optimizer: Megatron's defaults, and what trainers set
# (SkyRL, Megatron-Bridge): gradients reduced in fp32 and averaged in the collective, reduce-scatter overlapped with
# backward and the parameter all-gather with the next forward, in buckets small enough to make several
DDP_OPTIONS = {"default": {}, "overlapped": dict(grad_reduce_in_fp32=True, average_in_collective=True,
                                                 overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=20000)}

LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 1e-6


def micro_batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 250, (MICRO_BATCH_SIZE, SEQ + 1), generator=generator)
    loss_mask = torch.ones(MICRO_BATCH_SIZE, SEQ)
    loss_mask[:, : int(torch.randint(1, SEQ // 2, (), generator=generator))] = 0  # a prompt: no loss on it
    return dict(input_ids=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=loss_mask,
                position_ids=torch.arange(SEQ).expand(MICRO_BATCH_SIZE, SEQ))


def per_token_loss(model, batch: dict) -> torch.Tensor:
    """The trainer's model call (GPTModel's): the per-token loss [b, s]."""
    return model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """SkyRL's form: the micro-batch's mean over its loss tokens (the schedule divides it by the micro-batch count)."""
    loss = (output_tensor * loss_mask).sum() / loss_mask.sum()
    return loss, {"per_token_loss": output_tensor.detach()}


def token_sum_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-Bridge's form: the sum over loss tokens and their count. With `calculate_per_token_loss`,
    finalize_model_grads divides the gradients by the count summed over micro-batches and data-parallel ranks."""
    return (output_tensor * loss_mask).sum(), loss_mask.sum().int(), {"per_token_loss": output_tensor.detach()}


LOSS_FUNCS = {"micro-batch-mean": loss_func, "token-sum": token_sum_loss_func}


def make_forward_step(loss=loss_func):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output_tensor = per_token_loss(model, batch)
        return output_tensor, functools.partial(loss, batch["loss_mask"])

    return forward_step


def step_micro_batches() -> list[list[dict]]:
    return [[micro_batch(100 + STEP_MICRO_BATCHES * step + i) for i in range(STEP_MICRO_BATCHES)]
            for step in range(STEPS)]


def schedule_micro_batches(data_parallel_rank: int) -> list[dict]:
    return [micro_batch(10 * data_parallel_rank + i) for i in range(SCHEDULE_MICRO_BATCHES)]


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 1 or name.endswith(".bias")


def provider_and_model(architecture: str):
    provider = build_provider(CHECKPOINTS[architecture])
    model = provider.provide()
    provider.load_hf_weights(model, progress=False)
    return provider, model


def weights_as_hf(provider, model) -> dict[str, torch.Tensor]:
    """Full tensors by checkpoint name (collective over the model-parallel ranks)."""
    return {name: tensor.clone() for name, tensor in provider.export_hf_weights(model) if not name.endswith(BUFFERS)}


def gradients_as_hf(provider, model, gradient_of) -> dict[str, torch.Tensor]:
    """Each parameter replaced by its gradient (zero where it has none), exported: gradients by checkpoint name."""
    with torch.no_grad():
        for param in model.parameters():
            gradient = gradient_of(param)
            param.copy_(gradient if gradient is not None else torch.zeros_like(param))
    return weights_as_hf(provider, model)


# --- the ranks -------------------------------------------------------------------------------------------------------
def _ddp(model, use_distributed_optimizer: bool, **ddp_options):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, **ddp_options), model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def _run_schedule(ddp, forward_step, micro_batches: list[dict], forward_only: bool) -> list[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=ddp,
        num_microbatches=len(micro_batches), seq_length=SEQ, micro_batch_size=MICRO_BATCH_SIZE,
        forward_only=forward_only)


def _schedule_case(architecture: str) -> dict:
    """Forward-only, then training with each form of loss, through DDP without the distributed optimizer (its grad
    buffer holds the whole reduced gradients)."""
    from megatron.core import parallel_state

    micro_batches = schedule_micro_batches(parallel_state.get_data_parallel_rank())
    result = dict(grads={})
    for name, loss in LOSS_FUNCS.items():
        provider, model = provider_and_model(architecture)
        model.config.calculate_per_token_loss = loss is token_sum_loss_func  # read by DDP's constructor
        ddp = _ddp(model, use_distributed_optimizer=False)
        forward_step = make_forward_step(loss)
        if loss is loss_func:
            with torch.no_grad():
                outputs = _run_schedule(ddp, forward_step, micro_batches, forward_only=True)
            result["forward_only"] = [output["per_token_loss"] for output in outputs]
        ddp.zero_grad_buffer()
        _run_schedule(ddp, forward_step, micro_batches, forward_only=False)
        result["grads"][name] = gradients_as_hf(provider, model, lambda param: getattr(param, "main_grad", None))
    return result


def _group_ranks(group) -> list[int]:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)


def _step_case(architecture: str, ddp_options: dict) -> dict:
    """STEPS steps of DDP + the distributed optimizer, with Megatron's scheduler setting lr and weight decay."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    provider, model = provider_and_model(architecture)
    frozen_before = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    ddp = _ddp(model, use_distributed_optimizer=True, **ddp_options)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
        adam_eps=EPS, clip_grad=CLIP_GRAD, use_distributed_optimizer=True), [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=STEPS,
        lr_decay_style="constant", start_wd=WEIGHT_DECAY, end_wd=WEIGHT_DECAY, wd_incr_steps=STEPS,
        wd_incr_style="constant")
    forward_step = make_forward_step()
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    grad_norms = []
    for micro_batches in step_micro_batches():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        _run_schedule(ddp, forward_step, micro_batches[rank::size], forward_only=False)
        succeeded, grad_norm, _ = optimizer.step()
        assert succeeded
        scheduler.step(increment=1)
        grad_norms.append(grad_norm)

    def names(params) -> list[str]:
        params = list(params)
        return sorted(name for name, p in model.named_parameters() if any(p is q for q in params))

    buffered = [p for buffer in ddp.buffers for p in buffer.params]
    expert_buffered = [p for buffer in ddp.expert_parallel_buffers for p in buffer.params]
    # what each optimizer steps: the parameters of the grad buffers it shards (this rank holds a slice of them)
    optimized = [p for chained in optimizer.chained_optimizers for buffer in chained.buffers for p in buffer.params]
    expert_optimizers = [chained for chained in optimizer.chained_optimizers
                         if any(group["is_expert_parallel"] for group in chained.optimizer.param_groups)]
    # with overlap_param_gather the all-gather of the stepped shards waits for the next forward; before weights are
    # read outside a forward (evaluation, checkpoints, weight sync) Megatron-LM forces it, as here
    ddp.start_param_sync(force_sync=True)
    return dict(
        weights=weights_as_hf(provider, model),
        grad_norms=grad_norms, bucket_groups=len(ddp.bucket_groups),
        frozen_unchanged={name: torch.equal(p, frozen_before[name]) for name, p in model.named_parameters()
                          if not p.requires_grad},
        buffered=names(buffered), optimized=names(optimized), expert_buffered=names(expert_buffered),
        experts=names([p for p in model.parameters() if not getattr(p, "allreduce", True) and p.requires_grad]),
        expert_buffer_groups=[_group_ranks(b.data_parallel_group) for b in ddp.expert_parallel_buffers],
        dense_buffer_groups=[_group_ranks(b.data_parallel_group) for b in ddp.buffers],
        expert_optimizer_params=[names(p for buffer in chained.buffers for p in buffer.params)
                                 for chained in expert_optimizers],
        expert_optimizer_groups=[_group_ranks(chained.data_parallel_group) for chained in expert_optimizers],
        expert_data_parallel_group=_group_ranks(parallel_state.get_expert_data_parallel_group()),
        data_parallel_group=_group_ranks(parallel_state.get_data_parallel_group()),
    )


def _all_cases(rank: int) -> dict:
    results = {}
    for architecture, tp, ep in CASES:
        with runtime.parallel(tp=tp, ep=ep):
            results[architecture, tp, ep] = dict(schedule=_schedule_case(architecture), steps={
                name: _step_case(architecture, options) for name, options in DDP_OPTIONS.items()})
    return results


@pytest.fixture(scope="module")
def ranks():
    return runtime.spawn(_all_cases, WORLD_SIZE)


# --- the oracle: one plain process ----------------------------------------------------------------------------------
def _mean_loss(provider, model, architecture: str, micro_batches: list[dict]) -> torch.Tensor:
    losses = [loss_func(b["loss_mask"], per_token_loss(model, b))[0] for b in micro_batches]
    return torch.stack(losses).mean()


@functools.cache
def plain_schedule(architecture: str, data_parallel_size: int) -> dict:
    """Each rank's per-token losses, and the gradients of the two losses over all ranks' micro-batches: the mean over
    ranks of each rank's mean micro-batch loss, and the sum of token losses over the number of loss tokens."""
    per_rank = [schedule_micro_batches(rank) for rank in range(data_parallel_size)]
    every = [batch for micro_batches in per_rank for batch in micro_batches]
    result = dict(grads={})
    with runtime.parallel(tp=1):
        for name in LOSS_FUNCS:
            provider, model = provider_and_model(architecture)
            if name == "micro-batch-mean":
                with torch.no_grad():
                    result["forward_only"] = [[per_token_loss(model, batch)
                                               for batch in micro_batches] for micro_batches in per_rank]
                loss = torch.stack([_mean_loss(provider, model, architecture, mbs) for mbs in per_rank]).mean()
            else:
                token_losses = [per_token_loss(model, batch) * batch["loss_mask"]
                                for batch in every]
                loss = torch.stack([t.sum() for t in token_losses]).sum() / sum(b["loss_mask"].sum() for b in every)
            loss.backward()
            result["grads"][name] = gradients_as_hf(provider, model, lambda param: param.grad)
    return result


@functools.cache
def plain_steps(architecture: str) -> dict:
    with runtime.parallel(tp=1):
        provider, model = provider_and_model(architecture)
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            [dict(params=[p for name, p in trainable if not no_weight_decay(name, p)], weight_decay=WEIGHT_DECAY),
             dict(params=[p for name, p in trainable if no_weight_decay(name, p)], weight_decay=0.0)],
            lr=LR, betas=BETAS, eps=EPS)
        initial = weights_as_hf(provider, model)
        grad_norms = []
        for micro_batches in step_micro_batches():
            for _, param in trainable:
                param.grad = torch.zeros_like(param)  # Megatron's: every trainable parameter has a gradient
            _mean_loss(provider, model, architecture, micro_batches).backward()
            grad_norms.append(torch.nn.utils.clip_grad_norm_([p for _, p in trainable], CLIP_GRAD).item())
            optimizer.step()
        return dict(initial=initial, weights=weights_as_hf(provider, model), grad_norms=grad_norms)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    assert ours.shape == reference.shape
    scale = reference.abs().max().item()
    assert scale > 0, "a zero reference proves nothing"
    return (ours.double() - reference.double()).abs().max().item() / scale


# --- the tests ----------------------------------------------------------------------------------------------------
def case_id(case) -> str:
    architecture, tp, ep = case
    return f"{architecture}-tp{tp}" + (f"-ep{ep}" if ep > 1 else "")


def step_case_id(value) -> str:
    return case_id(value) if isinstance(value, tuple) else f"{value}-ddp"


def data_parallel_size(case) -> int:
    _, tp, _ = case
    return WORLD_SIZE // tp


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_schedule_forward_only_gives_each_micro_batch_its_loss(ranks, case):
    reference = plain_schedule(case[0], data_parallel_size(case))["forward_only"]
    for rank, result in enumerate(ranks):
        ours = result[case]["schedule"]["forward_only"]
        data_parallel_rank = rank // case[1]  # Megatron orders ranks tensor-parallel first
        assert len(ours) == SCHEDULE_MICRO_BATCHES
        for mine, expected in zip(ours, reference[data_parallel_rank], strict=True):
            assert (mine - expected).abs().max().item() <= LOSS_TOLERANCE


@pytest.mark.parametrize("loss", LOSS_FUNCS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_schedule_training_reduces_the_gradient_over_micro_batches_and_ranks(ranks, case, loss):
    reference = plain_schedule(case[0], data_parallel_size(case))["grads"][loss]
    for result in ranks:
        grads = result[case]["schedule"]["grads"][loss]
        assert grads.keys() == reference.keys()
        errors = {name: relative_error(grads[name], expected) for name, expected in reference.items()
                  if expected.abs().max() > 0}
        assert max(errors.values()) <= GRAD_TOLERANCE, max(errors.items(), key=lambda item: item[1])


@pytest.mark.parametrize(("case", "ddp"), [(case, ddp) for case in CASES for ddp in DDP_OPTIONS], ids=step_case_id)
def test_ddp_and_distributed_optimizer_steps_equal_plain_adamw_steps(ranks, case, ddp):
    reference = plain_steps(case[0])
    for result in ranks:
        step = result[case]["steps"][ddp]
        assert min(reference["grad_norms"]) > CLIP_GRAD, "clipping must be active for the test to cover it"
        assert (step["bucket_groups"] > 1) == (ddp == "overlapped")
        for ours, expected in zip(step["grad_norms"], reference["grad_norms"], strict=True):
            assert abs(ours - expected) <= WEIGHT_TOLERANCE * expected
        weights = step["weights"]
        assert weights.keys() == reference["weights"].keys()
        errors = {name: relative_error(weights[name], expected) for name, expected in reference["weights"].items()}
        moved = {name: relative_error(reference["initial"][name], expected)
                 for name, expected in reference["weights"].items()}
        print(f"{case_id(case)}, {ddp} DDP: max relative weight error {max(errors.values()):.2e} "
              f"(steps moved weights by up to {max(moved.values()):.2e})")
        assert max(errors.values()) <= WEIGHT_TOLERANCE, max(errors.items(), key=lambda item: item[1])
        # the steps move weights by far more than the tolerance (not all: the frozen parameters, LoopCoder's gate and
        # DeepSeek-V4's indexers and MTP layer, have neither an Adam step nor weight decay)
        assert sorted(moved.values())[len(moved) // 2] > 100 * WEIGHT_TOLERANCE


@pytest.mark.parametrize("ddp", DDP_OPTIONS)
@pytest.mark.parametrize("case", [case for case in CASES if case[0] == "loopcoder"], ids=case_id)
def test_frozen_loop_gate_is_in_no_buffer_and_stays_bit_identical(ranks, case, ddp):
    for result in ranks:
        step = result[case]["steps"][ddp]
        gates = {f"decoder.layers.{i}.self_attention.loop_gate.{p}" for i in range(2) for p in ("weight", "bias")}
        assert set(step["frozen_unchanged"]) == gates
        assert all(step["frozen_unchanged"].values())
        assert not gates & set(step["buffered"] + step["expert_buffered"] + step["optimized"])


def test_experts_are_reduced_and_optimised_over_the_expert_data_parallel_group(ranks):
    for result in ranks:
        step = result["deepseek_v4", 1, 2]["steps"]["default"]
        assert step["experts"] and step["expert_buffered"] == step["experts"]
        assert not set(step["experts"]) & set(step["buffered"])
        assert step["expert_buffer_groups"] == [step["expert_data_parallel_group"]]
        assert step["dense_buffer_groups"] == [step["data_parallel_group"]]
        assert len(step["expert_data_parallel_group"]) == 2 and len(step["data_parallel_group"]) == 4
        assert step["expert_optimizer_params"] == [step["experts"]]
        assert step["expert_optimizer_groups"] == [step["expert_data_parallel_group"]]
