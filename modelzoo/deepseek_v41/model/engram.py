"""DeepSeek-V4.1's Engram conditional memory on Megatron-Core.

    ids    = hashes of the 2..N-grams ending at each token, over the tokenizer's normalised vocabulary
    rows   = table[ids]                                   [B, S, hash columns, engram_head_dim]
    key_n, value = wkv(rows)                              one key per stream, one shared value
    h_n   += sigmoid(signed_sqrt(<h_n, q_n k_n key_n> / (rms(h_n) rms(key_n) sqrt(D)))) * value

The tables are the release's largest tensors (about 98 GB each in FP8), so each is row-sharded over the tensor-
parallel ranks as a vocab-parallel embedding is: a rank looks up the ids in its rows, zeros the others, and one
all-reduce sums the pieces (Megatron's `VocabParallelEmbedding`). The rows are padded as a vocabulary is (`padded_rows`)
with rows no id reaches (the mapping drops them on export). The tables are frozen by default
(`requires_grad` False; `train_engram_tables=True` trains them); the rest (wkv, q_weight, k_weight) is replicated
and trains. The hashing is the reference's `DeepseekV41NgramHasher` (a function of the token ids, the config and
the tokenizer's normalised vocabulary; it has no weights).
"""

from __future__ import annotations

import math

import torch
from megatron.core.tensor_parallel import VocabParallelEmbedding
from torch import nn

from modelzoo.deepseek_v4.model.layers import ReplicatedLinear, fp32_param, mark_tensor_parallel
from modelzoo.deepseek_v41.config import DeepseekV41Args
from modelzoo.deepseek_v41.config import ENGRAM_SCALE_BLOCK
from modelzoo.provider import VOCAB_PADDING_MULTIPLE


def padded_rows(rows: int, tp: int) -> int:
    """Rows padded as Megatron pads a vocabulary (a multiple of lcm(128, tp)): the same for every TP size up to 128
    that is a power of two, so a Megatron checkpoint saved at one such size loads at another."""
    multiple = math.lcm(VOCAB_PADDING_MULTIPLE, tp)
    return -(-rows // multiple) * multiple


class DeepseekV41Engram(nn.Module):
    def __init__(self, config, args: DeepseekV41Args, num_embeddings: int, train_table: bool = False):
        super().__init__()
        text, tp = args.text, config.tensor_model_parallel_size
        self.hidden_size, self.hc_mult, self.eps = args.hidden_size, args.hc_mult, args.rms_norm_eps
        rows = padded_rows(num_embeddings, tp)
        self.table = VocabParallelEmbedding(rows, text.engram_head_dim, init_method=config.init_method, config=config)
        # the release's per-32-channel scales of an FP8 table: carried for the export; a float table (this one)
        # is read as it is, as the reference reads one
        self.table_scale = mark_tensor_parallel(
            fp32_param(rows // tp, text.engram_head_dim // ENGRAM_SCALE_BLOCK, fill=1.0), dim=0)
        for tensor in (self.table.weight, self.table_scale):
            tensor.requires_grad_(train_table and tensor is self.table.weight)
        hash_columns = (text.engram_max_ngram_size - 1) * text.engram_n_heads
        self.linear_kv = ReplicatedLinear(hash_columns * text.engram_head_dim, args.hidden_size * (args.hc_mult + 1),
                                          config)
        self.q_weight = fp32_param(args.hc_mult, args.hidden_size, fill=1.0)
        self.k_weight = fp32_param(args.hc_mult, args.hidden_size, fill=1.0)

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
        """streams [B, S, N, D], hash_ids [B, S, hash columns] of this layer, dead [B, S] (tokens whose streams are
        kept: padding, image tokens) -> streams."""
        rows = self.table(hash_ids).flatten(-2).to(self.linear_kv.weight.dtype)
        key, value = self.linear_kv(rows).split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.hidden_size))
        h = streams.float()
        # normalised per (token, stream) over D, not jointly over the streams
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.hidden_size**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if dead is not None:
            gate = gate.masked_fill(dead[..., None], 0.0)
        return (h + gate[..., None] * value.float()[..., None, :]).to(streams.dtype)
