"""Launch the top-k routing kernel.

Legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import torch
import triton

from sparkinfer.envs import triton_interpret
from sparkinfer.errors import DTypeError, PlanError, ShapeError
from sparkinfer.moe.routing.kernel import routing_kernel
from sparkinfer.moe.spec import MoESpec

# Programmatic dependent launch behind the router projection (kernel.py), and one warp
# a token instead of four: each of the K selections is a max and a min over the E
# scores, in a chain, and within one warp a reduction is shuffles alone (across four it
# also crosses shared memory and a barrier). Compiled for sm_90 on the CPU
# (tests/models/test_compile_sm90.py).
# These two, rope.launch.ROPE_PDL and norm.launch.NORM_WAIT are on since an H100 A/B in
# two calls (sweeps/decode_pdl_flags_ab_h100.json, docs/performance.md): batch 1 Qwen3-30B-A3B
# -1.3% with the three PDL flags, -3% with one-warp routing too; GLM-4.5-Air and Mixtral -0.6%.
ROUTING_PDL = True
ROUTING_WARPS = 1


def route(logits: torch.Tensor, spec: MoESpec, out: tuple[torch.Tensor, torch.Tensor], *,
          bias: torch.Tensor | None = None) -> None:
    """Top-k routing of logits [T, E] (bf16/fp16/fp32) into out = (ids [T, K] int32,
    weights [T, K] fp32), per `spec.routing`.

    bias: fp32 [E] correction bias ("sigmoid_grouped" only; selection uses
    sigmoid + bias, weights use the sigmoid alone). Allocates nothing, no host
    sync, capture-legal.
    """
    ids, w = out
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ShapeError(f"route: logits shape {tuple(logits.shape)} stride {logits.stride()}; "
                         "need [T, E] with unit stride along E")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"route: logits dtype {logits.dtype}; use bf16, fp16 or fp32")
    t, e = logits.shape
    k = ids.shape[-1]
    if ids.shape != (t, k) or w.shape != (t, k) or not ids.is_contiguous() or not w.is_contiguous():
        raise ShapeError(f"route: outputs {tuple(ids.shape)}, {tuple(w.shape)}; need contiguous "
                         f"[T={t}, K] for both")
    if ids.dtype != torch.int32 or w.dtype != torch.float32:
        raise DTypeError(f"route: outputs {ids.dtype}, {w.dtype}; need int32 ids, fp32 weights")
    sigmoid = spec.routing == "sigmoid_grouped"
    if sigmoid and e % spec.n_group != 0:
        raise PlanError(f"route: E={e} not divisible by n_group={spec.n_group}")
    if bias is not None and (bias.shape != (e,) or bias.dtype != torch.float32):
        raise ShapeError(f"route: bias {tuple(bias.shape)} {bias.dtype}; need fp32 [E={e}]")
    g = spec.n_group if sigmoid else 1
    if sigmoid and g > 1 and g & (g - 1):
        raise PlanError(f"route: n_group={g} must be a power of two")
    if t == 0:
        return
    pdl = ROUTING_PDL and logits.device.type != "cpu" and not triton_interpret()
    routing_kernel[(t,)](
        logits, bias if bias is not None else w, ids, w, logits.stride(0),
        float(spec.routed_scaling_factor),
        E=e, EP=triton.next_power_of_2(e), K=k, KP=triton.next_power_of_2(k),
        SIGMOID=sigmoid, G=g, EG=e // g, TG=spec.topk_group if sigmoid else 1,
        RENORM=spec.renormalize, PDL=pdl, num_warps=ROUTING_WARPS, **(dict(launch_pdl=True) if pdl else {}))
