"""LoRA adapters on Megatron-Core linears, sharded the way the adapted layer is, with no extra collective.

    y = W x + (alpha / r) * B A dropout(x)        A [r, in] random, B [out, r] zero at the start

| adapted layer                      | A [r, in]            | B [out, r]         | its one TP collective          |
|------------------------------------|----------------------|--------------------|--------------------------------|
| ColumnParallelLinear (W rows / tp) | replicated           | rows split like W  | backward: all-reduce [dx, dAx] |
| RowParallelLinear (W cols / tp)    | columns split like W | replicated         | forward: all-reduce [Wx, Ax]   |
| replicated (full W on every rank)  | replicated           | replicated         | none                           |

Why the sums ride on the base layer's collective. Row-parallel: rank i holds x_i and A_i, so A x = sum_i A_i x_i
needs the same all-reduce as W x = sum_i W_i x_i; reducing [W_i x_i, A_i x_i] together and applying the replicated
B after it gives every rank the same A x, so B's gradient is already complete on each rank. Column-parallel: rank
i computes its output rows with B_i, so the gradient reaching A x is a sum over ranks of B_i^T g_i, exactly like the
input gradient sum_i W_i^T g_i that the base layer all-reduces; the base layer's own all-reduce is switched off
(Megatron's `disable_grad_reduce`, meant for this) and one all-reduce of [dx_i, d(Ax)_i] replaces it.

The adapted module keeps its name, its parameters and its class (a subclass is swapped in), so the weight mapping,
torch_dist sharding and every `isinstance` check see the base layer unchanged; its adapter is the child `lora`
(`<module>.lora.A`, `<module>.lora.B`). The base is frozen and never modified.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from modelzoo import runtime
from modelzoo.compat import adapt_in_place, row_parallel_local_output
from modelzoo.conversion.engine import ShardLayout
from modelzoo.conversion.transforms import FusedGateUp
from modelzoo.lora.targets import compile_module_pattern, projections, resolve, weight_rule

COLUMN, ROW, REPLICATED = "column", "row", "replicated"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    targets: tuple[str, ...] = ("all-linear",)  # names: see modelzoo/lora/targets.py
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    seed: int = 0  # A is drawn from (seed, module name) at its full shape: the same adapter at every TP size

    def __post_init__(self):
        # every value checked by type and range before it sizes an adapter or reaches adapter_config.json
        # (a config read back from a checkpoint's lora.json may hold anything JSON holds)
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        elif isinstance(self.targets, (list, tuple)) and all(isinstance(target, str) for target in self.targets):
            object.__setattr__(self, "targets", tuple(self.targets))
        else:
            raise ValueError(f"LoRA targets must be a name or a list of names, got {self.targets!r:.80}")
        if not _is_int(self.rank) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r:.80}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"LoRA seed must be an integer in [0, 2**63), got {self.seed!r:.80}")
        if not _is_real(self.alpha) or not math.isfinite(self.alpha):
            raise ValueError(f"LoRA alpha must be a finite number, got {self.alpha!r:.80}")
        if not _is_real(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be a number in [0, 1), got {self.dropout!r:.80}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class LoRAAdapter(nn.Module):
    """A and B of one adapted linear, this rank's shards; `projections` are the selected outputs of a fused layer."""

    def __init__(self, kind: str, name: str, base_weight: torch.Tensor, full_out: int, full_in: int,
                 config: LoRAConfig, projections: tuple[int, ...], output_mask: torch.Tensor | None):
        super().__init__()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.kind, self.config, self.projections = kind, config, projections
        self.scale = config.scale
        self.dropout = nn.Dropout(config.dropout)
        # PEFT's init of A (kaiming-uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn at the full shape
        generator = torch.Generator().manual_seed(zlib.crc32(f"{config.seed}:{name}".encode()))
        bound = 1.0 / math.sqrt(full_in)
        full_a = torch.empty(config.rank, full_in).uniform_(-bound, bound, generator=generator)
        local_a = full_a.chunk(tp, dim=1)[tp_rank] if kind == ROW else full_a
        local_out = full_out // tp if kind == COLUMN else full_out
        # on a model built on the meta device (export-adapter needs no base weights) the adapter is real
        like = dict(dtype=base_weight.dtype, device=runtime.device() if base_weight.is_meta else base_weight.device)
        self.A = nn.Parameter(local_a.to(**like).contiguous())
        self.B = nn.Parameter(torch.zeros(local_out, config.rank, **like))
        for param in (self.A, self.B):  # the weight engine moves base weights; adapters have their own export
            param.is_lora_adapter = True
        for param, split_dim in ((self.A, 1 if kind == ROW else None), (self.B, 0 if kind == COLUMN else None)):
            if split_dim is None:
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
            else:
                tensor_parallel.set_tensor_model_parallel_attributes(param, is_parallel=True, dim=split_dim, stride=1)
        # rows of B that belong to projections not asked for stay out of the product (and get no gradient)
        self.register_buffer("output_mask", None if output_mask is None else output_mask.to(**like), persistent=False)

    def effective_B(self) -> torch.Tensor:
        return self.B if self.output_mask is None else self.B * self.output_mask

    def down(self, x: torch.Tensor) -> torch.Tensor:
        """A dropout(x). A row-parallel input is split over ranks, so its dropout draws from the per-rank stream."""
        if self.kind == ROW and self.training and self.dropout.p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.linear(self.dropout(x), self.A)
        return F.linear(self.dropout(x), self.A)

    def up(self, z: torch.Tensor) -> torch.Tensor:
        return F.linear(z, self.effective_B()) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return {**sharded_like(self.A, self.A, f"{prefix}A", sharded_offsets),
                **sharded_like(self.B, self.B, f"{prefix}B", sharded_offsets)}


