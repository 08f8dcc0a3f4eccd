"""Numerics (`MoESpec`) and capacities (`MoECaps`) of a Mixture-of-Experts layer.

Legend: T tokens, E experts, K experts per token (top-k), H hidden size,
I intermediate size per tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.errors import DTypeError, PlanError

__all__ = ["MoESpec", "MoECaps", "WEIGHT_FORMATS", "ACTIVATIONS", "GATE_UP_ORDERS", "ROUTINGS"]

WEIGHT_FORMATS = ("bf16", "nvfp4", "fp8_block")
ACTIVATIONS = ("silu", "relu2", "swiglu_oai")
# How the gated FC1 weight [E, 2I, H] stacks its halves: gate rows then up rows,
# up then gate, or alternating rows (gpt-oss: gate = rows 0, 2, 4..).
GATE_UP_ORDERS = ("gate_up", "up_gate", "interleaved")
ROUTINGS = ("softmax", "sigmoid_grouped")


@dataclass(frozen=True)
class MoESpec:
    """What the layer computes. out[t] = sum_k w[t,k] * FC2_e(act(FC1_e(x[t]))), e = ids[t,k].

    weight_format: "bf16"; "nvfp4" (E2M1 + E4M3 per 16 + fp32 global, see
        `sparkinfer.quant.nvfp4`; compute is bf16 on tensor cores, fp32
        accumulate); or "fp8_block" (W8A8: E4M3 weights with an fp32 scale per
        128 x 128 block, as FP8 checkpoints store them, `sparkinfer.quant.fp8`;
        activations quantized to E4M3 per token and 128 elements on the fly;
        E4M3 tensor-core dots, fp32 accumulate, the scales applied per K block).
        fp8_block needs H and the per-rank I to be multiples of 128 (`plan`) and
        takes no "interleaved" gate_up_order (its 128-row scale blocks would mix
        gate and up rows).
    activation: "silu" (silu(gate) * up), "swiglu_oai" (gpt-oss: clamp at
        `swiglu_limit`, gate * sigmoid(swiglu_alpha * gate) * (up + 1)) or
        "relu2" (relu(h)**2, not gated: FC1 is [E, I, H]).
    gate_up_order: row order of the gated FC1 weight, one of GATE_UP_ORDERS.
    router_weight_after_fc2: True multiplies each route's FC2 output by its
        router weight; False multiplies the activation before FC2 (same math,
        different rounding).
    routing: "softmax" (softmax over E, top-k, optional renormalize) or
        "sigmoid_grouped" (DeepSeek-V3: sigmoid, correction bias for selection,
        top `topk_group` of `n_group` groups by their top-2 sum, weights
        renormalized, times `routed_scaling_factor`).
    """

    weight_format: str = "bf16"
    activation: str = "silu"
    gate_up_order: str = "gate_up"
    router_weight_after_fc2: bool = True
    routing: str = "softmax"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        for name, value, allowed in (("weight_format", self.weight_format, WEIGHT_FORMATS),
                                     ("activation", self.activation, ACTIVATIONS),
                                     ("gate_up_order", self.gate_up_order, GATE_UP_ORDERS),
                                     ("routing", self.routing, ROUTINGS)):
            if value not in allowed:
                raise PlanError(f"MoESpec.{name}={value!r}; choose one of {allowed}")
        if self.weight_format == "fp8_block" and self.gate_up_order == "interleaved":
            raise PlanError("MoESpec: weight_format='fp8_block' with gate_up_order='interleaved'; "
                            "a 128-row scale block would hold gate and up rows. Use 'gate_up' or "
                            "'up_gate' (FP8 checkpoints stack the halves), or bf16 weights")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise PlanError(f"MoESpec: n_group={self.n_group}, topk_group={self.topk_group}; "
                            "need 1 <= topk_group <= n_group")

    @property
    def gated(self) -> bool:
        """True when FC1 produces gate and up halves ([E, 2I, H])."""
        return self.activation != "relu2"


@dataclass(frozen=True)
class MoECaps:
    """Capacities fixed at setup, and the facts of the GPU the plan targets.

    max_tokens: largest T any call will pass. num_experts E, top_k K,
    hidden H, intermediate I (per rank: the full size divided by tp_size).
    tp_rank / tp_size: this rank's shard of I. out_dtype: bf16 or fp16.
    deterministic: bitwise repeatable outputs (fixed-order top-k sum, no atomics).
        Every kernel family is atomic-free and fixed-order today, so both values
        give the same, repeatable bits; a faster atomic path for False would be
        added only where measured faster.
    num_sms: streaming multiprocessors of the target GPU (132 on an H200); the
    planner splits work to fill them.
    batch_invariant: a token's output is the same bits at every T, whatever
    the other tokens are: no reduction split chosen by T, and both families
    round a route's FC2 output to out_dtype before the top-k sum (`plan.py`;
    the NVFP4 dequantized path, chosen by T, sums in the NVFP4 kernels' order).
    False: splits where they measured faster.
    dequant_scratch_bytes: the most scratch the NVFP4 large-batch path may hold
    for bf16 copies of a chunk of experts (`plan.NVFP4_DEQUANT_MIN_ROWS`); 0
    never takes that path. 512 MiB holds 2 Mixtral FC1s (235 MB each), 9
    DeepSeek-V3 FC1s (58.7 MB), 85 Qwen3-30B-A3B FC1s (6.3 MB).
    """

    max_tokens: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    tp_rank: int = 0
    tp_size: int = 1
    out_dtype: torch.dtype = torch.bfloat16
    deterministic: bool = True
    num_sms: int = 132
    dequant_scratch_bytes: int = 512 << 20
    batch_invariant: bool = True

    def __post_init__(self):
        for name in ("max_tokens", "num_experts", "top_k", "hidden", "intermediate", "tp_size",
                     "num_sms"):
            if getattr(self, name) < 1:
                raise PlanError(f"MoECaps.{name}={getattr(self, name)}; must be >= 1")
        if self.dequant_scratch_bytes < 0:
            raise PlanError(f"MoECaps.dequant_scratch_bytes={self.dequant_scratch_bytes}; must be "
                            ">= 0 (0 turns the NVFP4 dequantized path off)")
        if self.top_k > self.num_experts:
            raise PlanError(f"MoECaps.top_k={self.top_k} > num_experts={self.num_experts}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise PlanError(f"MoECaps.tp_rank={self.tp_rank} outside [0, tp_size={self.tp_size})")
        if self.out_dtype not in (torch.bfloat16, torch.float16):
            raise DTypeError(f"MoECaps.out_dtype={self.out_dtype}; use torch.bfloat16 or "
                             "torch.float16")
