"""`gemm(x, w, bias)`: y = x @ w.T (+ bias) for prefill rows, a row's result the same
bits at any M.

Legend: M rows of x, N output features, K reduction; BM x BN the output tile of a
program, BK the K of one pipelined step, G row tiles per group of the launch order.

`linear` serves decode rows (M <= 128, weights streamed at the copy rate); a
prefill forward of several requests' chunks has hundreds to thousands of rows and
is compute-bound, where cuBLAS picks its kernel (and so each sum's order) by M.
Here every output element is one fp32 accumulator stepped through K in BK = 64
steps in K order whatever the tile, and rows beyond M load as zero, so no row's sum
sees M or the other rows; the tile (`gemm_tile`) follows M and N only to fill the SMs
(BM and BN change which tensor-core instruction covers an element, not the order of
its products: the MoE kernels rest on the same fact, moe/plan.py). Tiles are
launched in groups of G row tiles per feature column so a weight tile is reused
from L2.

One H200 (prefill forwards of R rows x 256 tokens of an 8-layer Qwen3-30B-A3B,
.gpu probes at 41c264f): `linear` on 128-row pieces took a 2,048-token forward to
30.0 ms against 6.55 ms with cuBLAS (14.7 vs 3.2 us a token); this kernel replaces
the pieces (its own numbers: docs/performance.md, benchmarks/results/prefill_h200.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sparkinfer.envs import triton_interpret
from sparkinfer.errors import DTypeError, LayoutError, ShapeError
from sparkinfer.runtime.devices import cuda_sm_count

__all__ = ["gemm", "gemm_tile", "GEMM_WIDE", "GEMM_MID", "GEMM_NARROW", "GEMM_CANDIDATES", "GEMM_SCHEDULE"]

# (BM, BN, BK, stages, warps, G). Wide: 128 x 128 tiles of bf16 in 64-deep steps, 4
# stages (128 KiB of shared memory on sm_90's 227), 8 warps (two warpgroups of
# m64n128k16). Mid: 64 x 128 in one warpgroup; narrow: 64 x 64, 4x the wide programs.
# The widest tile of which at least GEMM_MIN_TILES fill the 132 SMs; narrow below
# that (routers at any M, short chunks). x and w arrive by TMA descriptors
# (GEMM_TMA). One H200, benchmarks/sweeps/gemm_tile_sweep.py (CUDA graphs of 20 calls),
# Qwen3-30B-A3B's qkv / o / router, us. At 24301af (sweeps/gemm_tile_sweep_h200_24301af.json,
# every tile by both loads, the earlier rule planned), this rule's tiles by TMA against
# the earlier rule (wide or narrow) by per-thread loads:
#   M = 256: 12.8 / 12.3 / 7.2 against 16.5 / 16.3 / 9.6 (cuBLAS 10.1 / 11.4 / 5.1);
#   M = 512: 24.1 / 14.5 / 7.0 against 31.4 / 22.6 / 8.8 (cuBLAS 16.5 / 16.3 / 5.3);
#   M = 1,024: 37.6 / 23.9 / 7.0 against 46.8 / 29.5 / 8.9 (29.7 / 22.9 / 5.4);
#   M = 2,048: 70.7 / 49.8 / 7.1 against 79.4 / 58.7 / 8.9 (57.3 / 44.2 / 6.1);
# the best of 14 tiles and loads within 10% of the rule (qkv at 512: 21.9 in 128 x 64).
# At f23d3de, this rule planned (sweeps/gemm_tile_sweep_h200.json, with GLM-4.5-Air's and
# Mixtral's shapes): the same within 3% on Qwen3's; the best within 10% of the planned
# row but for Qwen3's qkv at 512 (24.3 against 21.8) and Mixtral's o at 256 rows (20.6
# against 15.3 in 128 x 64; one run, not taken). The first row timed of a shape can read
# high: GLM-4.5-Air's router at 256, planned 64 x 64 by TMA, 15.0, the same tile again 12.0.
# Every candidate, by either load, gave the planned tile's bits at every shape and M.
GEMM_WIDE = (128, 128, 64, 4, 8, 8)
GEMM_MID = (64, 128, 64, 4, 4, 8)
GEMM_NARROW = (64, 64, 64, 4, 4, 8)
GEMM_MIN_TILES = 96
# x and w by TMA descriptors (the MoE kernels' loads) instead of per-thread loads,
# where both are 16-byte aligned (a row stride of 8 bf16 elements).
GEMM_TMA = True
# How programs map to tiles (`gemm`'s schedule): one a tile; one an SM walking them
# (persistent); persistent with the TMA loads and the MMAs in separate warps ("ws",
# Triton's warp specialization). Compiled for sm_90 on the CPU (Triton 3.6,
# tests/models/test_compile_sm90.py): the loop is partitioned (a producer warp and
# setmaxnreg) for tiles of 4 warps only; at 8 warps (128 x 128, 128 x 256) it stays
# one partition, the persistent schedule. Untimed: benchmarks/sweeps/gemm_tile_sweep.py
# --schedules times them. On an H100 (tests/linear/test_gemm.py at 803535e, one case per
# tile and schedule, gpu_tests_h100.json) every case finished in seconds but two that
# stalled past 200 s, "ws" on the 128-row tiles of 4 warps (128 x 64, 128 x 128) as the
# order xdist ran them in says, so `gemm` refuses those two rather than hang.
GEMM_SCHEDULE = "tiles"
_SCHEDULES = {"tiles": 0, "persistent": 1, "ws": 2}
# The tiles `benchmarks/sweeps/gemm_tile_sweep.py` times beside the planned one.
GEMM_CANDIDATES = {
    "64x64": GEMM_NARROW,
    "64x128": GEMM_MID,
    "128x64": (128, 64, 64, 4, 4, 8),
    "128x64-w8": (128, 64, 64, 4, 8, 8),
    "128x128-w4": (128, 128, 64, 4, 4, 8),
    "128x128": GEMM_WIDE,
    "64x256": (64, 256, 64, 3, 8, 8),
    "128x256": (128, 256, 64, 3, 8, 8),
}


def gemm_tile(m: int, n: int) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, BK, stages, warps, G) of a gemm of M rows and N outputs. Pure."""
    for tile in (GEMM_WIDE, GEMM_MID):
        if triton.cdiv(m, tile[0]) * triton.cdiv(n, tile[1]) >= GEMM_MIN_TILES:
            return tile
    return GEMM_NARROW


