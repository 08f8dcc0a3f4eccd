"""FC1 (+ activation) of the routed experts: one kernel, two families.

Legend: T tokens, K top-k, E experts, H hidden (FC1 reduction), I intermediate,
S split count along H, R = T*K routes, P padded sorted rows.

MICRO (tiny T, no sort): grid (R, cdiv(I, BN), S). Program (r, n, s) owns the
expert of route slot r when r is its first slot (`micro_rows`) and computes
the gate/up pre-activations of all T tokens routed to it over its share of H.
With S > 1 (PARTIALS) it stores fp32 partials out[s, route, n] (gate) and
out[s, route, I + n] (up), and FC2 sums the S partials in a fixed order and
applies the activation; with S == 1 it stores the bf16 activation out[route, n].

GROUPED: grid (max_tiles, cdiv(I, BN), 1). Program (m, n) serves the tile of
BM sorted rows whose expert is tile_expert[m] (-1: idle), applies the
activation (and the router weight when it comes before FC2) and stores bf16
out[pos, n].
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from sparkinfer.moe.kernels.common import (
    DECODE_UNSCALE,
    activation,
    grouped_ids,
    k_order,
    load_scales,
    load_scales_2,
    program_rows,
    split_chunks,
    step_weight_tile,
)
from sparkinfer.moe.kernels.fp8 import act_operand, scaled_dot, step_scales, store_act


@triton.jit
def moe_fc1_kernel(
    p_x, p_xs, p_w, p_s, p_gs, p_ids, p_topk_w, p_sorted, p_tile_e, p_out, p_os, d_w,
    T, I, num_chunks, chunks_per_split, e_lo, e_hi,
    stride_x, stride_we, stride_wn, stride_se, stride_os, stride_or,
    alpha, limit,
    E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    MICRO: tl.constexpr, PARTIALS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    NVFP4: tl.constexpr, FP8: tl.constexpr, X_FP8: tl.constexpr, GSCALE: tl.constexpr,
    WEIGHT_BEFORE: tl.constexpr, PTX_DECODE: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr = False, GROUP: tl.constexpr = 0,
    TMA: tl.constexpr = False,
):
    i_m, i_n = grouped_ids(I, BN, GROUP)
    e, route, o_row = program_rows(p_ids, p_sorted, p_tile_e, i_m, T, E, K, BM, KP, RP, MICRO)
    if (e >= e_lo) & (e < e_hi):
        fc1_tile(p_x, p_xs, p_w, p_s, p_gs, p_topk_w, p_out, p_os, d_w, e, e - e_lo, route,
                 o_row, i_n, tl.program_id(2), I, num_chunks, chunks_per_split,
                 stride_x, stride_we, stride_wn, stride_se, stride_os, stride_or, alpha, limit,
                 K, BM, BN, BK, PARTIALS, GATED, ACT, NVFP4, FP8, X_FP8, GSCALE, WEIGHT_BEFORE,
                 PTX_DECODE, INTERPRET, PDL, TMA)


@triton.jit
def fc1_tile(p_x, p_xs, p_w, p_s, p_gs, p_topk_w, p_out, p_os, d_w, e, e_w, route, o_row, i_n,
             i_s,
             I, num_chunks, chunks_per_split, stride_x, stride_we, stride_wn, stride_se,
             stride_os, stride_or, alpha, limit, K: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, PARTIALS: tl.constexpr, GATED: tl.constexpr,
             ACT: tl.constexpr, NVFP4: tl.constexpr, FP8: tl.constexpr, X_FP8: tl.constexpr,
             GSCALE: tl.constexpr, WEIGHT_BEFORE: tl.constexpr, PTX_DECODE: tl.constexpr,
             INTERPRET: tl.constexpr, PDL: tl.constexpr, TMA: tl.constexpr):
    """One FC1 tile: expert e (>= 0; its weights at index e_w of p_w / p_s), rows
    route [BM] (-1: inactive) stored at rows o_row, weight rows i_n*BN..,
    reduction split i_s (one program of moe_fc1_kernel). FP8: x is e4m3 with
    scales p_xs [T, H/BK] when X_FP8, else bf16 quantized per step here; the
    activation is stored as e4m3 with scales p_os [rows, I/BK] (BN == BK). TMA: the
    weight tiles come through the descriptor d_w over p_w [E, N1, H]."""
    m_row = route >= 0
    tok = tl.where(m_row, route // K, 0)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    o_k = k_order(BK, NVFP4)  # the weight operand's K order
    p_we = p_w + e_w.to(tl.int64) * stride_we
    p_se = p_s + e_w.to(tl.int64) * stride_se
    b_g = tl.zeros([BN, BM], dtype=tl.float32)
    b_u = tl.zeros([BN, BM], dtype=tl.float32)
    c_lo, c_hi = split_chunks(i_s, chunks_per_split, num_chunks)
    n_wg, n_wu, n_xs = 0.0, 0.0, 0  # FP8: the next step's scales (`step_scales`)
    if FP8:
        n_wg, n_wu, n_xs = step_scales(p_se, i_n * BN, i_n * BN + I, p_xs, tok, m_row, c_lo,
                                       num_chunks, BK, GATED, X_FP8)
    for c in range(c_lo, c_hi):
        b_x, b_xs = act_operand(p_x, tok, m_row, o_k, c, stride_x, BK, FP8, not X_FP8,
                                INTERPRET)  # [BK, BM], FP8 and not X_FP8: scales [BM]
        b_sg = 0  # NVFP4: E4M3 scale bytes [BN, BK/16] of gate / up rows
        b_su = 0
        if NVFP4:
            if GATED:
                b_sg, b_su = load_scales_2(p_se, i_n * BN, I, I, c, num_chunks, BN, BK)
            else:
                b_sg = load_scales(p_se, o_n, m_n, c, num_chunks, BK)
        b_cg = 0  # FP8: w_scale * x_scale per column, gate / up
        b_cu = 0
        if FP8:
            b_wg, b_wu = n_wg, n_wu
            if X_FP8:
                b_xs = n_xs
            n_wg, n_wu, n_xs = step_scales(p_se, i_n * BN, i_n * BN + I, p_xs, tok, m_row,
                                           tl.minimum(c + 1, c_hi - 1), num_chunks, BK, GATED,
                                           X_FP8)
            b_cg = b_xs * b_wg
            b_cu = b_xs * b_wu
        b_g = scaled_dot(step_weight_tile(d_w, e_w, p_we, b_sg, i_n * BN, o_n, m_n, c, stride_wn,
                                          num_chunks, BN, BK, NVFP4, FP8, PTX_DECODE, INTERPRET,
                                          TMA), b_x, b_g, b_cg, FP8)
        if GATED:
            b_u = scaled_dot(step_weight_tile(d_w, e_w, p_we, b_su, I + i_n * BN, o_n + I, m_n, c,
                                              stride_wn, num_chunks, BN, BK, NVFP4, FP8,
                                              PTX_DECODE, INTERPRET, TMA), b_x, b_u, b_cu, FP8)
    if PDL:  # the next kernel's blocks may launch now, to wait in gdc_wait (its prologue overlaps)
        gdc_launch_dependents()
    if GSCALE:  # NVFP4's global scale, once per output instead of once per weight
        b_gs = tl.load(p_gs + e) * DECODE_UNSCALE
        b_g *= b_gs
        b_u *= b_gs
    if PARTIALS:
        m_out = m_n[:, None] & m_row[None, :]
        p_o = p_out + i_s * stride_os + o_row[None, :].to(tl.int64) * stride_or + o_n[:, None]
        tl.store(p_o, b_g, mask=m_out)
        if GATED:
            tl.store(p_o + I, b_u, mask=m_out)
    else:
        b_h = activation(b_g, b_u, ACT, alpha, limit, INTERPRET)
        if WEIGHT_BEFORE:
            b_h *= tl.load(p_topk_w + route, mask=m_row, other=0.0)[None, :]
        store_act(p_out, p_os, b_h, o_row, m_row, o_n, m_n, i_n, I // BN, stride_or, FP8,
                  INTERPRET)
