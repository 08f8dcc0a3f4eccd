"""Tensor-parallel MoE block: the routed experts on this rank's shard of the
intermediate size, then the fused all-reduce + residual + RMSNorm that opens
the next layer (as vLLM/SGLang run it at decode).

Legend: T tokens, E experts, K top-k, H hidden, I intermediate (full), W ranks.

    block = TPMoEBlock(comm, caps, spec, (w1, w2), norm_weight)   # collective setup
    out, residual = block(x, logits, residual, partial=partial)   # graph-safe with a fixed partial
"""

from __future__ import annotations

from dataclasses import replace

import torch

from sparkinfer.errors import ShapeError
from sparkinfer.moe import MoECaps, MoELayer, MoESpec

__all__ = ["TPMoEBlock"]


class TPMoEBlock:
    """One MoE block of a tensor-parallel model on one rank.

    comm: a Communicator over the tensor-parallel group (rank r holds shard r).
    caps: MoECaps with the *per-rank* intermediate size; tp_rank/tp_size are
        taken from comm. spec: MoESpec.
    weights: (w1 [E, N1, H], w2 [E, H, I * W]) full or already sharded (see
        moe.prepare_weights); NVFP4Tensor for "nvfp4".
    norm_weight: [H] RMSNorm weight of the next layer; eps its epsilon.
    Construction plans, prepares weights and allocates scratch: not capture-legal.
    """

    def __init__(self, comm, caps: MoECaps, spec: MoESpec, weights: tuple, norm_weight: torch.Tensor,
                 *, eps: float = 1e-6, bias: torch.Tensor | None = None):
        if norm_weight.shape != (caps.hidden,):
            raise ShapeError(f"norm_weight must be [{caps.hidden}], got {tuple(norm_weight.shape)}")
        self.comm = comm
        self.caps = replace(caps, tp_rank=comm.rank, tp_size=comm.world_size)
        self.moe = MoELayer(self.caps, spec, weights, device=comm.device, bias=bias)
        self.norm_weight = norm_weight.to(comm.device)
        self.eps = eps

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, residual: torch.Tensor, *,
                 partial: torch.Tensor | None = None):
        """x: bf16 [T, H] (replicated); logits: [T, E] (replicated); residual: bf16 [T, H].

        Returns (out, residual_out): residual_out = residual + sum over ranks of
        this block's partial MoE output, out = rmsnorm(residual_out) * norm_weight,
        bitwise identical on every rank. `partial` [T, H] is the scratch for this
        rank's share (allocated if None; pass it for CUDA graphs). No host sync.
        """
        partial = self.moe(x, logits, out=partial)
        return self.comm.all_reduce_add_rms_norm(partial, residual, self.norm_weight, self.eps)
