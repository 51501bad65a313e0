"""Triton kernel for the Lightning Indexer's masked scores, on a GPU.

The plain scores (`indexer.index_scores`) are a GEMM that writes every head's fp32 score [s, h, E] and
an elementwise op that reads them back to sum `w[t,h] * relu(q[t,h] . k[e])` over the h heads: at
65536 tokens (E = 16384 entries, h = 32) that is ~137 GB of memory traffic per layer for a [s, E]
result. Here one program scores a tile of queries against a tile of entries head by head, summing in
registers, and writes only the masked sum. Tiles whose entries no query of the tile sees yet (about half
of them, the indexer being causal) skip the products and store -inf.

On CPU the indexer runs the plain ops (what the parity tests compare against transformers);
tests/deepseek_v4/test_index_kernels.py compares this kernel against them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from modelzoo.deepseek_v4.model.hc_kernels import INTERPRETED

# queries x entries per program: the candidates timed on a GPU, the first one under the interpreter
TILES = [dict(BLOCK_M=m, BLOCK_N=n) for m in (64, 128) for n in (64, 128)]


def _autotuned(kernel):
    """Triton's autotune over TILES and 4 or 8 warps, timed on first use per head_dim, outside any CUDA
    graph capture; not under Triton's CPU interpreter (TRITON_INTERPRET=1), which cannot time kernels."""
    if INTERPRETED:
        return kernel
    configs = [triton.Config(tile, num_warps=warps) for tile in TILES for warps in (4, 8)]
    return triton.autotune(configs, key=["HEAD_DIM"])(kernel)


@_autotuned
@triton.jit
def _masked_index_scores(q, keys, head_weights, complete, out, queries, entries, softmax_scale, weights_scaling,
                         HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """One batch row, BLOCK_M queries t and BLOCK_N entries e: out[t, e] = sum_h relu(q[t,h] . keys[e])
    * softmax_scale * (head_weights[t,h] * weights_scaling) in fp32 where e < complete[t], else -inf."""
    batch = tl.program_id(2).to(tl.int64)
    first_entry = tl.program_id(0) * BLOCK_N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = first_entry + tl.arange(0, BLOCK_N)
    row_mask, column_mask = rows < queries, columns < entries
    tokens = batch * queries + rows                                                          # int64 [BLOCK_M]
    limits = tl.load(complete + tokens, mask=row_mask, other=0)
    scores = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    if first_entry < tl.max(limits):   # some query of the tile sees some entry of it
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        keys_t = tl.load(keys + (batch * entries + columns[None, :]) * HEAD_DIM + dims[:, None],
                         mask=dim_mask[:, None] & column_mask[None, :], other=0.0)               # [BLOCK_D, BLOCK_N]
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for head in range(HEADS):
            q_head = tl.load(q + (tokens[:, None] * HEADS + head) * HEAD_DIM + dims[None, :],
                             mask=row_mask[:, None] & dim_mask[None, :], other=0.0)             # [BLOCK_M, BLOCK_D]
            if q_head.dtype == tl.float32:   # fp32 products as fp32 (the default is TF32 on tensor cores)
                dot = tl.dot(q_head, keys_t, input_precision="ieee")
            else:                            # bf16 products are exact in the fp32 accumulator
                dot = tl.dot(q_head, keys_t)
            weight = tl.load(head_weights + tokens * HEADS + head, mask=row_mask, other=0.0).to(tl.float32)
            total += tl.maximum(dot, 0.0) * softmax_scale * (weight * weights_scaling)[:, None]
        scores = tl.where(columns[None, :] < limits[:, None], total, float("-inf"))
    tl.store(out + tokens[:, None] * entries + columns[None, :], scores, mask=row_mask[:, None] & column_mask[None, :])


def masked_index_scores(q: torch.Tensor, compressed: torch.Tensor, head_weights: torch.Tensor, complete: torch.Tensor,
                        softmax_scale: float, weights_scaling: float) -> torch.Tensor:
    """`index_scores(q, compressed, head_weights, softmax_scale, weights_scaling)` [B, s, E] fp32, -inf at the
    entries e >= complete[b, t] (not complete at that query yet).

    q [B, s, h, d] and compressed [B, E, d] of one dtype (bf16 or fp32), head_weights [B, s, h], complete [B, s]
    integers. The sum over heads runs in another order than the plain ops' (fp32 both)."""
    batch, queries, heads, head_dim = q.shape
    entries = compressed.shape[1]
    out = torch.empty(batch, queries, entries, dtype=torch.float32, device=q.device)

    def grid(tile):   # entry tiles vary fastest: the programs running together share their queries' rows
        return triton.cdiv(entries, tile["BLOCK_N"]), triton.cdiv(queries, tile["BLOCK_M"]), batch
    _masked_index_scores[grid](q.contiguous(), compressed.contiguous(), head_weights.contiguous(),
                               complete.contiguous(), out, queries, entries, softmax_scale, weights_scaling,
                               HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                               **(TILES[0] if INTERPRETED else {}))
    return out
