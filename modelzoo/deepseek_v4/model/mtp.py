"""Multi-token prediction (MTP) of DeepSeek-V4: `num_nextn_predict_layers` extra blocks (transformers does not build them).

Formulation (DeepSeek-V3 paper §2.2, V4 reference inference `MTPBlock`), depth k = 1..D:
    e      = enorm(embed(t[i + k]))                       shared embedding
    h      = hnorm(streams_{k-1})                         streams_0 = the main model's final HC streams
    x      = e_proj(e) (broadcast over the hc streams) + h_proj(h)
    streams_k = block_k(x)                                a full V4 decoder layer (sliding attention, MoE)
    logits_k  = output_layer(norm_k(hc_head_k(streams_k)))    shared output layer; predicts t[i + k + 1]
Training loss: main CE + mtp_loss_scale / D * sum_k mean_i CE(logits_k[i], t[i + k + 1]).
The last k positions of depth k have no input token / target: their inputs are token 0 and they
are left out of the loss.
"""

from __future__ import annotations

import torch
from torch import nn

from modelzoo.deepseek_v4.config import MTP_LAYER_TYPE, MTP_MLP_TYPE, DeepseekV4Args
from modelzoo.deepseek_v4.model.hyper_connection import HyperHead
from modelzoo.deepseek_v4.model.layers import ReplicatedLinear, RMSNorm, per_token
from modelzoo.layers import context_parallel
from modelzoo.layers.context_parallel import gather_in_row_order
from modelzoo.logprobs import vocab_parallel_logprobs
from modelzoo.layers.sequences import TokenLayout, plain_layout


def shifted_in_sequences(input_ids: torch.Tensor, layout: TokenLayout, k: int, fill: int = 0):
    """(t[i + k] of the same sequence at position i, else `fill`; whether it exists) [B, S] each.

    Under context parallelism t[i + k] may be another rank's token (at a chunk border): the ids of the whole rows
    are gathered (integers, no gradient), shifted there, and this rank's tokens taken."""
    keys = layout.context_parallel_keys
    if keys is not None:
        shifted, exists = shifted_in_sequences(gather_in_row_order(input_ids, keys), layout.whole_rows(), k, fill)
        return shifted[:, keys.query_index], exists[:, keys.query_index]
    seq = input_ids.shape[1]
    shifted = torch.full_like(input_ids, fill)
    exists = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    if k < seq:
        ahead = (layout.segment_ids[:, k:] == layout.segment_ids[:, :-k or None]) & (layout.segment_ids[:, k:] >= 0)
        ahead &= layout.positions[:, k:] == layout.positions[:, :-k or None] + k
        exists[:, : seq - k] = ahead
        shifted[:, : seq - k] = torch.where(ahead, input_ids[:, k:], fill)
    return shifted, exists


def shift_left(input_ids: torch.Tensor, k: int, fill: int = 0) -> torch.Tensor:
    """t[i + k] at position i of plain rows; the last k positions get `fill`."""
    return shifted_in_sequences(input_ids, plain_layout(*input_ids.shape, input_ids.device), k, fill)[0]


class DeepseekV4MTPLayer(nn.Module):
    def __init__(self, config, args: DeepseekV4Args, decoder_layer_class: type[nn.Module], attention: str = "exact"):
        super().__init__()
        hidden = args.hidden_size
        self.enorm = per_token(RMSNorm(hidden, args.rms_norm_eps), config)
        self.hnorm = per_token(RMSNorm(hidden, args.rms_norm_eps), config)
        self.e_proj = per_token(ReplicatedLinear(hidden, hidden, config), config)
        self.h_proj = per_token(ReplicatedLinear(hidden, hidden, config), config)
        self.block = decoder_layer_class(config, args, MTP_LAYER_TYPE, MTP_MLP_TYPE, attention)
        self.hc_head = per_token(HyperHead(hidden, args.hc_mult, args.hc_eps, args.rms_norm_eps,
                                           config.init_method_std), config)
        self.final_layernorm = per_token(RMSNorm(hidden, args.rms_norm_eps), config)

    @property
    def mtp_model_layer(self) -> nn.Module:
        """The decoder layer inside, under the name Megatron's MTP layers give it (its schedules read it)."""
        return self.block

    def forward(self, streams, embeddings, position_ids, input_ids, layout, unrouted):
        x = self.e_proj(self.enorm(embeddings)).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        return self.block(x, position_ids, input_ids, layout, unrouted)


