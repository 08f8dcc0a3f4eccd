"""The qkv projection with rotary, the q/k head norms and the cache write in one launch,
for decode rows.

Legend: T tokens (the projection's M), Hq / KVH query / key-value heads, D head dim,
NB feature blocks of the projection's grid.

`qkv_rope(x, w, ...)` computes qkv = x @ w.T (+ bias) with `sparkinfer.linear`'s program
(its tile, so its sums and bits), and the last of the NB programs that store final rows
(`linear.kernel.grid_last`) runs `rope_rows`, the rope kernel's own body, over the T x (Hq +
KVH) (token, head) rows: q rotated into q_out, k rotated and v copied into the cache. One
launch instead of two (issue 28: "rotary + q/k norm + cache write with the qkv
projection"). The last program takes the rows BLOCK_ROWS at a time, so the fusion serves
up to FUSED_MAX_ROWS tokens (a batch-1 step's 36 rows of Qwen3-30B-A3B in three blocks);
above that the projection and the rope kernel run as two launches. Both run `rope_rows`
on the same qkv, and the head norm's sum is exact (`norm.kernel.sum_squares`), so both
give the same bits whatever rows a block holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkinfer.linear.config import LinearTile
from sparkinfer.linear.kernel import _linear_program, grid_last, grid_reset
from sparkinfer.linear.launch import _check, coarse_call, default_tile, fine_call, fine_launch, linear
from sparkinfer.rope.kernel import rope_rows
from sparkinfer.rope.launch import RotaryTable, rope_call, rope_qk_cache

__all__ = ["qkv_rope", "FUSED_MAX_ROWS", "ROPE_FUSED"]

# Tokens the fused epilogue serves (one program, BLOCK_ROWS (token, head) rows at a time).
FUSED_MAX_ROWS = 4
# The fused launch in decode steps (models/decoder.py); off: projection + rope kernel.
ROPE_FUSED = True
# Elements of (token, head) rows an epilogue block holds: 16 rows at D 128. ptxas (sm_90) at
# Qwen3-30B-A3B's qkv [5120, 2048], T 1: 96 registers a thread, where the plain projection
# takes 56 and five programs an SM fit its shared memory (40 KB each) either way; at 4,096
# elements (the rope kernel's cap) 139 registers left three an SM, and its 640 programs
# would take two waves where they take one.
_BLOCK_ELEMS = 2048


@triton.jit(do_not_specialize=["M"])
def qkv_rope_kernel(p_x, p_w, p_b, p_out, p_part, p_sync, M, N, K, k_slice, stride_xm, stride_xk, stride_wn,
                    stride_om, stride_ps, stride_pn,
                    p_pos, p_slot, p_cos, p_sin, p_qw, p_kw, p_q, p_k, p_v,
                    stride_cs, stride_qt, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
                    HQ, KVH, D, R, L, KV_STRIDE, KV_OFFSET, eps,
                    BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, RB: tl.constexpr,
                    SPLIT: tl.constexpr, GROUP: tl.constexpr, SLICE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    GATED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, STREAM: tl.constexpr,
                    HAS_NORM: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    done = _linear_program(p_x, p_w, p_b, p_out, p_part, p_sync, M, N, K, k_slice, stride_xm, stride_xk,
                           stride_wn, stride_om, stride_ps, stride_pn, BN, BK, KS, RB, STREAM, SPLIT, GROUP,
                           SLICE, HAS_BIAS, GATED, PRECISION, PDL)
    p_ticket = p_sync + tl.num_programs(0)  # the slot past the feature blocks' (`qkv_sync`)
    if grid_last(done, p_ticket):  # every block's qkv rows are visible to it
        for r0 in range(0, M * (HQ + KVH), BLOCK_ROWS):
            rope_rows(r0 + tl.arange(0, BLOCK_ROWS), p_out, p_pos, p_slot, p_cos, p_sin, p_qw, p_kw, p_q, p_k, p_v,
                      stride_om, stride_cs, stride_qt, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs,
                      stride_vl, stride_vh, M, HQ, KVH, D, R, L, KV_STRIDE, KV_OFFSET, eps, HAS_NORM, HAS_PASS,
                      BLOCK_ROWS, BLOCK_H, BLOCK_P, BLOCK_D, False, ".cg")
        grid_reset(p_ticket)


def qkv_rope(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
             slots: torch.Tensor, table: RotaryTable, caches: tuple, heads: tuple, *, sync: torch.Tensor,
             norms: tuple | None = None, eps: float = 1e-6, kv_stride: int = 1, kv_offset: int = 0,
             q_out: torch.Tensor | None = None, fused: bool | None = None,
             tile: LinearTile | None = None) -> torch.Tensor:
    """`rope_qk_cache(linear(x, w, bias), ...)` (see both; the same bits): x [T, H] @ w
    [(Hq + 2 KVH) D, H].T, q rotated (returned: q_out [T, Hq, D]), k rotated and v written
    into the caches. sync: the call site's semaphores with one slot past `linear_sync(w)`'s
    (`moe.routing.fused.router_sync(w)` makes such). fused: one launch (default ROPE_FUSED)
    where T <= FUSED_MAX_ROWS and the projection is one fine launch of `linear`; else two.
    tile: `linear`'s (tests; keep it fixed per weight). Allocates qkv (and q_out unless
    given); no host sync; capture-legal once the shape ran eagerly."""
    t = x.shape[0]
    _check(x, w, bias, None, sync, False)
    qkv = torch.empty((t, w.shape[0]), dtype=w.dtype, device=x.device)
    q_out, rargs, rconst = rope_call(qkv, positions, slots, table, caches, heads, norms=norms, eps=eps,
                                     kv_stride=kv_stride, kv_offset=kv_offset, q_out=q_out)
    tile = tile or default_tile(w, x.device, True)
    blocks = triton.cdiv(w.shape[0], tile.block_n)
    use = (ROPE_FUSED if fused is None else fused) and t <= FUSED_MAX_ROWS and fine_call(t, w, x.device)
    if not use or coarse_call(t, tile, w, False) or sync.numel() < blocks + 1:
        linear(x, w, bias, out=qkv, sync=sync, tile=tile, invariant=True)
        return rope_qk_cache(qkv, positions, slots, table, caches, heads, norms=norms, eps=eps,
                             kv_stride=kv_stride, kv_offset=kv_offset, q_out=q_out)
    hq, kvh, _ = heads
    rows = triton.next_power_of_2(t * (hq + kvh))
    grid, args, kw = fine_launch(x, w, bias, qkv, sync, tile, None, False)
    qkv_rope_kernel[grid](*args, *rargs[1:10], *rargs[11:20], *rargs[21:], STREAM=tile.stream,
                          BLOCK_ROWS=max(1, min(rows, _BLOCK_ELEMS // rconst["BLOCK_D"])), **rconst, **kw)
    return q_out