_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel at every M
def gemm_kernel(p_x, p_w, p_b, p_out, M, N, K, stride_xm, stride_wn, stride_om,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
                HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
                SCHEDULE: tl.constexpr = 0):
    if SCHEDULE == 0:  # one program a tile
        gemm_one_tile(tl.program_id(0), p_x, p_w, p_b, p_out, M, N, K, stride_xm, stride_wn, stride_om,
                      BM, BN, BK, G, HAS_BIAS, UPCAST, TMA)
    else:  # persistent: a program per SM walks the tiles; 2: loads and MMAs in their own warps
        tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), warp_specialize=SCHEDULE == 2):
            gemm_one_tile(tile, p_x, p_w, p_b, p_out, M, N, K, stride_xm, stride_wn, stride_om,
                          BM, BN, BK, G, HAS_BIAS, UPCAST, TMA)


@triton.jit
def gemm_one_tile(pid, p_x, p_w, p_b, p_out, M, N, K, stride_xm, stride_wn, stride_om,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
                  HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr):
    """Output tile `pid` (G row tiles per feature column, in launch order): its K steps
    in order from zero."""
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = G * tiles_n
    first_m = (pid // per_group) * G
    rows_here = min(tiles_m - first_m, G)
    t_m = first_m + (pid % per_group) % rows_here
    t_n = (pid % per_group) // rows_here
    o_m = t_m * BM + tl.arange(0, BM)
    o_n = t_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m = o_m < M
    m_n = o_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if TMA:  # p_x, p_w: descriptors of blocks [BM, BK], [BN, BK]; past M, N and K they read zero
            b_x = p_x.load([t_m * BM, k0])
            b_w = tl.trans(p_w.load([t_n * BN, k0]))
        else:
            m_k = k0 + o_k < K
            b_x = tl.load(p_x + o_m[:, None] * stride_xm + (k0 + o_k)[None, :],
                          mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(p_w + o_n[None, :] * stride_wn + (k0 + o_k)[:, None],
                          mask=m_n[None, :] & m_k[:, None], other=0.0)
        if UPCAST:  # the interpreter's 16-bit dots are fp16 ones: exact fp32 products instead
            acc = tl.dot(b_x.to(tl.float32), b_w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(b_x, b_w, acc)
    if HAS_BIAS:
        acc += tl.load(p_b + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(p_out + o_m[:, None] * stride_om + o_n[None, :], acc.to(p_out.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


def _sm_count(device: torch.device) -> int:
    """Programs of a persistent schedule: one per SM (cached; 4 for the interpreter)."""
    return cuda_sm_count(device) if device.type == "cuda" else 4


def _tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and row stride."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
         out: torch.Tensor | None = None, tile: tuple | None = None, tma: bool | None = None,
         schedule: str | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N] in w's dtype (bf16 or fp16, x alike,
    unit stride along K), fp32 accumulation in K order in BK = 64 steps: a row's result
    is the same bits at any M and whatever the other rows hold. tile: (BM, BN, BK,
    stages, warps, G) instead of `gemm_tile(M, N)` (tile sweeps; BK must stay 64 for the
    same bits). tma: load x and w by TMA descriptors (None: `GEMM_TMA` where x and w are
    16-byte aligned); the same bits either way. schedule: "tiles" (a program a tile),
    "persistent" (a program an SM walking the tiles) or "ws" (persistent, loads and MMAs
    in their own warps; TMA only); None: GEMM_SCHEDULE. The same bits in every case. No
    host sync; capture-legal once the shape's kernel has compiled."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ShapeError(f"gemm: x [M, K] and w [N, K] with the same K; got {tuple(x.shape)} and {tuple(w.shape)}")
    if w.dtype not in _DTYPES or x.dtype != w.dtype:
        raise DTypeError(f"gemm: x and w must share a 16-bit float dtype (bf16, fp16); got {x.dtype} and {w.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise LayoutError(f"gemm: x and w need a unit stride along K; got strides {x.stride()} and {w.stride()}")
    m, n = x.shape[0], w.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != w.dtype):
        raise ShapeError(f"gemm: bias must be [N={n}] {w.dtype}; got {tuple(bias.shape)} {bias.dtype}")
    if out is None:
        out = torch.empty((m, n), dtype=w.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.stride(1) != 1 or out.dtype != w.dtype:
        raise LayoutError(f"gemm: out must be [M, N] = {(m, n)} {w.dtype} with a contiguous last dim; got "
                          f"{tuple(out.shape)} {out.dtype}")
    if m == 0:
        return out
    bm, bn, bk, stages, warps, group = tile or gemm_tile(m, n)
    aligned = _tma_ok(x) and _tma_ok(w)
    if tma is None:
        tma = GEMM_TMA and aligned
    elif tma and not aligned:
        raise LayoutError(f"gemm: tma=True needs 16-byte aligned x and w rows; got strides {x.stride()}, "
                          f"{w.stride()}")
    k = w.shape[1]
    d_x = TensorDescriptor(x, [m, k], [x.stride(0), 1], [bm, bk]) if tma else x
    d_w = TensorDescriptor(w, [n, k], [w.stride(0), 1], [bn, bk]) if tma else w
    schedule = schedule or GEMM_SCHEDULE
    if schedule not in _SCHEDULES or (schedule == "ws" and not tma):
        raise LayoutError(f"gemm: schedule must be one of {sorted(_SCHEDULES)} ('ws' with TMA loads); got "
                          f"{schedule!r} with tma={tma}")
    if schedule == "ws" and bm > 64 and warps == 4:  # stalled on an H100 (GEMM_SCHEDULE)
        raise LayoutError(f"gemm: schedule 'ws' on a {bm}-row tile of {warps} warps stalled on an H100 (Triton 3.6); "
                          "use 'persistent', a 64-row tile or 8 warps")
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (tiles if schedule == "tiles" else min(tiles, _sm_count(x.device)),)
    gemm_kernel[grid](d_x, d_w, bias if bias is not None else w, out, m, n, k, x.stride(0), w.stride(0),
                      out.stride(0), BM=bm, BN=bn, BK=bk, G=group, HAS_BIAS=bias is not None,
                      UPCAST=triton_interpret(), TMA=tma, SCHEDULE=_SCHEDULES[schedule], num_warps=warps,
                      num_stages=stages)
    return out
