"""Weighted top-k sum: out[t, h] = sum_k w[t, k] * sum_s part[s, t*K + k, h].

Legend: T tokens, K top-k, H hidden, S FC2 splits.
Grid (T, cdiv(H, BH)). The K * S loads of a token are unrolled and independent
(no branch per route: a route's validity is a mask), then the sums run
elementwise in a fixed order, splits then routes k = 0..K-1: bitwise repeatable,
no atomics, and the same bits at any BH. BH follows T (REDUCE_BLOCKS_H), and a
tl.sum over a [K, BH] tile is a tree whose shape follows the tile's layout, so
the earlier sum over k rounded a token's output differently at other T (batch
invariance, plan.py). Routes whose expert id is outside
[0, E) add nothing (their rows are masked, so stale or poisoned partials never
reach the output). With WEIGHT_AFTER false the router weight was already
applied before FC2.

The form with a branch and a dependent load chain per route (BH 256) took
3.87 us at T = 1 on the Qwen3 shape (S 2) where one [KP, BH] load per split
took 2.41 at BH 128, and 2.63 vs 1.79 at T = 1, H 7168
(benchmarks/results/sweeps/moe_reduce_h200.json); the unrolled loads here issue
together like that one's. Not yet timed on the H200 (`bench_moe.py` covers it).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sparkinfer.norm.kernel import norm_row


@triton.jit
def moe_reduce_kernel(p_part, p_ids, p_topk_w, p_out, H, stride_ps, stride_pr,
                      stride_o, E: tl.constexpr, K: tl.constexpr, S: tl.constexpr,
                      BH: tl.constexpr, WEIGHT_AFTER: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched early (programmatic dependent launch): FC2's partials after this
        gdc_wait()
    reduce_row(p_part, p_ids, p_topk_w, p_out, tl.program_id(0),
               tl.program_id(1) * BH + tl.arange(0, BH), H, stride_ps, stride_pr, stride_o,
               E, K, S, WEIGHT_AFTER)


@triton.jit
def reduce_row(p_part, p_ids, p_topk_w, p_out, t, o_h, H, stride_ps, stride_pr,
               stride_o, E: tl.constexpr, K: tl.constexpr, S: tl.constexpr,
               WEIGHT_AFTER: tl.constexpr):
    """out[t, o_h] of token t (one program of moe_reduce_kernel)."""
    m_h = o_h < H
    b_out = route_sum(p_part, p_ids, p_topk_w, t, o_h, m_h, stride_ps, stride_pr, E, K, S, WEIGHT_AFTER)
    tl.store(p_out + tl.cast(t, tl.int64) * stride_o + o_h, b_out.to(p_out.dtype.element_ty),
             mask=m_h)


@triton.jit
def route_sum(p_part, p_ids, p_topk_w, t, o_h, m_h, stride_ps, stride_pr, E: tl.constexpr,
              K: tl.constexpr, S: tl.constexpr, WEIGHT_AFTER: tl.constexpr):
    """fp32 sum over token t's routes of its FC2 rows at o_h (module docstring's order)."""
    b_out = tl.zeros(o_h.shape, dtype=tl.float32)
    for k in tl.static_range(K):
        r = t * K + k
        e = tl.load(p_ids + r)
        ok = (e >= 0) & (e < E)
        p_row = p_part + tl.cast(r, tl.int64) * stride_pr + o_h
        b_r = tl.zeros(o_h.shape, dtype=tl.float32)
        for s in tl.static_range(S):
            b_r += tl.load(p_row + s * stride_ps, mask=m_h & ok, other=0.0).to(tl.float32)
        if WEIGHT_AFTER:
            b_r *= tl.where(ok, tl.load(p_topk_w + r), 0.0)
        b_out += b_r
    return b_out


@triton.jit
def moe_reduce_norm_kernel(p_part, p_ids, p_topk_w, p_extra, p_res, p_w, p_out, p_res_out, H,
                           stride_ps, stride_pr, stride_extra, stride_res, stride_out,
                           stride_res_out, eps, E: tl.constexpr, K: tl.constexpr,
                           S: tl.constexpr, WEIGHT_AFTER: tl.constexpr, HAS_EXTRA: tl.constexpr,
                           BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
                           WAIT: tl.constexpr = False):
    """The top-k sum of token t folded into the residual add + RMSNorm after it
    (`RouteSum.add_rms_norm`): the sum rounded to the residual's dtype as
    moe_reduce_kernel stores it, plus `extra` (a shared expert's output) rounded as a
    torch add rounds, then `norm_row`: the unfused pair's bits, one launch fewer.
    PDL: lets the next kernel launch at entry (as add_rms_norm_kernel); WAIT:
    launched early behind FC2 (micro), so FC2's rows are read after gdc_wait."""
    if PDL:
        gdc_launch_dependents()
    if WAIT:
        gdc_wait()
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    dtype = p_res.dtype.element_ty  # the sum's dtype (RouteSum checks the residual has it)
    b_x = route_sum(p_part, p_ids, p_topk_w, i_t, o_h, m_h, stride_ps, stride_pr, E, K, S,
                    WEIGHT_AFTER).to(dtype).to(tl.float32)
    if HAS_EXTRA:
        b_e = tl.load(p_extra + i_t * stride_extra + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_x = (b_x + b_e).to(dtype).to(tl.float32)
    norm_row(b_x, p_res, p_w, p_out, p_res_out, i_t, o_h, m_h, H, stride_res, stride_out,
             stride_res_out, eps, True)
