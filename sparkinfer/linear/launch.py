"""Host side of `linear`: check, pick the tile, launch (or hand larger batches to torch)."""

from __future__ import annotations

import torch
import triton

from sparkinfer.envs import triton_interpret
from sparkinfer.errors import DTypeError, LayoutError, ShapeError
from sparkinfer.linear.kernel import linear_rows_kernel

__all__ = ["linear", "LINEAR_MAX_ROWS", "tile_for"]

# Rows this kernel serves (one MMA's narrow side); more go to F.linear, whose
# tensor-core tiles fill at larger M.
LINEAR_MAX_ROWS = 16
# Tile: 64 output features x 128 of K a step, 6 steps in flight; a narrower BN only
# for weights of under 1024 rows (a router), so they still spread over 16+ programs.
# H200 at b2e0991, one 8-weight graph per shape (sweep in the commit that set this):
# BN 64 / BK 128 / 6 stages was the fastest of 29 tiles at every shape printed,
# e.g. Mixtral o [4096, 4096] M=1 11.24 us vs cuBLAS 13.31, qkv [6144, 4096] 14.48
# vs 15.46, GLM-4.5-Air shared-expert down [4096, 1408] M=8 5.71 vs 6.13.
_BLOCK_N, _SMALL_N, _BLOCK_N_SMALL = 64, 1024, 16
_BLOCK_K = 128
_MAX_STAGES = 6
_SMEM = 180 * 1024  # of the H200's 227 KiB per SM, what the pipelined tiles may take


def tile_for(n: int, k: int, elem: int = 2) -> dict:
    """Launch parameters for an [N, K] weight of `elem`-byte elements; depend on the
    weight only, never on M, so a row's result is the same bits at any batch. Pure."""
    bn = _BLOCK_N if n >= _SMALL_N else _BLOCK_N_SMALL
    bk = min(_BLOCK_K, triton.next_power_of_2(k))
    stages = max(2, min(_MAX_STAGES, _SMEM // ((bn + LINEAR_MAX_ROWS) * bk * elem)))
    return dict(BN=bn, BK=bk, EVEN_K=k % bk == 0, num_warps=4, num_stages=stages)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias [N]) -> [M, N] in x's dtype.

    M <= LINEAR_MAX_ROWS runs the Triton kernel (fp32 accumulation, one fixed sum
    order per output: a row's result does not depend on M); larger M, or a
    weight with a non-contiguous K, runs F.linear. Allocates `out` unless given;
    no host sync; capture-legal.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ShapeError(f"linear: x [M, K] and w [N, K] with the same K; got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"linear: x and w must share a float dtype; got {x.dtype} and {w.dtype}")
    m, k = x.shape
    n = w.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ShapeError(f"linear: bias must be [N={n}] {x.dtype}; got {tuple(bias.shape)} {bias.dtype}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise LayoutError(f"linear: out must be [M, N] = {(m, n)} {x.dtype} with a contiguous last dim; got "
                          f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if m > LINEAR_MAX_ROWS or w.stride(1) != 1 or x.stride(1) != 1:
        return torch.addmm(bias, x, w.t(), out=out) if bias is not None else torch.mm(x, w.t(), out=out)
    if m == 0:
        return out
    t = tile_for(n, k, x.element_size())
    linear_rows_kernel[(triton.cdiv(n, t["BN"]),)](
        x, w, bias if bias is not None else w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BM=LINEAR_MAX_ROWS, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or triton_interpret(),
        INTERPRET=triton_interpret(), **t)
    return out
