"""LoopCoder: engines fuse what they fuse for Llama (q, k, v; gate, up). vLLM also loads each layer's loop gate,
`model.gate_projections.N` weight and bias, into one layer (`gate_projections.N.gate_proj`), and its in-place
reload rebuilds a layer from what one call brought: a bias without its weight leaves the weight unloaded, so the
two travel together."""

from modelzoo.conversion.sync import Naming, UpdateGroup
from modelzoo.llama.sync import ATTENTION_QKV, MLP_GATE_UP

LOOP_GATE = UpdateGroup("gate_projections.gate_proj", ("model.gate_projections.*.weight",
                                                       "model.gate_projections.*.bias"))

NAMINGS = {"hf": Naming(groups=(ATTENTION_QKV, MLP_GATE_UP, LOOP_GATE))}
