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

PASSES 2 (FP8 grouped only, TileConfig.fc1_passes): a program's BN = 128 rows (one
activation group) run as two K passes of 64 rows each, the first half's activation
held in registers until the second's is done, so the gate and up accumulators and a
step's dot result are half as tall: at BM 128 ptxas (sm_90) spills 296 bytes where one
pass spills 1,172 (plan.FP8_MAX_BLOCK_M, tuning.TILES_FP8). Every sum is the one-pass
sum (each row's K steps in the same order), and the group's scale comes from both
halves' amax: the same bytes.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sparkinfer.moe.kernels.common import (
    DECODE_UNSCALE,
    activation,
    grouped_ids,
    k_order,
    k_position,
    load_scales,
    load_scales_2,
    program_rows,
    rows_in_k_order,
    split_chunks,
    step_k_order,
    step_weight_tile,
)
from sparkinfer.moe.kernels.fp8 import (
    act_operand,
    fp8_acc,
    rescaled_dot,
    rescaled_sum,
    scaled_dot,
    step_scales,
    store_act,
    store_act_pair,
)


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
    TMA: tl.constexpr = False, PASSES: tl.constexpr = 1, RESCALE: tl.constexpr = False,
    ROWS: tl.constexpr = False, KCH: tl.constexpr = 0, WAIT: tl.constexpr = False,
):
    if WAIT:  # launched early behind the routing (micro): its ids and weights after this
        gdc_wait()
    i_m, i_n = grouped_ids(I, BN, GROUP)
    e, route, o_row = program_rows(p_ids, p_sorted, p_tile_e, i_m, T, E, K, BM, KP, RP, MICRO)
    if (e >= e_lo) & (e < e_hi):
        fc1_tile(p_x, p_xs, p_w, p_s, p_gs, p_topk_w, p_out, p_os, d_w, e, e - e_lo, route,
                 o_row, i_n, tl.program_id(2), I, num_chunks, chunks_per_split,
                 stride_x, stride_we, stride_wn, stride_se, stride_os, stride_or, alpha, limit,
                 K, BM, BN, BK, PARTIALS, GATED, ACT, NVFP4, FP8, X_FP8, GSCALE, WEIGHT_BEFORE,
                 PTX_DECODE, INTERPRET, PDL, TMA, PASSES, RESCALE, ROWS, KCH)