def sharded_like(param: nn.Parameter, tensor: torch.Tensor, key: str, sharded_offsets: tuple = ()) -> dict:
    """torch_dist entry of `tensor` (the parameter or an optimizer tensor of its shape), split like `param`."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {key: param.partition_dim} if getattr(param, "tensor_model_parallel", False) else {}
    sharded = make_sharded_tensors_for_checkpoint({key: tensor}, "", axes, sharded_offsets)
    if getattr(param, "gate_up_rows", False):
        # each rank holds [gate_r; up_r] (FusedGateUp): saved as two halves, as Megatron saves linear_fc1's
        # weight, so the checkpoint is the same at every TP size
        sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets)
    return sharded


class LoRALayer:
    """Marker base of every adapted layer; `lora` is its LoRAAdapter."""

    lora: LoRAAdapter


class _CopyPairToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; the backward sums both gradients over the TP group in one all-reduce."""

    @staticmethod
    def forward(ctx, x, z, group):
        ctx.group, ctx.widths = group, (x.shape[-1], z.shape[-1])
        return x.view_as(x), z.view_as(z)

    @staticmethod
    def backward(ctx, grad_x, grad_z):
        if not ctx.needs_input_grad[0]:  # the first adapted layer after a frozen embedding: nothing flows to x
            dist.all_reduce(grad_z, group=ctx.group)
            return None, grad_z, None
        joint = torch.cat([grad_x, grad_z], dim=-1)
        dist.all_reduce(joint, group=ctx.group)
        grad_x, grad_z = joint.split(ctx.widths, dim=-1)
        return grad_x, grad_z, None


class _ColumnLoRA(LoRALayer):
    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is not None or runtime_gather_output:
            raise ValueError("a LoRA-adapted ColumnParallelLinear takes neither `weight` nor `runtime_gather_output`")
        lora_in = self.lora.down(input_)
        if dist.get_world_size(self.tp_group) > 1:
            input_, lora_in = _CopyPairToTensorParallelRegion.apply(input_, lora_in, self.tp_group)
        output, bias = super().forward(input_)
        return output + self.lora.up(lora_in), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state.update(self.lora.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata))
        return state


class _RowLoRA(LoRALayer):
    def forward(self, input_):
        # RowParallelLinear.forward with the adapter's input joined to its all-reduce
        output_parallel = row_parallel_local_output(self, input_)
        lora_in = self.lora.down(input_)
        if dist.get_world_size(self.tp_group) > 1:
            joint = tensor_parallel.reduce_from_tensor_model_parallel_region(
                torch.cat([output_parallel, lora_in], dim=-1), group=self.tp_group)
            output_parallel, lora_in = joint.split([output_parallel.shape[-1], lora_in.shape[-1]], dim=-1)
            lora_in = lora_in.clone()  # B's gradient saves its input: keep this small copy, not the joint buffer
        output = output_parallel + self.lora.up(lora_in)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state.update(self.lora.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata))
        return state


class _ReplicatedLoRA(LoRALayer):
    def forward(self, input_, *args, **kwargs):
        output = super().forward(input_, *args, **kwargs)
        delta = self.lora.up(self.lora.down(input_))
        if isinstance(output, tuple):
            return (output[0] + delta, *output[1:])
        return output + delta


_MIXINS = {COLUMN: _ColumnLoRA, ROW: _RowLoRA, REPLICATED: _ReplicatedLoRA}
_LORA_CLASSES: dict[tuple[str, type], type] = {}


def _lora_class(kind: str, base: type) -> type:
    key = (kind, base)
    if key not in _LORA_CLASSES:
        _LORA_CLASSES[key] = type(f"LoRA{base.__name__}", (_MIXINS[kind], base), {"__module__": __name__})
    return _LORA_CLASSES[key]