class DeepseekV4MTP(nn.Module):
    def __init__(self, config, args: DeepseekV4Args, decoder_layer_class: type[nn.Module], attention: str = "exact",
                 num_layers: int | None = None):
        """`decoder_layer_class`: the main model's decoder layer (model.py), each MTP layer's block: passed in, so
        that this module does not import the one that imports it."""
        super().__init__()
        num_layers = args.num_mtp_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(DeepseekV4MTPLayer(config, args, decoder_layer_class, attention)
                                    for _ in range(num_layers))
        for number, layer in enumerate(self.layers, start=1):  # Megatron numbers the MTP layers' own layers 1, 2, ...
            layer.block.mlp.router.set_layer_number(number)

    def forward(self, model, streams, input_ids, position_ids, layout: TokenLayout,
                unrouted: torch.Tensor | None = None, isolated: bool = False) -> list[torch.Tensor]:
        """Each depth's logits; `isolated`: the main model's streams, the embedding and the output layer are read
        detached, so a loss on these logits trains the MTP layers alone."""
        if isolated:
            streams = streams.detach()
        all_logits = []
        for k, layer in enumerate(self.layers, start=1):
            shifted, _ = shifted_in_sequences(input_ids, layout, k)
            embeddings = model.embed(shifted)
            streams = layer(streams, embeddings.detach() if isolated else embeddings, position_ids, shifted, layout,
                            unrouted)
            all_logits.append(model.logits(streams, layer.hc_head, layer.final_layernorm, detach_head=isolated))
        return all_logits


def shifted_cross_entropy(logits: torch.Tensor, input_ids: torch.Tensor, shift: int, vocab_size: int,
                          layout: TokenLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token CE [B, S] of vocab-parallel `logits[:, i]` against t[i + shift] of the same sequence, and
    where that target exists [B, S])."""
    layout = layout if layout is not None else plain_layout(*input_ids.shape, input_ids.device)
    targets, exists = shifted_in_sequences(input_ids, layout, shift)
    return -vocab_parallel_logprobs(logits, targets, vocab_size), exists


def mtp_loss(mtp_logits: list[torch.Tensor], input_ids: torch.Tensor, vocab_size: int,
             layout: TokenLayout | None = None, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over depths k of the mean CE of depth k against t[i + k + 1] on the positions that have one.

    `loss_mask` [B, S] (GPTModel's: weight of the main loss at i, whose target is t[i + 1]) weighs depth k's
    position i by loss_mask[i + k], the weight of the same target in the main loss, as Megatron does.

    Under context parallelism the means are over every rank's positions: each rank returns its own positions'
    share (its weighted sum over the weights' total in the group), so the shares sum over the group to the loss of
    the whole rows, and so do the gradients."""
    layout = layout if layout is not None else plain_layout(*input_ids.shape, input_ids.device)
    losses = []
    for k, logits in enumerate(mtp_logits, start=1):
        per_token, exists = shifted_cross_entropy(logits, input_ids, k + 1, vocab_size, layout)
        weights = exists.float()
        if loss_mask is not None:
            weights = weights * _ahead(loss_mask.float(), layout, k)
        total = weights.sum()
        if layout.context_parallel_keys is not None:
            total = context_parallel.sum_over_group(total, layout.context_parallel_keys.context_parallel)
        if total > 0:
            losses.append((per_token * weights).sum() / total)
    return torch.stack(losses).mean() if losses else mtp_logits[0].new_zeros(())


def _ahead(values: torch.Tensor, layout: TokenLayout, k: int) -> torch.Tensor:
    """values[i + k] of the row at position i (0 past its end), of the whole rows under context parallelism."""
    keys = layout.context_parallel_keys
    whole = values if keys is None else gather_in_row_order(values, keys)
    shifted = torch.nn.functional.pad(whole[:, k:], (0, k))
    return shifted if keys is None else shifted[:, keys.query_index]
