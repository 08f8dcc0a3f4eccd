"""Top-k routing kernel: softmax top-k, or sigmoid grouped top-k with a
correction bias (DeepSeek-V3). One program per token.

Legend: T tokens, E experts (EP: next power of 2), K top-k (KP: next power of 2),
G expert groups of EG experts, TG groups kept.

Selection takes the largest score, ties to the lowest expert id, K times in
order; outputs are in selection order (descending score).

Non-finite logits: ids are always K distinct experts in [0, E). A token with a
NaN logit gets NaN in every weight (both routings), so its output row is NaN
like the fp32 reference's; softmax over a +inf or all -inf row is NaN by IEEE
(inf - inf) and routes the same way. NaN scores select as -inf, so selection
never depends on how max treats NaN (the GPU's max drops it, numpy keeps it).

PDL (launch.py): launched with programmatic dependent launch behind the router's
`linear`, which lets its successor launch at entry; the kernel waits for it before
reading the logits.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _top1(x, o):
    """(max value, its lowest index) of a 1-D block."""
    v = tl.max(x, axis=0)
    i = tl.min(tl.where(x == v, o, x.shape[0]), axis=0)
    return v, i


@triton.jit
def routing_kernel(p_logits, p_bias, p_ids, p_w, stride_l, scale,
                   E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                   SIGMOID: tl.constexpr, G: tl.constexpr, EG: tl.constexpr, TG: tl.constexpr,
                   RENORM: tl.constexpr, PDL: tl.constexpr = False):
    i_t = tl.program_id(0)
    o_e = tl.arange(0, EP)
    m_e = o_e < E
    if PDL:  # launched early behind the router projection: its logits once it has ended
        gdc_launch_dependents()  # FC1 (launched with PDL) may launch now and wait for this grid
        gdc_wait()
    b_l = tl.load(p_logits + i_t.to(tl.int64) * stride_l + o_e, mask=m_e,
                  other=-float("inf")).to(tl.float32)
    has_nan = tl.sum((b_l != b_l).to(tl.int32), axis=0) > 0
    if SIGMOID:
        b_p = tl.sigmoid(b_l)
        b_sel = b_p + tl.load(p_bias + o_e, mask=m_e, other=0.0)
        b_sel = tl.where(m_e, b_sel, -float("inf"))
        if G > 1:
            o_g = tl.arange(0, G)
            b_gs = tl.zeros([G], dtype=tl.float32)
            for g in tl.static_range(G):
                in_g = (o_e // EG) == g
                v1, i1 = _top1(tl.where(in_g, b_sel, -float("inf")), o_e)
                if EG > 1:
                    v2, i2 = _top1(tl.where(in_g & (o_e != i1), b_sel, -float("inf")), o_e)
                    v1 += v2
                b_gs = tl.where(o_g == g, v1, b_gs)
            keep = o_e < 0
            for _ in tl.static_range(TG):
                v, gi = _top1(b_gs, o_g)
                keep = keep | ((o_e // EG) == gi)
                b_gs = tl.where(o_g == gi, -float("inf"), b_gs)
            b_sel = tl.where(keep, b_sel, -float("inf"))
    else:
        b_max = tl.max(b_l, axis=0)
        b_x = tl.where(m_e, tl.exp(b_l - b_max), 0.0)
        b_p = b_x / tl.sum(b_x, axis=0)
        b_sel = tl.where(m_e, b_p, -float("inf"))
    b_sel = tl.where(b_sel != b_sel, -float("inf"), b_sel)
    m_free = m_e  # experts not yet taken: -inf scores still select, never twice, never past E
    o_k = tl.arange(0, KP)
    b_ids = tl.zeros([KP], dtype=tl.int32)
    b_w = tl.zeros([KP], dtype=tl.float32)
    for k in tl.static_range(K):
        v = tl.max(tl.where(m_free, b_sel, -float("inf")), axis=0)
        i = tl.min(tl.where(m_free & (b_sel == v), o_e, EP), axis=0)
        b_ids = tl.where(o_k == k, i, b_ids)
        b_w = tl.where(o_k == k, tl.sum(tl.where(o_e == i, b_p, 0.0), axis=0), b_w)
        m_free = m_free & (o_e != i)
    if RENORM:
        b_w = b_w / tl.sum(b_w, axis=0)
    b_w = tl.where(has_nan, float("nan"), b_w * scale)
    m_k = o_k < K
    tl.store(p_ids + i_t * K + o_k, b_ids, mask=m_k)
    tl.store(p_w + i_t * K + o_k, b_w, mask=m_k)
