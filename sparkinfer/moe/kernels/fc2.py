"""FC2 of the routed experts: one kernel, two families.

Legend: T tokens, K top-k, E experts, H hidden (FC2 output), I intermediate
(FC2 reduction), S1 / S2 split counts of FC1 / FC2, R = T*K routes.

MICRO: grid (R, cdiv(H, BN), S2). Reads the bf16 activation rows by route
(FC1's, or with FC1 split S1 > 1 those `moe_act_kernel` makes once per route
from FC1's fp32 partials: sum over the S1 splits in order, activation, router
weight when it comes before FC2, rounded to bf16). Stores fp32 partials
out[s, route, n].

GROUPED: grid (max_tiles, cdiv(H, BN), 1). Reads the bf16 activations that
FC1 stored in sorted order and stores out[0, route, n] in the output dtype. TILE_M > 0
(TileConfig.block_m2): the sort's tiles are TILE_M rows and a program takes BM of them,
TILE_M / BM programs a tile (grid max_tiles * TILE_M / BM).

FP8: FC2 reads e4m3 activation rows with one scale per row and 128 columns
(FC1's or moe_act_kernel's epilogue quantized them) and e4m3 weights with
128 x 128 block scales; e_lo / e_hi and GSCALE as in fc1.py.

The top-k sum (and the router weight after FC2) happens in `reduce.py`, in a
fixed order, so no kernel here uses atomics.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sparkinfer.moe.kernels.common import (
    DECODE_UNSCALE,
    activation,
    grouped_ids,
    k_order,
    load_scales,
    program_rows,
    split_chunks,
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
)


@triton.jit
def act_tile(p_a, route, m_row, o_k, k0, I, stride_as, stride_ar, p_topk_w, alpha, limit,
             S1: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, WEIGHT_BEFORE: tl.constexpr,
             INTERPRET: tl.constexpr):
    """Activation tile fp32 [len(o_k), BM] for reduction elements k0 + o_k (those < I;
    the rest are 0) of routes `route`, from FC1 partials p_a -> fp32 [S1, R, (2)I]."""
    m_a = m_row[None, :] & (k0 + o_k < I)[:, None]
    p_ak = p_a + route[None, :].to(tl.int64) * stride_ar + k0 + o_k[:, None]
    b_g = tl.zeros([o_k.shape[0], route.shape[0]], dtype=tl.float32)
    b_u = tl.zeros([o_k.shape[0], route.shape[0]], dtype=tl.float32)
    for s in tl.static_range(S1):
        b_g += tl.load(p_ak + s * stride_as, mask=m_a, other=0.0)
        if GATED:
            b_u += tl.load(p_ak + s * stride_as + I, mask=m_a, other=0.0)
    b_h = activation(b_g, b_u, ACT, alpha, limit, INTERPRET)
    if WEIGHT_BEFORE:
        b_h *= tl.load(p_topk_w + route, mask=m_row, other=0.0)[None, :]
    return b_h


@triton.jit
def moe_act_kernel(p_a, p_topk_w, p_out, p_os, R, I, stride_as, stride_ar, stride_or, alpha,
                   limit, BR: tl.constexpr, BI: tl.constexpr, S1: tl.constexpr,
                   GATED: tl.constexpr, ACT: tl.constexpr, WEIGHT_BEFORE: tl.constexpr,
                   FP8: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """Split FC1's epilogue, once per route: out[r, i] = activation of the S1
    fp32 partials summed in order (`act_tile`), as bf16 (the same bits FC1's
    own epilogue makes) or, FP8 (BI = 128, one group), e4m3 with its scale at
    p_os[r, i / BI]. Grid (cdiv(R, BR), I / BI); BI divides I."""
    if PDL:  # FC1's partials: wait for its grid
        gdc_launch_dependents()
        gdc_wait()
    route = tl.program_id(0) * BR + tl.arange(0, BR)
    m_row = route < R
    o_k = tl.arange(0, BI)
    k0 = tl.program_id(1) * BI
    b_h = act_tile(p_a, route, m_row, o_k, k0, I, stride_as, stride_ar, p_topk_w, alpha,
                   limit, S1, GATED, ACT, WEIGHT_BEFORE, INTERPRET)
    store_act(p_out + k0, p_os, b_h, route, m_row, o_k, o_k < BI, tl.program_id(1), I // BI,
              stride_or, FP8, INTERPRET)


@triton.jit
def moe_fc2_kernel(
    p_a, p_as, p_w, p_s, p_gs, p_ids, p_topk_w, p_sorted, p_tile_e, p_out, d_w, d_a,
    T, H, num_chunks, chunks_per_split, e_lo, e_hi,
    stride_ar, stride_we, stride_wn, stride_se, stride_os, stride_or,
    E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MICRO: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, WEIGHT_BEFORE: tl.constexpr,  # FC1's (unused)
    NVFP4: tl.constexpr, FP8: tl.constexpr, X_FP8: tl.constexpr,  # X_FP8: FC1's (unused)
    GSCALE: tl.constexpr, PTX_DECODE: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False, GROUP: tl.constexpr = 0, TMA: tl.constexpr = False,
    RESCALE: tl.constexpr = False, ROWS: tl.constexpr = False, TILE_M: tl.constexpr = 0,
):
    i_m, i_n = grouped_ids(H, BN, GROUP)
    e, route, o_arow = program_rows(p_ids, p_sorted, p_tile_e, i_m, T, E, K, BM, KP, RP, MICRO, TILE_M)
    if (e >= e_lo) & (e < e_hi):
        fc2_tile(p_a, p_as, p_w, p_s, p_gs, p_out, d_w, d_a, e, e - e_lo, route, o_arow,
                 i_m * BM, i_n, tl.program_id(2), H, num_chunks, chunks_per_split, stride_ar,
                 stride_we, stride_wn, stride_se, stride_os, stride_or, BM, BN, BK, NVFP4, FP8,
                 GSCALE, PTX_DECODE, INTERPRET, PDL, TMA, RESCALE, ROWS)


@triton.jit
def fc2_tile(p_a, p_as, p_w, p_s, p_gs, p_out, d_w, d_a, e, e_w, route, o_arow, a_row0, i_n,
             i_s, H, num_chunks, chunks_per_split, stride_ar, stride_we, stride_wn, stride_se,
             stride_os, stride_or, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             NVFP4: tl.constexpr, FP8: tl.constexpr, GSCALE: tl.constexpr,
             PTX_DECODE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
             TMA: tl.constexpr, RESCALE: tl.constexpr = False, ROWS: tl.constexpr = False):
    """One FC2 tile: expert e (>= 0; its weights at index e_w), activation rows
    o_arow for routes `route` [BM] (-1: inactive; FP8: e4m3 with scales p_as
    [rows, I/BK]), weight rows i_n*BN.., reduction split i_s; stores
    out[i_s, route, n] (one program of moe_fc2_kernel). TMA (grouped: the tile's
    rows are a_row0..a_row0+BM): weight tiles through d_w over p_w [E, H, I],
    activation tiles through d_a over p_a [rows, I] (block [BM, BK]). RESCALE, ROWS (FP8): the
    accumulation of kernels/fp8.py's `rescaled_dot`."""
    m_row = route >= 0
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    o_k = k_order(BK, NVFP4)  # the weight operand's K order
    p_we = p_w + e_w.to(tl.int64) * stride_we
    p_se = p_s + e_w.to(tl.int64) * stride_se
    if FP8 and RESCALE:  # [BM, BN] with ROWS, and the sum's units
        b_acc, b_unit = fp8_acc(BN, BM, ROWS)
    else:
        b_acc = tl.zeros([BN, BM], dtype=tl.float32)
    c_lo, c_hi = split_chunks(i_s, chunks_per_split, num_chunks)
    if PDL:  # launched early (programmatic dependent launch): FC1's rows are ready after this
        gdc_wait()
    n_w, n_as = 0.0, 0  # FP8: the next step's scales (`step_scales`)
    if FP8:
        n_w, _, n_as = step_scales(p_se, i_n * BN, 0, p_as, o_arow, m_row, c_lo, num_chunks, BK,
                                   False, True)
    for c in range(c_lo, c_hi):
        if TMA:
            b_a = tl.trans(d_a.load([a_row0, c * BK]))
            if INTERPRET:
                b_a = b_a.to(tl.float32)
        else:
            b_a, _ = act_operand(p_a, o_arow, m_row, o_k, c, stride_ar, BK, FP8, False,
                                 INTERPRET)
        b_s = 0  # NVFP4: scale bytes [BN, BK/16]
        b_c = 0  # FP8: w_scale * a_scale per column
        if NVFP4:
            b_s = load_scales(p_se, o_n, m_n, c, num_chunks, BK)
        if FP8:
            b_c = n_as * n_w
            n_w, _, n_as = step_scales(p_se, i_n * BN, 0, p_as, o_arow, m_row,
                                       tl.minimum(c + 1, c_hi - 1), num_chunks, BK, False, True)
        b_wt = step_weight_tile(d_w, e_w, p_we, b_s, i_n * BN, o_n, m_n, c, stride_wn, num_chunks, BN, BK,
                                NVFP4, FP8, PTX_DECODE, INTERPRET, TMA)
        if FP8 and RESCALE:
            b_acc, b_unit = rescaled_dot(b_wt, b_a, b_acc, b_unit, b_c, ROWS)
        else:
            b_acc = scaled_dot(b_wt, b_a, b_acc, b_c, FP8)
    if FP8 and RESCALE:
        b_acc = rescaled_sum(b_acc, b_unit, ROWS)
    if PDL:
        gdc_launch_dependents()
    if GSCALE:  # NVFP4's global scale, once per output instead of once per weight
        b_acc *= tl.load(p_gs + e) * DECODE_UNSCALE
    p_o = p_out + i_s * stride_os + route[None, :].to(tl.int64) * stride_or + o_n[:, None]
    tl.store(p_o, b_acc.to(p_out.dtype.element_ty), mask=m_n[:, None] & m_row[None, :])
