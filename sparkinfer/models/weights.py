"""What one rank holds of a model: the contract between the loader and the decoder.

Legend: H hidden, V vocabulary, D head dim, Hq query heads, KVH key/value heads,
E routed experts, I intermediate (MoE or dense MLP), W tensor-parallel ranks;
a trailing `_l` means this rank's share.

Every tensor is on the rank's device, contiguous, bf16 unless stated, and
already sliced for the rank (see `Sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.errors import ShapeError

__all__ = ["Sharding", "AttentionWeights", "DenseMLPWeights", "ExpertWeights", "LayerWeights",
           "ModelWeights"]


@dataclass(frozen=True)
class Sharding:
    """How a model is split over W tensor-parallel ranks.

    rank, world: this rank and W. dcp: 1, or W for decode-context parallelism
    (the KV cache split over ranks by token position: position p lives on rank
    p % W at local index p // W).

    Heads: rank r computes query heads [r * Hq/W, (r + 1) * Hq/W). Without dcp,
    KV heads are split the same way when KVH >= W (KVH % W == 0), else every
    rank holds the one KV head its query heads read (kv head = first local
    query head // (Hq / KVH)). With dcp = W every rank projects all KVH heads
    (replicated k/v weights) and stores its token share of every head.
    """

    rank: int = 0
    world: int = 1
    dcp: int = 1

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ShapeError(f"Sharding: rank {self.rank} outside [0, world={self.world})")
        if self.dcp not in (1, self.world):
            raise ShapeError(f"Sharding: dcp={self.dcp}; must be 1 or the world size {self.world}")

    def split(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's share of n (n % W == 0, else ShapeError naming `what`)."""
        if n % self.world:
            raise ShapeError(f"{what}={n} does not divide over {self.world} tensor-parallel ranks; "
                             f"choose a world size that divides it")
        step = n // self.world
        return self.rank * step, (self.rank + 1) * step


@dataclass
class AttentionWeights:
    """qkv: [(Hq_l + 2 * KVH_l) * D, H], rows q heads then k heads then v heads.
    qkv_bias: [(Hq_l + 2 * KVH_l) * D] or None. o: [H, Hq_l * D] (input-dim shard:
    each rank's product is a partial sum). q_norm, k_norm: [D] per-head RMSNorm
    weights (Qwen3) or None. kv_heads: KVH_l, the KV heads this rank holds."""

    qkv: torch.Tensor
    o: torch.Tensor
    kv_heads: int
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class DenseMLPWeights:
    """gate_up: [2 * I_l, H], gate rows then up rows; down: [H, I_l]; act silu."""

    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class ExpertWeights:
    """router: [E, H] (replicated): bf16 for softmax routing; fp32 for
    "sigmoid_grouped" (GLM: transformers keeps that router in fp32 and computes
    its logits in fp32, `_keep_in_fp32_modules_strict`). correction_bias:
    fp32 [E] (sigmoid grouped routing) or None. w1: [E, 2 * I_l, H], gate rows then
    up rows; w2: [E, H, I_l]; bf16 tensors or `sparkinfer.quant.NVFP4Tensor`s.
    shared: the shared experts (all of them concatenated along I, then sharded)
    or None."""

    router: torch.Tensor
    w1: object
    w2: object
    correction_bias: torch.Tensor | None = None
    shared: DenseMLPWeights | None = None


@dataclass
class LayerWeights:
    """input_norm, post_attn_norm: [H]; mlp: dense or MoE."""

    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    attn: AttentionWeights
    mlp: DenseMLPWeights | ExpertWeights


@dataclass
class ModelWeights:
    """embed, lm_head: [V_l, H], rows [vocab_start, vocab_start + V_l) of the
    vocabulary padded to a multiple of W (padding rows are zero; lm_head is
    embed when the checkpoint ties them). final_norm: [H]."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    layers: list[LayerWeights]
    vocab_start: int