@triton.jit
def fc1_sums(p_x, p_xs, p_w, p_s, d_w, e_w, tok, m_row, row0, i_s, I, num_chunks,
             chunks_per_split, stride_x, stride_we, stride_wn, stride_se, BN: tl.constexpr,
             BK: tl.constexpr, GATED: tl.constexpr, NVFP4: tl.constexpr, FP8: tl.constexpr,
             X_FP8: tl.constexpr, PTX_DECODE: tl.constexpr, INTERPRET: tl.constexpr,
             TMA: tl.constexpr, RESCALE: tl.constexpr = False, ROWS: tl.constexpr = False,
             KCH: tl.constexpr = 0):
    """FC1's gate and up sums fp32 [BN, BM] of weight rows row0.. (gate; up: I + row0..)
    over reduction split i_s, for token rows `tok` (masked by m_row). FP8: x is e4m3 with
    scales p_xs [T, H/BK] when X_FP8, else bf16 quantized per step here. TMA: the weight
    tiles come through the descriptor d_w over p_w [E, N1, H] (block [1, BN, BK]).
    RESCALE, ROWS (FP8): the accumulation of kernels/fp8.py's `rescaled_dot`. KCH > 0:
    bf16 copies in NVFP4's K order within chunks of KCH (`step_k_order`)."""
    o_n = row0 + tl.arange(0, BN)
    m_n = o_n < I
    o_k = k_order(BK, NVFP4)  # the weight operand's K order
    p_we = p_w + e_w.to(tl.int64) * stride_we
    p_se = p_s + e_w.to(tl.int64) * stride_se
    if FP8 and RESCALE:  # [BM, BN] with ROWS, and the sums' units
        b_g, unit_g = fp8_acc(BN, tok.shape[0], ROWS)
        b_u, unit_u = fp8_acc(BN, tok.shape[0], ROWS)
    else:
        b_g = tl.zeros([BN, tok.shape[0]], dtype=tl.float32)
        b_u = tl.zeros([BN, tok.shape[0]], dtype=tl.float32)
    c_lo, c_hi = split_chunks(i_s, chunks_per_split, num_chunks)
    n_wg, n_wu, n_xs = 0.0, 0.0, 0  # FP8: the next step's scales (`step_scales`)
    if FP8:
        n_wg, n_wu, n_xs = step_scales(p_se, row0, row0 + I, p_xs, tok, m_row, c_lo,
                                       num_chunks, BK, GATED, X_FP8)
    for c in range(c_lo, c_hi):
        b_x, b_xs = act_operand(p_x, tok, m_row, step_k_order(o_k, c, BK, KCH), c, stride_x, BK, FP8,
                                not X_FP8, INTERPRET)  # [BK, BM], FP8 and not X_FP8: scales [BM]
        b_sg = 0  # NVFP4: E4M3 scale bytes [BN, BK/16] of gate / up rows
        b_su = 0
        if NVFP4:
            if GATED:
                b_sg, b_su = load_scales_2(p_se, row0, I, I, c, num_chunks, BN, BK)
            else:
                b_sg = load_scales(p_se, o_n, m_n, c, num_chunks, BK)
        b_cg = 0  # FP8: w_scale * x_scale per column, gate / up
        b_cu = 0
        if FP8:
            b_wg, b_wu = n_wg, n_wu
            if X_FP8:
                b_xs = n_xs
            n_wg, n_wu, n_xs = step_scales(p_se, row0, row0 + I, p_xs, tok, m_row,
                                           tl.minimum(c + 1, c_hi - 1), num_chunks, BK, GATED,
                                           X_FP8)
            b_cg = b_xs * b_wg
            b_cu = b_xs * b_wu
        b_wt = step_weight_tile(d_w, e_w, p_we, b_sg, row0, o_n, m_n, c, stride_wn, num_chunks, BN, BK,
                                NVFP4, FP8, PTX_DECODE, INTERPRET, TMA)
        if FP8 and RESCALE:
            b_g, unit_g = rescaled_dot(b_wt, b_x, b_g, unit_g, b_cg, ROWS)
        else:
            b_g = scaled_dot(b_wt, b_x, b_g, b_cg, FP8)
        if GATED:
            b_wt = step_weight_tile(d_w, e_w, p_we, b_su, I + row0, o_n + I, m_n, c, stride_wn,
                                    num_chunks, BN, BK, NVFP4, FP8, PTX_DECODE, INTERPRET, TMA)
            if FP8 and RESCALE:
                b_u, unit_u = rescaled_dot(b_wt, b_x, b_u, unit_u, b_cu, ROWS)
            else:
                b_u = scaled_dot(b_wt, b_x, b_u, b_cu, FP8)
    if FP8 and RESCALE:
        b_g = rescaled_sum(b_g, unit_g, ROWS)
        b_u = rescaled_sum(b_u, unit_u, ROWS)
    return b_g, b_u


@triton.jit
def routed_act(b_g, b_u, p_topk_w, route, m_row, alpha, limit, ACT: tl.constexpr,
               WEIGHT_BEFORE: tl.constexpr, INTERPRET: tl.constexpr):
    """The activation of FC1's sums [BN, BM], times each route's router weight when it
    comes before FC2."""
    b_h = activation(b_g, b_u, ACT, alpha, limit, INTERPRET)
    if WEIGHT_BEFORE:
        b_h *= tl.load(p_topk_w + route, mask=m_row, other=0.0)[None, :]
    return b_h


