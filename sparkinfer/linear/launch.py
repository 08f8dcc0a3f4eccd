"""Host side of `linear`: check, pick the tile (`config.py`), allocate, launch; prefill to torch."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
import triton

from sparkinfer.envs import triton_interpret
from sparkinfer.errors import AliasingError, DTypeError, LayoutError, ShapeError
from sparkinfer.linear import config
from sparkinfer.linear.config import BLOCK_M, BLOCK_N, MAX_ROWS, LinearTile, linear_tile, stream_stages
from sparkinfer.linear.kernel import linear_preload_kernel, linear_stream_kernel
from sparkinfer.runtime.devices import cuda_sm_count

__all__ = ["linear", "linear_sync", "LINEAR_MAX_ROWS", "LINEAR_PDL", "PRELOAD_EARLY"]

# Features per program under the interpreter (see `linear`): 5-12 programs a tiny preset's
# projection become 1-2.
INTERPRET_BLOCK_N = 512

LINEAR_MAX_ROWS = MAX_ROWS
# Programmatic dependent launch on CUDA devices: the weight slice loads while the
# predecessor finishes (MEASURED.md, H200: a 2048 x 2048 GEMV chain 4.18 -> 2.76 us
# with PDL). Off, the kernel waits for its predecessor like any launch.
LINEAR_PDL = True
# The preload schedule's weight loads before its wait for the predecessor (kernel.py, EARLY).
# False loads after the wait, like the stream schedule: coarse calls, which wait first, made
# Qwen3-30B-A3B's qkv faster in the decode step though slower alone (linear/config.py,
# COARSE_SMALL_SLICES). They pay: H100 at 9d3dfae (sweeps/decode_linear_ab_h100.json), Qwen3-30B-A3B
# step with late loads 803.9 against 780.5 us (bf16, batch 1), NVFP4 experts 765.3 against 742.7.
PRELOAD_EARLY = True
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def linear_sync(w: torch.Tensor) -> torch.Tensor:
    """The split-K semaphores of one call site of `linear` with weight `w` [N, K]:
    int32 zeros [ceil(N / 64)], which the kernel counts up and resets. Give each
    call site its own (two calls that may run at once must not share one);
    allocate it before capturing a graph that uses it."""
    return torch.zeros(triton.cdiv(w.shape[0], BLOCK_N), dtype=torch.int32, device=w.device)


def _precision(dtype: torch.dtype, interpret: bool) -> str:
    """The dot's precision: fp32 weights take tf32x3 on the GPU (three tf32 MMAs per
    product, about fp32's accuracy; fixed per element like every dot here), the
    interpreter exact fp32 (its bf16 dots are fp16 ones), 16-bit weights their MMA."""
    if interpret:
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "mma"


def _pdl(pdl: bool | None, x: torch.Tensor, interpret: bool) -> bool:
    """Programmatic dependent launch for this call: `pdl` or LINEAR_PDL, on CUDA only."""
    return (LINEAR_PDL if pdl is None else pdl) and x.device.type != "cpu" and not interpret


def _num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 1 for the interpreter (it runs programs one after another)."""
    return cuda_sm_count(device) if device.type == "cuda" else 1


