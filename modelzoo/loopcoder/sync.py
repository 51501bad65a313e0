"""LoopCoder: engines fuse what they fuse for Llama (q, k, v; gate, up); the per-layer loop gates
(`model.gate_projections.N`) are fused with nothing and travel as lone tensors."""

from modelzoo.llama.sync import NAMINGS

__all__ = ["NAMINGS"]