@triton.jit
def fc1_tile(p_x, p_xs, p_w, p_s, p_gs, p_topk_w, p_out, p_os, d_w, e, e_w, route, o_row, i_n,
             i_s,
             I, num_chunks, chunks_per_split, stride_x, stride_we, stride_wn, stride_se,
             stride_os, stride_or, alpha, limit, K: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, PARTIALS: tl.constexpr, GATED: tl.constexpr,
             ACT: tl.constexpr, NVFP4: tl.constexpr, FP8: tl.constexpr, X_FP8: tl.constexpr,
             GSCALE: tl.constexpr, WEIGHT_BEFORE: tl.constexpr, PTX_DECODE: tl.constexpr,
             INTERPRET: tl.constexpr, PDL: tl.constexpr, TMA: tl.constexpr,
             PASSES: tl.constexpr = 1, RESCALE: tl.constexpr = False, ROWS: tl.constexpr = False,
             KCH: tl.constexpr = 0):
    """One FC1 tile: expert e (>= 0; its weights at index e_w of p_w / p_s), rows
    route [BM] (-1: inactive) stored at rows o_row, weight rows i_n*BN..,
    reduction split i_s (one program of moe_fc1_kernel; `fc1_sums`). FP8: the
    activation is stored as e4m3 with scales p_os [rows, I/BK] (BN == BK); PASSES 2:
    in two halves of BN / 2 rows (module docstring). KCH > 0 (NVFP4's dequantized
    path): x gathered and the activation stored in NVFP4's K order (`k_position`)."""
    m_row = route >= 0
    tok = tl.where(m_row, route // K, 0)
    BP: tl.constexpr = BN // PASSES
    b_g, b_u = fc1_sums(p_x, p_xs, p_w, p_s, d_w, e_w, tok, m_row, i_n * BN, i_s, I, num_chunks,
                        chunks_per_split, stride_x, stride_we, stride_wn, stride_se, BP, BK, GATED,
                        NVFP4, FP8, X_FP8, PTX_DECODE, INTERPRET, TMA, RESCALE, ROWS, KCH)
    o_n = i_n * BN + tl.arange(0, BP)
    m_n = o_n < I
    if PASSES == 2:  # FP8 only (bind): the first half's activation waits for the second's
        b_h0 = routed_act(b_g, b_u, p_topk_w, route, m_row, alpha, limit, ACT, WEIGHT_BEFORE, INTERPRET)
        b_g, b_u = fc1_sums(p_x, p_xs, p_w, p_s, d_w, e_w, tok, m_row, i_n * BN + BP, i_s, I,
                            num_chunks, chunks_per_split, stride_x, stride_we, stride_wn,
                            stride_se, BP, BK, GATED, NVFP4, FP8, X_FP8, PTX_DECODE, INTERPRET,
                            TMA, RESCALE, ROWS, KCH)
        if PDL:
            gdc_launch_dependents()
        b_h1 = routed_act(b_g, b_u, p_topk_w, route, m_row, alpha, limit, ACT, WEIGHT_BEFORE, INTERPRET)
        store_act_pair(p_out, p_os, b_h0, b_h1, o_row, m_row, o_n, o_n + BP, m_n, o_n + BP < I,
                       i_n, I // BN, stride_or, INTERPRET)
    else:
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
            b_h = routed_act(b_g, b_u, p_topk_w, route, m_row, alpha, limit, ACT, WEIGHT_BEFORE,
                             INTERPRET)
            o_st = o_n
            if KCH > 0:  # the dequantized path: FC2's copies are in NVFP4's K order
                if BN % KCH == 0:
                    b_h = rows_in_k_order(b_h, KCH)
                else:
                    o_st = k_position(o_n, KCH)
            store_act(p_out, p_os, b_h, o_row, m_row, o_st, m_n, i_n, I // BN, stride_or, FP8,
                      INTERPRET)
