"""How one Megatron tensor is made from its Hugging Face tensors, and back.

A transform works on *full* tensors. On the Megatron side "full" means the concatenation of every
tensor-parallel rank's shard along the parameter's partition dimension, so that the engine can
shard and gather with a plain chunk / cat whatever the layout inside a shard is. Transforms whose
full layout depends on the TP size (the fused [gate; up] of a SwiGLU MLP) receive it. Towards Megatron
a transform makes the tensor as `RowBlocks` (its rows, block by block, not yet concatenated); back
towards Hugging Face, `to_hf_rows` gives each HF tensor so, and a fused tensor's HF tensors are runs of
its rows that nothing copied (`RowsTransform`).

Every transform keeps the source dtype: values are only moved, never recomputed.
"""

from __future__ import annotations

import torch


class RowBlocks:
    """A tensor held as consecutive blocks of rows (dim 0), concatenated only when asked (`tensor()`).

    What the transforms make a Megatron tensor as: the fused ones are the checkpoint's tensors (or
    slices of them) row block after row block, so a consumer that needs only some rows, like the
    streaming writer for one half of a SwiGLU fc1, takes them where they are instead of from a copy.
    Also how a Megatron tensor read back in pieces of whole rows comes (`megatron_ckpt.stream_weights`),
    which `Transform.to_hf_rows` takes.
    """

    def __init__(self, blocks: list[torch.Tensor]):
        self.blocks = blocks
        self.shape = torch.Size([sum(block.shape[0] for block in blocks), *blocks[0].shape[1:]])
        self.dtype = blocks[0].dtype

    def narrow(self, dim: int, start: int, length: int) -> RowBlocks:
        """`Tensor.narrow`: no block is copied."""
        if dim != 0:
            return RowBlocks([block.narrow(dim, start, length) for block in self.blocks])
        picked, first = [], 0
        for block in self.blocks:
            begin, end = max(start - first, 0), min(start + length - first, block.shape[0])
            if begin < end:
                picked.append(block[begin:end])
            first += block.shape[0]
        return RowBlocks(picked or [self.blocks[0][:0]])

    def chunk(self, chunks: int, dim: int = 0) -> list[RowBlocks]:
        """`Tensor.chunk` (what `engine.ShardLayout.shard` splits a tensor with)."""
        total = self.shape[dim]
        size = -(-total // chunks)
        return [self.narrow(dim, start, min(size, total - start)) for start in range(0, total, size)]

    def to(self, dtype: torch.dtype) -> RowBlocks:
        return RowBlocks([block.to(dtype) for block in self.blocks])

    def tensor(self) -> torch.Tensor:
        """The whole tensor: the only block itself, else the blocks concatenated (a copy)."""
        return self.blocks[0] if len(self.blocks) == 1 else torch.cat(self.blocks)


class Transform:
    """`to_megatron_rows(hf_tensors, megatron_shape, tp) -> RowBlocks` and `to_hf(tensor, tp) -> hf_tensors`."""

    def to_megatron_rows(self, hf: list[torch.Tensor], megatron_shape: torch.Size, tp: int) -> RowBlocks:
        raise NotImplementedError

    def to_megatron(self, hf: list[torch.Tensor], megatron_shape: torch.Size, tp: int) -> torch.Tensor:
        return self.to_megatron_rows(hf, megatron_shape, tp).tensor()

    def to_hf(self, megatron: torch.Tensor, tp: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def to_hf_rows(self, megatron: RowBlocks, tp: int) -> list[RowBlocks]:
        """`to_hf` of a tensor held as row blocks (one read back in pieces, or a whole one as its only
        block), each HF tensor as row blocks: the blocks concatenated first, unless the transform takes
        its HF tensors' rows from the blocks where they are (`RowsTransform`)."""
        return [RowBlocks([tensor]) for tensor in self.to_hf(megatron.tensor(), tp)]


class RowsTransform(Transform):
    """A transform whose HF tensors are runs of the Megatron tensor's rows: it says which
    (`to_hf_rows`), so a writer can take each run where it is (a file's bytes) instead of from a copy."""

    def to_hf(self, megatron, tp):
        return [rows.tensor() for rows in self.to_hf_rows(RowBlocks([megatron]), tp)]


class Direct(Transform):
    """One tensor, same layout on both sides (norms, dense projections, replicated or TP-split)."""

    def to_megatron_rows(self, hf, megatron_shape, tp):
        (tensor,) = hf
        return RowBlocks([tensor])

    def to_hf(self, megatron, tp):
        return [megatron]

    def __repr__(self) -> str:
        return "Direct()"


class PadVocab(Transform):
    """Embedding / output layer rows padded from `vocab_size` to Megatron's TP-divisible vocab.

    The padding rows are zeros; `modelzoo` masks their logits, so they never receive probability.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def to_megatron_rows(self, hf, megatron_shape, tp):
        (tensor,) = hf
        padding = megatron_shape[0] - tensor.shape[0]
        if padding == 0:
            return RowBlocks([tensor])
        return RowBlocks([tensor, tensor.new_zeros((padding, *tensor.shape[1:]))])

    def to_hf(self, megatron, tp):
        return [megatron[: self.vocab_size]]

    def __repr__(self) -> str:
        return f"PadVocab({self.vocab_size})"


class FusedQKV(RowsTransform):
    """q, k, v projections <-> Megatron's linear_qkv, interleaved per query group.

    Megatron layout (rows): for each query group g: its query heads, then k_g, then v_g. Sharding rows by TP
    then hands each rank whole groups, so the layout does not depend on TP as long as there are `num_kv_heads`
    groups. A model with fewer KV heads than TP ranks has more groups than KV heads (one per rank, as vLLM
    replicates them): each KV head is then copied into `groups / num_kv_heads` consecutive groups, which split
    its query heads; back towards HF every KV head is taken from its first copy. The number of groups is read
    from the Megatron tensor's rows.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def groups(self, megatron_rows: int) -> int:
        """The query groups of a linear_qkv with this many rows: `num_kv_heads`, or a multiple of it (copies)."""
        groups = (megatron_rows // self.head_dim - self.num_heads) // 2
        if groups < 1 or groups % self.num_kv_heads or self.num_heads % groups or \
                (self.num_heads + 2 * groups) * self.head_dim != megatron_rows:
            raise ValueError(f"{self!r}: a linear_qkv of {megatron_rows} rows is not whole query groups of "
                             f"{self.num_kv_heads} key/value heads or copies of them")
        return groups

    def to_megatron_rows(self, hf, megatron_shape, tp):
        q, k, v = hf
        groups, d = self.groups(megatron_shape[0]), self.head_dim
        copies, tail = groups // self.num_kv_heads, q.shape[1:]
        k, v = k.reshape(self.num_kv_heads, d, *tail), v.reshape(self.num_kv_heads, d, *tail)
        return RowBlocks([block for group, q_rows in enumerate(q.reshape(groups, -1, *tail))
                          for block in (q_rows, k[group // copies], v[group // copies])])

    def to_hf_rows(self, megatron, tp):
        """q, k and v, each its rows of every group (k and v: of each KV head's first copy) in turn, none copied."""
        groups, d = self.groups(megatron.shape[0]), self.head_dim
        per_group, copies = self.num_heads // groups, groups // self.num_kv_heads
        group_rows = (per_group + 2) * d
        q = [block for group in range(groups) for block in megatron.narrow(0, group * group_rows, per_group * d).blocks]
        k, v = ([block for head in range(self.num_kv_heads)
                 for block in megatron.narrow(0, head * copies * group_rows + start, d).blocks]
                for start in (per_group * d, (per_group + 1) * d))
        return [RowBlocks(q), RowBlocks(k), RowBlocks(v)]

    def __repr__(self) -> str:
        return f"FusedQKV(heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim})"


class FusedGateUp(RowsTransform):
    """gate and up projections <-> Megatron's linear_fc1 of a gated MLP.

    Each TP rank holds [gate_r; up_r], so the full tensor is [gate_0; up_0; gate_1; up_1; ...].
    """

    def to_megatron_rows(self, hf, megatron_shape, tp):
        gate, up = hf
        return RowBlocks([part for pair in zip(gate.chunk(tp), up.chunk(tp)) for part in pair])

    def to_hf_rows(self, megatron, tp):
        """gate and up, each its ranks' halves in turn, none copied."""
        shards = [shard.chunk(2) for shard in megatron.chunk(tp)]
        return [RowBlocks([block for half in halves for block in half.blocks])
                for halves in ([gate for gate, _ in shards], [up for _, up in shards])]

    def __repr__(self) -> str:
        return "FusedGateUp()"


class Stack(Transform):
    """N tensors of one shape <-> one tensor with a new leading dimension (per-expert weights)."""

    def to_megatron_rows(self, hf, megatron_shape, tp):
        return RowBlocks([tensor.unsqueeze(0) for tensor in hf])

    def to_hf(self, megatron, tp):
        return list(megatron.unbind(0))

    def __repr__(self) -> str:
        return "Stack()"