def _check(x, w, bias, out, sync, gated):
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] * (2 if gated else 1):
        want = "x [M, 2K] ([gate | up]) and w [N, K]" if gated else "x [M, K] and w [N, K] with the same K"
        raise ShapeError(f"linear: {want}; got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in _DTYPES or w.dtype not in _DTYPES or (x.dtype != w.dtype and w.dtype != torch.float32):
        raise DTypeError(f"linear: x and w must share a float dtype (bf16, fp16, fp32), or w be fp32 and x 16-bit; "
                         f"got {x.dtype} and {w.dtype}")
    m, n = x.shape[0], w.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != w.dtype):
        raise ShapeError(f"linear: bias must be [N={n}] {w.dtype}; got {tuple(bias.shape)} {bias.dtype}")
    if out is not None:
        if tuple(out.shape) != (m, n) or out.stride(1) != 1 or out.dtype != w.dtype:
            raise LayoutError(f"linear: out must be [M, N] = {(m, n)} {w.dtype} with a contiguous last dim; got "
                              f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
        o0, x0 = out.data_ptr(), x.data_ptr()
        o1 = o0 + ((m - 1) * out.stride(0) + n) * out.element_size()
        x1 = x0 + ((m - 1) * x.stride(0) + (x.shape[1] - 1) * x.stride(1) + 1) * x.element_size()
        if out.numel() and x.numel() and o0 < x1 and x0 < o1:
            raise AliasingError(f"linear: out [{o0:#x}, {o1:#x}) overlaps x's storage [{x0:#x}, {x1:#x}); pass a "
                                "separate buffer (programs write rows other programs still read)")
    blocks = triton.cdiv(n, BLOCK_N)
    if sync is not None and (sync.dtype != torch.int32 or sync.numel() < blocks or sync.device != x.device):
        raise LayoutError(f"linear: sync must be linear_sync(w): {blocks} int32 on {x.device}; got "
                          f"{sync.numel()} {sync.dtype} on {sync.device}")


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None, sync: torch.Tensor | None = None, tile: LinearTile | None = None,
           pdl: bool | None = None, gated: bool = False, invariant: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N] in w's dtype (bf16, fp16 or fp32,
    x alike; or fp32 weights and a 16-bit x, which the kernel upcasts exactly as it
    loads it: GLM-4.5's fp32 router without a conversion kernel before it).
    gated: x is [M, 2K] = [gate | up] and the product is (silu(gate) * up) @ w.T,
    the activation rounded like torch's `F.silu(g) * u` in x's dtype and computed
    as x is loaded (a SiLU-gated MLP's down projection without two kernels before it).

    M <= LINEAR_MAX_ROWS (128) with a contiguous K in w runs the Triton kernel:
    fp32 accumulation (fp32 weights: tf32x3 products, see `_precision`) in one order per output
    element that depends on the weight and the device only, so a row's result is
    the same bits at any M and whatever the other rows hold. Larger M (prefill)
    runs torch's matmul, whose sums follow M; with `invariant`, the kernel on
    pieces of 128 rows in turn instead, so a row keeps those bits at any M (a
    batch of prefill chunks; the weights are read once per piece). sync
    (`linear_sync(w)`, owned by this call site) lets the kernel split K
    over more programs; without it, one program per 64 features.
    tile: a launch other than `linear_tile`'s (benchmarks, tests); keep it fixed
    per weight, or rows lose their batch invariance. pdl: programmatic dependent
    launch (default LINEAR_PDL on CUDA; never under the interpreter).

    A split tile's call of more than COARSE_MIN_ROWS rows (16-bit weights, not gated) runs
    one program per group of K slices, with the same sums (`linear/config.py`).
    Allocates `out` unless given, and a split's fp32 partials [S or groups, N, 16 ceil(M/16)];
    no host sync; capture-legal once the shape ran eagerly (Triton compiles on a
    shape's first call). `out` must not overlap x (AliasingError).
    """
    _check(x, w, bias, out, sync, gated)
    m, k = x.shape[0], w.shape[1]
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=w.dtype, device=x.device)
    if m > MAX_ROWS and invariant and w.stride(1) == 1:
        for i in range(0, m, MAX_ROWS):  # in stream order: each piece resets `sync` for the next
            linear(x[i:i + MAX_ROWS], w, bias, out=out[i:i + MAX_ROWS], sync=sync, tile=tile, pdl=pdl, gated=gated)
        return out
    if m > MAX_ROWS or w.stride(1) != 1:
        if gated:
            g, u = x.chunk(2, dim=-1)
            x = F.silu(g) * u
        x = x.to(w.dtype)
        return torch.addmm(bias, x, w.t(), out=out) if bias is not None else torch.mm(x, w.t(), out=out)
    if m == 0:
        return out
    elem = w.element_size()
    if tile is None:
        tile = linear_tile(n, k, elem, _num_sms(x.device) if sync is not None else 1)
        if x.device.type == "cpu" and tile.stream and tile.split == 1:
            # the interpreter runs programs one after another at ~5 ms each whatever their
            # width (tiny presets: 99 launches, a quarter of a decode step's 21 s): one
            # program per INTERPRET_BLOCK_N features. Each output's sum is the same K loop
            # at any width, and the width follows N alone, so rows stay batch-invariant.
            tile = replace(tile, block_n=min(INTERPRET_BLOCK_N, max(BLOCK_N, triton.next_power_of_2(n))))
    if tile.split > 1 and sync is None:
        raise LayoutError(f"linear: a tile split {tile.split} ways needs the call site's semaphores; pass "
                          "sync=linear_sync(w)")
    # fp32 weights stay fine: tf32x3 runs its three passes over a whole dot, so its steps
    # would have to be whole slices, which spilled (244 bytes at 4 row blocks, sm_90).
    # Gated calls stay fine unless COARSE_GATED (config.py says why).
    above = 0 if tile.coarse_always else config.COARSE_MIN_ROWS
    if not tile.stream and tile.split > 1 and m > above and w.element_size() <= 2 and (
            config.COARSE_GATED or not gated):
        # the interpreter's dots are numpy matmuls, whose sum order follows the operand
        # shapes: there each launch takes one 16-row block, the preload schedule's operand
        piece = BLOCK_M if triton_interpret() else config.COARSE_MAX_ROWS
        for i in range(0, m, piece):  # in stream order, as the pieces above
            rows = slice(i, i + piece)
            _coarse(x[rows], w, bias, out[rows], sync, tile, pdl, gated)
        return out
    blocks = triton.cdiv(n, tile.block_n)
    # The stream schedule multiplies every weight step with each row block in turn, so it
    # takes exactly the blocks M needs: a mixed step's LM head has D + R rows (65-68 beside
    # 64 decode rows), which a power of two made 8 blocks of MMAs for 5 (H200, Qwen3-30B-A3B's
    # [151936, 2048] head: 287 us at 65 rows against 165 at 64, sweeps/prefill_mixed_h200_7c6540f.json;
    # with exact blocks a mixed step's stream kernels took 15 us more than its decode step's at add2f20).
    # The preload schedule groups blocks by X_GROUP and keeps powers of two (its M are buckets).
    row_blocks = triton.cdiv(m, BLOCK_M) if tile.stream else triton.next_power_of_2(triton.cdiv(m, BLOCK_M))
    rows = triton.cdiv(m, BLOCK_M) * BLOCK_M
    part = out
    if tile.split > 1:
        part = torch.empty((tile.split, blocks * tile.block_n, rows), dtype=torch.float32, device=x.device)
    interpret = triton_interpret()
    pdl = _pdl(pdl, x, interpret)
    kernel = linear_stream_kernel if tile.stream else linear_preload_kernel
    kernel[(blocks, tile.split)](
        x, w, bias if bias is not None else w, out, part, sync if sync is not None else out,
        m, n, k, tile.k_slice, x.stride(0), x.stride(1), w.stride(0), out.stride(0),
        part.stride(0) if tile.split > 1 else 0, rows,
        BN=tile.block_n, BK=tile.block_k, KS=tile.k_slice if not tile.stream else tile.block_k, RB=row_blocks,
        SPLIT=tile.split, GROUP=tile.group, SLICE=0, HAS_BIAS=bias is not None, GATED=gated,
        PRECISION=_precision(w.dtype, interpret), PDL=pdl, num_warps=tile.num_warps,
        num_stages=tile.num_stages(row_blocks, elem), **(dict(launch_pdl=True) if pdl else {}),
        **({} if tile.stream else dict(EARLY=PRELOAD_EARLY)))
    return out


def _coarse(x, w, bias, out, sync, tile: LinearTile, pdl, gated) -> None:
    """A preload tile's call of many rows (config.py): one stream program per group of
    slices, each slice's chain folded into the group's sum as it ends, so every element
    gets the preload schedule's sums in its order; the groups' partials, where there are
    several, are added by the last program of each feature block."""
    m, k = x.shape[0], w.shape[1]
    n, elem = w.shape[0], w.element_size()
    bn = max(tile.block_n, config.COARSE_BLOCK_N) if n > tile.block_n else tile.block_n
    blocks, groups = triton.cdiv(n, bn), tile.groups
    interpret = triton_interpret()
    # a step divides KS (both powers of two); on the GPU each step is a chain of k16 MMAs in K
    # order, as the preload schedule's one dot of KS is; in the interpreter one step a slice
    bk = tile.k_slice if interpret else max(16, min(config.COARSE_BLOCK_K, tile.k_slice))
    row_blocks = triton.next_power_of_2(triton.cdiv(m, BLOCK_M))  # one [k, rows] operand: a power of two
    rows = row_blocks * BLOCK_M
    part = out
    if groups > 1:
        part = torch.empty((groups, blocks * bn, rows), dtype=torch.float32, device=x.device)
    pdl = _pdl(pdl, x, interpret)
    linear_stream_kernel[(blocks, groups)](
        x, w, bias if bias is not None else w, out, part, sync,
        m, n, k, tile.group * tile.k_slice, x.stride(0), x.stride(1), w.stride(0), out.stride(0),
        part.stride(0) if groups > 1 else 0, rows,
        BN=bn, BK=bk, KS=bk, RB=row_blocks, SPLIT=groups, GROUP=1, SLICE=tile.k_slice,
        HAS_BIAS=bias is not None, GATED=gated, PRECISION=_precision(w.dtype, interpret), PDL=pdl,
        num_warps=tile.num_warps * bn // tile.block_n, num_stages=stream_stages(bn, bk, row_blocks, elem),
        **(dict(launch_pdl=True) if pdl else {}))