def _kind(module: nn.Module, name: str) -> str:
    """How the layer is split over tensor parallelism; a layout the adapter cannot follow is refused here."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"LoRA cannot adapt {name} ({type(module).__name__}): {why}")

    if isinstance(module, RowParallelLinear):
        if type(module).forward is not RowParallelLinear.forward:
            raise refuse("its forward is not RowParallelLinear's, which the adapter re-implements")
        if not module.input_is_parallel or module.sequence_parallel or module.explicit_expert_comm:
            raise refuse("only input_is_parallel=True without sequence parallelism or expert communication "
                         "is supported")
        return ROW
    if isinstance(module, ColumnParallelLinear):
        if module.weight is None or module.gather_output or module.sequence_parallel or module.explicit_expert_comm:
            raise refuse("only an owned weight, gather_output=False, no sequence parallelism and no expert "
                         "communication are supported")
        if getattr(module, "kv_copies", 1) > 1:
            raise refuse("its key/value rows are copies of fewer KV heads than tensor-parallel ranks, which B's "
                         "rows would not stay; adapt it at a TP size that divides the KV heads")
        return COLUMN
    weight = getattr(module, "weight", None)
    if isinstance(weight, nn.Parameter) and weight.dim() == 2 and not getattr(weight, "tensor_model_parallel", False):
        return REPLICATED
    raise refuse("it is neither a Column/RowParallelLinear nor a linear with a replicated 2-D weight")


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALayer]]:
    """(module name, adapted module) in module order."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALayer):
            yield name, module


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {f"{name}.lora.{key}": param
            for name, layer in lora_layers(model) for key, param in layer.lora.named_parameters()}


def resolve_targets(provider, names) -> dict[str, tuple[str, ...]]:
    """Module pattern -> HF projection names that LoRA would adapt for `names` (raises on refused / unknown)."""
    mapping = provider.mapping()
    selection = resolve(provider.lora_targets(), mapping, names, provider.name)
    return {module: tuple(projections(mapping, module)[i].rsplit(".", 1)[-1] for i in indices)
            for module, indices in selection.items()}


def apply_lora(model: nn.Module, provider, config: LoRAConfig) -> list[str]:
    """Freeze `model` and adapt the targets of `config` in place; returns the adapted module names.

    Call it after the base weights are loaded. Another model from the same provider (a reference model)
    is not affected. Every target is checked before anything changes.
    """
    if any(True for _ in lora_layers(model)):
        raise ValueError("this model already has LoRA adapters")
    if getattr(getattr(model, "config", None), "sequence_parallel", False):
        # checked on the model: a batch-first model's linears run on the gathered sequence and do not say so
        raise ValueError("LoRA: sequence parallelism is not supported; build the model with sequence_parallel=False")
    mapping = provider.mapping()
    selection = resolve(provider.lora_targets(), mapping, config.targets, provider.name)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    modules = dict(model.named_modules())
    plan = []
    for pattern, selected in selection.items():
        regex = compile_module_pattern(pattern)
        matched = [name for name in modules if regex.match(name)]
        if not matched:
            raise ValueError(f"LoRA target table of {provider.name}: {pattern} matches no module of this model")
        rule = weight_rule(mapping, pattern)
        plan += [(name, modules[name], _kind(modules[name], name), rule, selected) for name in matched]

    for param in model.parameters():
        param.requires_grad_(False)
    for name, module, kind, rule, selected in plan:
        full_out, full_in = ShardLayout(module.weight).full_shape(module.weight)
        mask = _output_mask(rule, selected, full_out, tp, kind)
        adapter = LoRAAdapter(kind, name, module.weight, full_out, full_in, config, selected, mask)
        adapter.B.gate_up_rows = kind == COLUMN and isinstance(rule.transform, FusedGateUp)  # see sharded_like
        adapt_in_place(module, _lora_class(kind, type(module)))
        module.lora = adapter
        if kind == COLUMN:  # the adapter's backward all-reduce carries the base layer's input gradient
            module.disable_grad_reduce, module.allreduce_dgrad = True, False
    return [name for name, *_ in plan]


def _output_mask(rule, selected: tuple[int, ...], full_out: int, tp: int, kind: str) -> torch.Tensor | None:
    """[out rows of this rank, 1]: 1 on rows of selected projections, built with the mapping's own fused layout."""
    if len(selected) == len(rule.hf_patterns):
        return None
    rows = [t.shape[0] for t in rule.transform.to_hf(torch.empty(full_out, 1, device="meta"), tp)]
    parts = [torch.full((n, 1), float(i in selected)) for i, n in enumerate(rows)]
    mask = rule.transform.to_megatron(parts, torch.Size([full_out, 1]), tp)
    if kind == COLUMN:
        mask = mask.chunk(tp, dim=0)[parallel_state.get_tensor_model_parallel_rank()]
    return mask
