"""The one place where modelzoo touches private behaviour of Megatron-Core, torch and transformers.

Each entry names what it relies on and the version it was written against and tested with (Megatron-Core 0.19.2,
torch 2.14.1 on the CPU and 2.11 on the GPU machines, transformers 5.24, megatron-bridge 0.6.2): a new version of
one of them is checked here first. Everything else in modelzoo uses their public API.

Used on every machine: `row_parallel_local_output`, `adapt_in_place` (LoRA), `PassedAsPackedSeqParams`
(the batch layout handed through Megatron's TransformerBlock), `share_embedding_across_stages` (DeepSeek-V4's
pipeline stages), `TORCH_DCP_PICKLED_GLOBALS` and `storage_info_class` (reading torch_dist metadata without
unpickling arbitrary globals), `stand_in_module` (an import a library makes of a module that no longer exists).

CPU patches. Megatron-Core 0.19 assumes a GPU in a handful of places. None of them matter for the math, so on a
machine without CUDA (CI, laptops, the parity tests) we replace exactly those places. Every patch is
applied by `apply()`, only when `torch.cuda.is_available()` is False, and each has a test in
`tests/test_compat.py`. On a GPU machine `apply()` does nothing.

| upstream                                                        | why it fails without CUDA                     |
|-----------------------------------------------------------------|-----------------------------------------------|
| RotaryEmbedding.get_emb (models/common/embeddings)              | moves `inv_freq` to torch.cuda.current_device()|
| transformer.utils.get_default_causal_mask (and its importers)   | allocates the mask on "cuda"                  |
| tensor_parallel.random: _get/_set_cuda_rng_state, the RNG tracker| reads and seeds the CUDA generator            |
| MoEAlltoAllTokenDispatcher.__init__                             | creates a torch.cuda.Stream                   |
| dist_checkpointing's save/load strategies                       | torch.cuda.synchronize(), status tensors on   |
|                                                                 | torch.cuda.current_device()                   |
| utils (GlobalMemoryBuffer: DotProductAttention's QK^T; the grad | buffers and small tensors on                  |
| norm without Apex / TE), distributed.param_and_grad_buffer      | torch.cuda.current_device() / device="cuda";  |
| (DDP's buffers), optimizer.optimizer, optimizer.clip_grads,     | waits on torch.cuda.current_stream()          |
| pipeline_parallel.schedules, pipeline_parallel.p2p_communication| (p2p: the receive buffers between pipeline    |
| (the receive buffers between stages), tensor_parallel.mappings  | stages, torch.cuda.synchronize() after them)  |
| and .layers (sequence parallelism's gathers and reduce-scatters)|                                               |
| LanguageModule.setup_embeddings_and_output_layer                | moves the word embedding shared by the first  |
|                                                                 | and last pipeline stages with `.cuda()`       |
| DistributedOptimizer / Float16OptimizerWithFloat16Params        | accept only tensors whose type() is           |
| __init__, clip_grad_by_total_norm_fp32                          | "torch.cuda.FloatTensor" (or Half / BFloat16) |
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

_applied = False


# --- used on every machine -----------------------------------------------------------------------------------
def row_parallel_local_output(layer, input_: torch.Tensor) -> torch.Tensor:
    """A RowParallelLinear's output on this rank before its all-reduce (input_is_parallel, no sequence parallelism,
    no expert communication, no bias): the first step of RowParallelLinear.forward, through its private
    `_forward_impl` and attributes. Megatron-Core 0.19.2."""
    return layer._forward_impl(
        input=input_, weight=layer.weight, bias=None, gradient_accumulation_fusion=layer.gradient_accumulation_fusion,
        allreduce_dgrad=False, sequence_parallel=False, tp_group=None, grad_output_buffer=None,
        gtp_remat_size=layer.gtp_remat_size)


def adapt_in_place(module: torch.nn.Module, subclass: type) -> None:
    """Make `module` an instance of `subclass` (a subclass of its class adding a forward) without rebuilding it:
    assigning `__class__` keeps its parameters, buffers, hooks and every attribute Megatron's __init__ set, which
    a rebuilt module would have to copy one by one. Relies on the class having no __slots__ and on torch's
    nn.Module keeping its state in the instance dict. torch 2.11 / 2.14.1, Megatron-Core 0.19.2 linears."""
    module.__class__ = subclass


class PassedAsPackedSeqParams:
    """Base of an object a model hands through Megatron's TransformerBlock as its `packed_seq_params`: Megatron-Core
    0.19.2 passes that argument to the core attention untouched (also through activation recompute) and looks only
    for `qkv_format == "thd"` on its way; "sbhd" asks for no THD handling (the tokens stay [s, b])."""

    qkv_format = "sbhd"


def share_embedding_across_stages(weight: torch.Tensor | None, first_stage: bool, meta_device: bool) -> None:
    """What Megatron-Core 0.19.2's LanguageModule.setup_embeddings_and_output_layer does to a word embedding that
    the first and last pipeline stages both hold, for a model that is not a LanguageModule: mark it
    `shared_embedding` (finalize_model_grads all-reduces its gradient over the embedding group; Megatron's
    checkpoints name a later stage's copy as the embedding) and, on a later stage, `shared` with zeros, then
    all-reduce it over the embedding group so that every copy starts from the first stage's values."""
    from megatron.core import parallel_state

    if weight is None:
        return
    weight.shared_embedding = True
    if not first_stage:
        weight.shared = True
        with torch.no_grad():
            weight.zero_()
    if not meta_device and parallel_state.is_rank_in_embedding_group():
        torch.distributed.all_reduce(weight.data, group=parallel_state.get_embedding_group())


# the globals torch's distributed checkpoint (torch_dist) pickles into its `.metadata`, private ones included:
# torch 2.11 / 2.14.1. A torch that pickles others has its checkpoints refused, naming the global, until it is added
_DCP = "torch.distributed.checkpoint"
TORCH_DCP_PICKLED_GLOBALS = frozenset({
    (f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    # the save plans Megatron's planner records in the metadata (`all_local_plans`)
    (f"{_DCP}.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                           "BytesIOWriteData")
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch's pickle of a layout: a lookup among torch's layouts by name
} | {
    ("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)
})


def storage_info_class() -> type:
    """The class of a torch_dist `.metadata`'s storage entries (where each item lies in which file): private in
    torch 2.11 / 2.14.1 (`torch.distributed.checkpoint.filesystem._StorageInfo`)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def stand_in_module(name: str, symbols: tuple[str, ...], why: str) -> None:
    """Where `name` cannot be imported, plant a module in sys.modules whose `symbols` raise `why` when called, so
    that a library importing it at import time (megatron-bridge 0.6.2 imports transformers'
    `modeling_attn_mask_utils`, which transformers removed after 5.12) loads; nothing may call them."""
    import importlib.util

    if importlib.util.find_spec(name) is not None:
        return

    def removed(*args, **kwargs):
        raise NotImplementedError(why)

    module = types.ModuleType(name)
    for symbol in symbols:
        setattr(module, symbol, removed)
    sys.modules[name] = module


# --- CPU patches -----------------------------------------------------------------------------------------------
def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    """Apply every CPU patch once; a no-op when CUDA is available."""
    global _applied
    if _applied or not needed():
        return
    _patch_rotary_embedding()
    _patch_default_causal_mask()
    _patch_rng()
    _patch_alltoall_dispatcher_stream()
    _patch_dist_checkpointing()
    _patch_cuda_allocations()
    _patch_optimizer_type_checks()
    _patch_shared_embedding_setup()
    _applied = True


def _patch_rotary_embedding() -> None:
    # RotaryEmbedding.get_emb moves a CPU `inv_freq` to torch.cuda.current_device() on first use.
    # Without CUDA it stays on the CPU; the rest is upstream's get_emb (0.19.2) line for line.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    RotaryEmbedding.get_emb = get_emb


def _causal_mask_on_cpu(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _patch_default_causal_mask() -> None:
    # transformer.utils.get_default_causal_mask allocates on "cuda"; the softmax imports it by name,
    # so each module holding a reference gets the CPU version.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    for module in (utils, fused_softmax):
        if hasattr(module, "get_default_causal_mask"):
            module.get_default_causal_mask = _causal_mask_on_cpu


def _patch_rng() -> None:
    # Megatron keeps separate generator states for tensor-parallel regions (dropout in sharded
    # activations, weight init) and swaps them in and out of the *CUDA* generator; activation
    # recompute saves and restores the CUDA generator too. Without CUDA the same bookkeeping is done
    # on the CPU generator, which is where the random numbers of a CPU run come from.
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    mp_random.CudaRNGStatesTracker.add = _cpu_tracker_add
    mp_random.CudaRNGStatesTracker.fork = _cpu_tracker_fork


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add, with the CPU generator in place of the CUDA one."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _cpu_tracker_fork(self, name: str = "model-parallel-rng"):
    """CudaRNGStatesTracker.fork on the CPU generator (upstream also warns when the CPU state moves)."""
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer_state = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer_state)


def _patch_alltoall_dispatcher_stream() -> None:
    # MoEAlltoAllTokenDispatcher.__init__ creates a class-level torch.cuda.Stream used only to overlap
    # device-to-host copies of token counts; without CUDA there is nothing to overlap. A placeholder
    # set before __init__ makes upstream skip the creation.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = contextlib.nullcontext()


def _patch_dist_checkpointing() -> None:
    # The torch_dist save/load path calls torch.cuda.synchronize() (nothing to wait for without CUDA)
    # and puts small status tensors for all-reduces on torch.cuda.current_device() (gloo wants CPU).
    # The patch is confined to those modules: their `torch` global becomes a view of torch whose
    # `cuda.synchronize` is a no-op and whose `cuda.current_device()` is the CPU.
    _give_modules_torch_on_cpu(
        "megatron.core.dist_checkpointing.tensor_aware_state_dict",
        "megatron.core.dist_checkpointing.strategies.async_utils",
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
        "megatron.core.dist_checkpointing.strategies.fully_parallel",
        "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    )


def _patch_cuda_allocations() -> None:
    # utils.GlobalMemoryBuffer (the scratch buffer of the local spec's DotProductAttention) and
    # DistributedDataParallel's contiguous grad (and, for the distributed optimizer, param) buffers are
    # allocated on torch.cuda.current_device(), and DDP waits on torch.cuda.current_stream() before
    # reducing them; the optimizers' loss scale and found-inf flag, the gradient norm (clip_grads, and
    # utils.local_multi_tensor_l2_norm, its implementation without Apex or Transformer Engine) and the
    # no-pipelining schedule's token count are small tensors made with device="cuda"; the pipeline schedules'
    # point-to-point communication makes its receive buffers on torch.cuda.current_device() and synchronises
    # CUDA after batched sends and receives; under sequence parallelism the tensor-parallel mappings and linears
    # put their all-gather and reduce-scatter outputs on torch.cuda.current_device(). In those modules torch
    # becomes `_TorchOnCpu`.
    _give_modules_torch_on_cpu(
        "megatron.core.utils",
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.clip_grads",
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.pipeline_parallel.p2p_communication",
        "megatron.core.tensor_parallel.mappings",
        "megatron.core.tensor_parallel.layers",
    )


def _patch_optimizer_type_checks() -> None:
    # The optimizers sort parameters into fp32 and 16-bit ones (and clipping checks gradients) by their
    # type() string, which names only CUDA tensors ("torch.cuda.FloatTensor"); anything else is refused.
    # Inside these calls a CPU tensor's type() is the CUDA name of its dtype.
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    DistributedOptimizer.__init__ = _within(_CudaTypeNames, DistributedOptimizer.__init__)
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _within(
        _CudaTypeNames, optimizer.Float16OptimizerWithFloat16Params.__init__)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = _within(
        _CudaTypeNames, clip_grads.clip_grad_by_total_norm_fp32)


def _patch_shared_embedding_setup() -> None:
    # With pipeline stages and a word embedding used on the last stage too (tied head, MTP), GPTModel's
    # setup_embeddings_and_output_layer calls `weight.data.cuda()` before all-reducing the copies; inside that call a
    # CPU tensor's .cuda() is the tensor itself.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _within(
        _CudaIsCpu, LanguageModule.setup_embeddings_and_output_layer)


class _CudaIsCpu(torch.overrides.TorchFunctionMode):
    """tensor.cuda() of a CPU tensor is the tensor: there is no other device to move it to."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda and not args[0].is_cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


def _within(mode: type[torch.overrides.TorchFunctionMode], function):
    """`function` run inside a fresh `mode()` at every call."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        with mode():
            return function(*args, **kwargs)

    return call


def _give_modules_torch_on_cpu(*module_names: str) -> None:
    """Replace the `torch` global of each module by `_TorchOnCpu` (that module only)."""
    import importlib

    for module_name in module_names:
        module = importlib.import_module(module_name)
        if module.torch is torch:
            module.torch = _TorchOnCpu()


class _CpuStream:
    """torch.cuda.current_stream() without CUDA: CPU work is in program order, so there is nothing to wait for."""

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None


class _CudaOnCpu:
    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def current_stream(device=None) -> _CpuStream:
        return _CpuStream()


def _on_cpu(factory):
    """A tensor factory whose device="cuda" (or a CUDA device) means the CPU."""

    def make(*args, **kwargs):
        if "device" in kwargs and kwargs["device"] is not None and torch.device(kwargs["device"]).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class _TorchOnCpu:
    """The `torch` module as seen by a Megatron module that assumes CUDA, on a machine without it."""

    cuda = _CudaOnCpu()
    tensor, zeros, empty, ones = (staticmethod(_on_cpu(factory))
                                  for factory in (torch.tensor, torch.zeros, torch.empty, torch.ones))

    def __getattr__(self, name):
        return getattr(torch, name)


class _CudaTypeNames(torch.overrides.TorchFunctionMode):
    """tensor.type() of a CPU tensor gives the name of the CUDA tensor of its dtype ("torch.cuda.FloatTensor")."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and not args[0].is_cuda:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)

