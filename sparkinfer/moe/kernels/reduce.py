"""Weighted top-k sum: out[t, h] = sum_k w[t, k] * sum_s part[s, t*K + k, h].

Legend: T tokens, K top-k (KP: next power of two), H hidden, S FC2 splits.
Grid (T, cdiv(H, BH)). One [KP, BH] load per split (all K routes of the
token at once, no branch per route: the ids and their validity are one
vector), then a fixed-order tree sum over k: bitwise repeatable, no atomics.
Routes whose expert id is outside [0, E) add nothing (their rows are masked,
so stale or poisoned partials never reach the output). With WEIGHT_AFTER
false the router weight was already applied before FC2.

The earlier form (a branch and a dependent load chain per route, BH 256) took
3.87 us at T = 1 on the Qwen3 shape (S 2) where this one takes 2.41 at BH
128, and 2.63 vs 1.79 at T = 1, H 7168 (benchmarks/results/sweeps/moe_reduce_h200.json;
the runner picks BH per grid, REDUCE_BLOCKS_H).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def moe_reduce_kernel(p_part, p_ids, p_topk_w, p_out, H, S, stride_ps, stride_pr,
                      stride_o, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                      BH: tl.constexpr, WEIGHT_AFTER: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched early (programmatic dependent launch): FC2's partials after this
        gdc_wait()
    reduce_row(p_part, p_ids, p_topk_w, p_out, tl.program_id(0),
               tl.program_id(1) * BH + tl.arange(0, BH), H, S, stride_ps, stride_pr, stride_o,
               E, K, KP, WEIGHT_AFTER)


@triton.jit
def reduce_row(p_part, p_ids, p_topk_w, p_out, t, o_h, H, S, stride_ps, stride_pr,
               stride_o, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
               WEIGHT_AFTER: tl.constexpr):
    """out[t, o_h] of token t (one program of moe_reduce_kernel)."""
    m_h = o_h < H
    o_k = tl.arange(0, KP)
    r = t * K + o_k
    e = tl.load(p_ids + r, mask=o_k < K, other=-1)
    ok = (o_k < K) & (e >= 0) & (e < E)
    p_rows = p_part + r[:, None].to(tl.int64) * stride_pr + o_h[None, :]
    m_rh = ok[:, None] & m_h[None, :]
    b_r = tl.zeros([KP, o_h.shape[0]], dtype=tl.float32)
    for s in range(S):
        b_r += tl.load(p_rows + s * stride_ps, mask=m_rh, other=0.0).to(tl.float32)
    if WEIGHT_AFTER:
        b_r *= tl.load(p_topk_w + r, mask=ok, other=0.0)[:, None]
    b_out = tl.sum(b_r, axis=0)
    tl.store(p_out + tl.cast(t, tl.int64) * stride_o + o_h, b_out.to(p_out.dtype.element_ty),
             mask=m_h)
