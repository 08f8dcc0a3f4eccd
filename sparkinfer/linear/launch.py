"""Host side of `linear`: check, pick the tile, launch (or hand larger batches to torch)."""

from __future__ import annotations

import torch
import triton

from sparkinfer.envs import triton_interpret
from sparkinfer.errors import DTypeError, LayoutError, ShapeError
from sparkinfer.linear.kernel import linear_rows_kernel
from sparkinfer.runtime.devices import cuda_sm_count

__all__ = ["linear", "linear_sync", "LINEAR_MAX_ROWS", "tile_for"]

# Rows this kernel serves (one MMA's narrow side); more go to F.linear, whose
# tensor-core tiles fill at larger M.
LINEAR_MAX_ROWS = 16
# Tile: 64 output features x 128 of K a step, 6 steps in flight. H200 at 0f9fd66
# (benchmarks/results/sweeps/linear_sweep_h200.json: 24 tiles x 9 decode shapes x
# M 1 / 8 in 8-weight graphs), us of this tile vs cuBLAS at M = 1: Qwen3-30B-A3B qkv
# [5120, 2048] 7.57 vs 8.06, o [2048, 4096] 9.19 vs 9.46; GLM-4.5-Air qkv 30.8 vs
# 32.9, o 27.3 vs 29.1, dense gate_up 45.6 vs 47.4, shared-expert gate_up 9.76 vs
# 11.1 (the best tile per shape is within 5% of it). Unsplit, routers stay with
# cuBLAS (at [128, 2048] no tile beat it, 4.85 vs 4.86 us; split, below, they
# gain); fp32 weights (GLM-4.5's router) take IEEE fp32 dots here, 80 us vs 5.0.
_BLOCK_N, _SMALL_N = 64, 1024
_BLOCK_K = 128
_MAX_STAGES = 6
_SMEM = 180 * 1024  # of the H200's 227 KiB per SM, what the pipelined tiles may take
# Split K when the feature blocks fill at most a third of the SMs: a few-row
# projection is bound by the weight bytes in flight. The slices' partials meet in
# the last program of each block (kernel.py), so a split costs no launch; a
# slice keeps at least SPLIT_MIN_STEPS BK steps, and split launches pipeline
# SPLIT_STAGES deep (short slices fill no deeper pipe). H200 at f64ac5d
# (benchmarks/results/sweeps/linear_split_sweep_h200.json: split 1..16 x stages
# 4 / 6, M 1 and 8, graphs over distinct weights), us at M = 1: Qwen3-30B-A3B o
# [2048, 4096] (32 blocks) 8.17 split 4 vs 9.33 unsplit, cuBLAS 9.38; its router
# [128, 2048] 4.31 split 4 vs cuBLAS 4.91; Mixtral's router [8, 4096] 4.45 split 8
# vs 5.68; GLM-4.5-Air shared gate_up (44 blocks) 9.69 split 3 vs 9.74. At 64
# blocks and more every split was slower (GLM-4.5-Air o 27.48 unsplit, 27.82 split 2).
SPLIT_MIN_STEPS = 4
SPLIT_STAGES = 4


def tile_for(n: int, k: int, elem: int = 2, num_sms: int = 1) -> dict:
    """Launch parameters for an [N, K] weight of `elem`-byte elements on a device of
    `num_sms` SMs; depend on the weight and the device only, never on M, so a row's
    result is the same bits at any batch. Pure."""
    bn = _BLOCK_N
    bk = min(_BLOCK_K, triton.next_power_of_2(k))
    stages = max(2, min(_MAX_STAGES, _SMEM // ((bn + LINEAR_MAX_ROWS) * bk * elem)))
    blocks, steps = triton.cdiv(n, bn), triton.cdiv(k, bk)
    split = max(1, min(num_sms // blocks, steps // SPLIT_MIN_STEPS)) if 3 * blocks <= num_sms else 1
    k_slice = triton.cdiv(steps, split) * bk
    split = triton.cdiv(k, k_slice)
    return dict(BN=bn, BK=bk, EVEN_K=k % bk == 0, num_warps=4, num_stages=min(stages, SPLIT_STAGES) if split > 1
                else stages, SPLIT=split, K_SLICE=k_slice)


def linear_sync(w: torch.Tensor) -> torch.Tensor:
    """The split-K semaphores of one call site of `linear` with weight `w`: int32
    zeros, one per 64 output features, which the kernel counts up and resets. Give
    each call site its own (two calls that may run at once must not share one);
    allocate it before capturing a graph that uses it."""
    return torch.zeros(triton.cdiv(w.shape[0], _BLOCK_N), dtype=torch.int32, device=w.device)


def _num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 1 for the interpreter (it runs programs one after another)."""
    return cuda_sm_count(device) if device.type == "cuda" else 1


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None, sync: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias [N]) -> [M, N] in x's dtype.

    M <= LINEAR_MAX_ROWS, N >= 1024 and bf16 / fp16 runs the Triton kernel (fp32
    accumulation, one fixed sum order per output: a row's result does not depend
    on M); anything else (more rows, a router-sized N, fp32, a non-contiguous K)
    runs torch's matmul. `sync` (from `linear_sync(w)`, owned by this call site)
    lets the kernel split K over idle SMs; without it no split. Allocates `out`
    unless given (and a split's fp32 partials); no host sync; capture-legal.
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
    blocks = triton.cdiv(n, _BLOCK_N)
    if sync is not None and (sync.dtype != torch.int32 or sync.numel() < blocks or sync.device != x.device):
        raise LayoutError(f"linear: sync must be linear_sync(w): {blocks} int32 on {x.device}; got "
                          f"{sync.numel()} {sync.dtype} on {sync.device}")
    t = tile_for(n, k, x.element_size(), _num_sms(x.device) if sync is not None else 1)
    router = n < _SMALL_N and t["SPLIT"] == 1  # too few blocks, unsplit: cuBLAS is as fast
    if m > LINEAR_MAX_ROWS or router or x.dtype == torch.float32 or w.stride(1) != 1 or x.stride(1) != 1:
        return torch.addmm(bias, x, w.t(), out=out) if bias is not None else torch.mm(x, w.t(), out=out)
    if m == 0:
        return out
    part = out
    if t["SPLIT"] > 1:
        part = torch.empty((t["SPLIT"], blocks * t["BN"], LINEAR_MAX_ROWS), dtype=torch.float32, device=x.device)
    linear_rows_kernel[(blocks, t["SPLIT"])](
        x, w, bias if bias is not None else w, out, part, sync if sync is not None else out, m, n, k,
        t.pop("K_SLICE"), x.stride(0), w.stride(0), out.stride(0),
        BM=LINEAR_MAX_ROWS, HAS_BIAS=bias is not None, INTERPRET=triton_interpret(), **t)
    return out
