"""Pure-torch fp32 reference of the MoE layer, for every `MoESpec`.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate, N1 = 2I or I.
"""

from __future__ import annotations

import torch

from sparkinfer.moe.spec import MoESpec
from sparkinfer.quant.fp8 import (FP8BlockTensor, dequantize_fp8_block, dequantize_fp8_groups,
                                  quantize_fp8_groups)
from sparkinfer.quant.nvfp4 import NVFP4Tensor, dequantize_nvfp4

__all__ = ["moe_reference", "activation_reference", "split_gate_up"]


def activation_reference(g: torch.Tensor, u: torch.Tensor | None, spec: MoESpec) -> torch.Tensor:
    """fp32 activation of pre-activations g (and u when gated), any shape."""
    if spec.activation == "silu":
        return torch.nn.functional.silu(g) * u
    if spec.activation == "relu2":
        return torch.relu(g).square()
    gc = g.clamp(max=spec.swiglu_limit)
    uc = u.clamp(-spec.swiglu_limit, spec.swiglu_limit)
    return gc * torch.sigmoid(spec.swiglu_alpha * gc) * (uc + 1.0)


def split_gate_up(h1: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """FC1 output [..., 2I] in spec.gate_up_order -> (gate [..., I], up [..., I])."""
    if spec.gate_up_order == "interleaved":
        return h1[..., 0::2], h1[..., 1::2]
    a, b = h1.chunk(2, dim=-1)
    return (a, b) if spec.gate_up_order == "gate_up" else (b, a)


def _expert(w, e: int) -> torch.Tensor:
    """fp32 weights of expert e (dequantizes only that expert: real model sizes fit)."""
    if isinstance(w, NVFP4Tensor):
        return dequantize_nvfp4(NVFP4Tensor(w.packed[e], w.scales[e], w.global_scale[e]))
    if isinstance(w, FP8BlockTensor):
        return dequantize_fp8_block(FP8BlockTensor(w.weight[e], w.scale[e]))
    return w[e].float()


def _fp8_round_trip(a: torch.Tensor) -> torch.Tensor:
    """a [..., K] through E4M3 per 128-element group and back (fp32), as the
    fp8_block kernels quantize their activations."""
    return dequantize_fp8_groups(*quantize_fp8_groups(a))


def moe_reference(x: torch.Tensor, weights: tuple, routing: tuple[torch.Tensor, torch.Tensor], *,
                  spec: MoESpec, act_quant: bool | None = None) -> torch.Tensor:
    """x [T, H]; weights = (w1 [E, N1, H], w2 [E, H, I]) dense, `NVFP4Tensor` or
    `FP8BlockTensor` (dequantized: the reference of a quantized layer is its
    dequantized weights), rows in spec.gate_up_order, this rank's shard;
    routing = (ids [T, K], weights [T, K]). Returns fp32 [T, H]. Ids outside
    [0, E) add nothing.

    act_quant: round x and FC2's input (after the router weight when it comes
    first) through E4M3 per token and 128 elements, as W8A8 computes
    (`sparkinfer.quant.fp8.quantize_fp8_groups`); None: when the weights are
    FP8BlockTensors. The rest is fp32.
    Allocates; syncs with the host (loops over the active experts); not capture-legal.
    """
    w1, w2 = weights
    ids, rw = routing
    if act_quant is None:
        act_quant = isinstance(w1, FP8BlockTensor)
    xf = _fp8_round_trip(x) if act_quant else x.float()
    e_count = w1.shape[0]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < e_count:
            continue
        t_idx, k_idx = torch.nonzero(ids == e, as_tuple=True)
        h1 = xf[t_idx] @ _expert(w1, e).t()
        g, u = split_gate_up(h1, spec) if spec.gated else (h1, None)
        a = activation_reference(g, u, spec)
        wr = rw[t_idx, k_idx].float()[:, None]
        if not spec.router_weight_after_fc2:
            a = a * wr
        if act_quant:
            a = _fp8_round_trip(a)
        h2 = a @ _expert(w2, e).t()
        if spec.router_weight_after_fc2:
            h2 = h2 * wr
        out.index_add_(0, t_idx, h2)
    return out
