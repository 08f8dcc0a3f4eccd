"""Weighted top-k sum: out[t, h] = sum_k w[t, k] * sum_s part[s, t*K + k, h].

Legend: T tokens, K top-k, H hidden, S FC2 splits. Grid (T, cdiv(H, BH)).
Fixed summation order (splits, then k = 0..K-1), no atomics: bitwise
repeatable. Routes whose expert id is outside [0, E) add nothing. With
WEIGHT_AFTER false the router weight was already applied before FC2.
"""

import triton
import triton.language as tl


@triton.jit
def moe_reduce_kernel(part_ptr, ids_ptr, topk_w_ptr, out_ptr, H, S, stride_ps, stride_pr,
                      stride_o, E: tl.constexpr, K: tl.constexpr, BH: tl.constexpr,
                      WEIGHT_AFTER: tl.constexpr):
    t = tl.program_id(0)
    o_h = tl.program_id(1) * BH + tl.arange(0, BH)
    m_h = o_h < H
    b_out = tl.zeros([BH], dtype=tl.float32)
    for k in tl.static_range(K):
        r = t * K + k
        e = tl.load(ids_ptr + r)
        if (e >= 0) & (e < E):
            b_r = tl.zeros([BH], dtype=tl.float32)
            for s in range(S):
                b_r += tl.load(part_ptr + s * stride_ps + r.to(tl.int64) * stride_pr + o_h,
                               mask=m_h, other=0.0).to(tl.float32)
            if WEIGHT_AFTER:
                b_r *= tl.load(topk_w_ptr + r)
            b_out += b_r
    tl.store(out_ptr + t.to(tl.int64) * stride_o + o_h, b_out.to(out_ptr.dtype.element_ty),
             mask=m_h)
