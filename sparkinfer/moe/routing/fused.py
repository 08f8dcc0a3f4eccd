"""The router projection and the top-k routing in one launch, for decode batches.

Legend: T tokens (the projection's M), E experts, K top-k, H hidden, NB feature blocks
of the projection's grid.

`route_projection(x, w, spec, out)` computes logits = x @ w.T with `sparkinfer.linear`'s
program (the same tile, so the same sums and bits as `linear(x, w)`) and routes them with
the routing kernel's `route_token`: every program that stores final logits (each
program unsplit, each feature block's finisher split) then counts itself on one more
semaphore slot, and the last of the NB to arrive routes all T tokens and zeroes the slot
for the next call (and graph replay). So a decode step's MoE layer launches one kernel
fewer: the routing kernel, its launch and its wait on the router (issue 28's "router
with the routing").

The last program routes the tokens one after another, so the fusion serves up to
FUSED_MAX_ROWS rows; above that (and where `linear` would run coarse pieces) the
projection and the routing kernel run as two launches. The routing is one function
(`route_token`) whose sums have one association (`pair_sum`), so both paths give the
same ids and weights bit for bit, and a row's routing does not depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkinfer.errors import LayoutError
from sparkinfer.linear import config
from sparkinfer.linear.config import LinearTile
from sparkinfer.linear.kernel import _linear_program, grid_last, grid_reset
from sparkinfer.linear.launch import _check, coarse_call, default_tile, fine_call, fine_launch, linear, linear_sync
from sparkinfer.moe.routing.kernel import route_token
from sparkinfer.moe.routing.launch import check_route, route, route_constants
from sparkinfer.moe.spec import MoESpec

__all__ = ["route_projection", "router_sync", "FUSED_MAX_ROWS", "ROUTER_FUSED"]

# Rows the fused epilogue routes (one program, a token at a time): decode batches.
FUSED_MAX_ROWS = 16
# The fused launch in decode steps (models/decoder.py); off: projection + routing kernel.
ROUTER_FUSED = True


@triton.jit(do_not_specialize=["M"])
def router_topk_kernel(p_x, p_w, p_b, p_out, p_part, p_sync, M, N, K, k_slice, stride_xm, stride_xk, stride_wn,
                       stride_om, stride_ps, stride_pn, p_bias, p_ids, p_tw, scale,
                       BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, RB: tl.constexpr,
                       SPLIT: tl.constexpr, GROUP: tl.constexpr, SLICE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       GATED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, STREAM: tl.constexpr,
                       E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
                       SIGMOID: tl.constexpr, G: tl.constexpr, EG: tl.constexpr, TG: tl.constexpr,
                       RENORM: tl.constexpr):
    done = _linear_program(p_x, p_w, p_b, p_out, p_part, p_sync, M, N, K, k_slice, stride_xm, stride_xk,
                           stride_wn, stride_om, stride_ps, stride_pn, BN, BK, KS, RB, STREAM, SPLIT, GROUP,
                           SLICE, HAS_BIAS, GATED, PRECISION, PDL)
    p_ticket = p_sync + tl.num_programs(0)  # the slot past the feature blocks' (`router_sync`)
    if grid_last(done, p_ticket):  # every block's logits are visible to it
        for t in range(0, M):
            route_token(p_out + t * stride_om, p_bias, p_ids + t * TOPK, p_tw + t * TOPK, scale,
                        E, EP, TOPK, KP, SIGMOID, G, EG, TG, RENORM, CG=True)
        grid_reset(p_ticket)


def router_sync(w: torch.Tensor) -> torch.Tensor:
    """Semaphores of one router call site: `linear_sync(w)`'s and the routing's ticket."""
    return linear_sync(w, tickets=1)


def route_projection(x: torch.Tensor, w: torch.Tensor, spec: MoESpec, out: tuple[torch.Tensor, torch.Tensor], *,
                     sync: torch.Tensor, logits: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     fused: bool | None = None, tile: LinearTile | None = None) -> torch.Tensor:
    """Router logits = x [T, H] @ w [E, H].T (w bf16, or fp32 with a 16-bit x) routed per
    `spec.routing` into out = (ids int32 [T, K], weights fp32 [T, K]), as `linear` and
    `route` would make them (same bits). sync: `router_sync(w)`, owned by this call site.
    logits: [T, E] in w's dtype (allocated if None). bias: "sigmoid_grouped"'s fp32 [E].
    fused: one launch (default ROUTER_FUSED) where T <= FUSED_MAX_ROWS and the call is one
    fine launch of `linear`; else the projection and the routing kernel. tile: `linear`'s
    (tests; keep it fixed per weight). Returns logits.
    No host sync; capture-legal once the shape ran eagerly."""
    t, e = x.shape[0], w.shape[0]
    _check(x, w, None, logits, sync, False)
    check_route((t, e), x.dtype if w.dtype != torch.float32 else w.dtype, spec, out, bias)
    if sync.numel() < triton.cdiv(e, config.BLOCK_N) + 1:
        raise LayoutError(f"route_projection: sync must be router_sync(w) ({triton.cdiv(e, config.BLOCK_N) + 1} "
                          f"int32); got {sync.numel()}")
    if logits is None:
        logits = torch.empty((t, e), dtype=w.dtype, device=x.device)
    tile = tile or default_tile(w, x.device, True)
    use = (ROUTER_FUSED if fused is None else fused) and t <= FUSED_MAX_ROWS and fine_call(t, w, x.device)
    if not use or coarse_call(t, tile, w, False):
        linear(x, w, out=logits, sync=sync, tile=tile, invariant=True)
        route(logits, spec, out, bias=bias)
        return logits
    ids, tw = out
    grid, args, kw = fine_launch(x, w, None, logits, sync, tile, None, False)
    c = route_constants(e, ids.shape[-1], spec)
    router_topk_kernel[grid](*args, bias if bias is not None else tw, ids, tw, float(spec.routed_scaling_factor),
                             STREAM=tile.stream, E=c["E"], EP=c["EP"], TOPK=c["K"], KP=c["KP"],
                             SIGMOID=c["SIGMOID"], G=c["G"], EG=c["EG"], TG=c["TG"], RENORM=c["RENORM"], **kw)
    return logits
