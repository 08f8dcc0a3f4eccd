"""Triton kernel of residual add + RMSNorm (one program per row, fp32 math), and
the exact sum of squares every RMSNorm of the decoder uses.

`sum_squares` is exact up to one final rounding: each fp32 square becomes a
fixed-point integer on the row's largest binade (its 24-bit significand shifted
to 2**22 units below that binade's top), the integers add in int64, and the sum
is rounded to fp32 once. Integer addition is associative, so the result does
not depend on the order of the terms: not on the tile, the warps, the vector
width, nor on how a kernel holds the row (whole elements, or the (lo, hi)
halves of the LL words in comm/fused_norm). A tl.sum of fp32 squares is a tree
whose shape follows the layout, so two kernels (or one kernel at two tile
widths, as rope's head blocks at different token counts) round the same row
differently: the next layer then sees other bits (batch invariance, docs/design.md).
Terms below 2**-22 of a unit of the largest square's binade are truncated: at
most 2**13 terms of < 1 unit each against a sum of >= 2**45 units, a relative
error under 2**-32, against 2**-24 for one fp32 rounding.

PDL: the kernel lets its successor launch at entry (`gdc_launch_dependents`).
WAIT (launch.NORM_WAIT): the norm is itself launched early behind the projection
before it and waits in `gdc_wait` before its first read. The projection after it
(`sparkinfer.linear`, launched with programmatic dependent launch) may start while
the norm runs and load its weights, waiting in `gdc_wait` only for x (MEASURED.md, H200: a 2048 x 2048 GEMV chain
4.18 -> 2.76 us once the predecessor let it launch early). A successor launched
without PDL is unaffected.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# fixed-point units below the top of the row's largest binade: terms < 2**47, and
# 2**16 of them (H up to 65536) still sum below 2**63
FIXED_SHIFT = tl.constexpr(22)


@triton.jit
def sum_squares(x, AXIS: tl.constexpr):
    """Sum of x * x (fp32) along AXIS, exactly up to one rounding (module docstring);
    inf where a square or the sum overflows, NaN over a NaN, as a float sum.

    One function, no nested helpers: the interpreter pays for every jit call."""
    sq = x * x
    bits = sq.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    e = bits >> 23  # biased exponent: 0 for zeros and subnormals (unit of exponent 1), 255 inf / NaN
    e1 = tl.maximum(e, 1)
    # 2 * the row's top exponent, + 1 when a square is NaN
    key = tl.max(2 * e1 + (sq != sq).to(tl.int32), AXIS)
    e_max = key >> 1
    m = ((bits & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)).to(tl.int64)  # 24-bit significand
    sh = e1 - tl.expand_dims(e_max, AXIS) + FIXED_SHIFT  # <= FIXED_SHIFT
    # units of 2**(e_max - 150 - FIXED_SHIFT), truncated (m < 2**24: >> 31 is 0)
    fixed = (m << tl.maximum(sh, 0).to(tl.int64)) >> tl.minimum(tl.maximum(-sh, 0), 31).to(tl.int64)
    total = tl.sum(fixed, AXIS)
    top = tl.where(e_max == 255, 1.0, (tl.minimum(e_max, 254) << 23).to(tl.float32, bitcast=True))  # 2**(e-127)
    # 2**-45 first: total * 2**-45 <= 2**18 cannot overflow, the second product only where
    # the true sum does
    ss = total.to(tl.float32) * 2.842170943040401e-14 * top
    return tl.where(e_max == 255, tl.where((key & 1) == 1, float("nan"), float("inf")), ss)


@triton.jit
def sum_squares_2(a, b):
    """`sum_squares` over the elements of two 1-D blocks together (the LL kernel's
    (lo, hi) halves of a row): the same bits as over one block holding them all."""
    return sum_squares(tl.reshape(tl.join(a, b), [2 * a.shape[0]]), 0)


@triton.jit
def add_rms_norm_kernel(p_x, p_res, p_w, p_out, p_res_out, H, stride_x, stride_res, stride_out,
                        stride_res_out, eps, HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr,
                        PDL: tl.constexpr = False, WAIT: tl.constexpr = False):
    """PDL: lets the next kernel launch at entry; WAIT: launched early itself (launch_pdl),
    so it waits for its predecessor before its first read or write."""
    if PDL:
        gdc_launch_dependents()
    if WAIT:
        gdc_wait()
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    b_x = tl.load(p_x + i_t * stride_x + o_h, mask=m_h, other=0.0).to(tl.float32)
    norm_row(b_x, p_res, p_w, p_out, p_res_out, i_t, o_h, m_h, H, stride_res, stride_out,
             stride_res_out, eps, HAS_RES)


@triton.jit
def norm_row(b_x, p_res, p_w, p_out, p_res_out, i_t, o_h, m_h, H, stride_res, stride_out,
             stride_res_out, eps, HAS_RES: tl.constexpr):
    """Row i_t's residual add + RMSNorm of x (fp32 [BLOCK_H], masked by m_h): stores
    residual_out (x + residual, rounded) and out (add_rms_norm_kernel; the MoE top-k sum
    folded in front of it, moe/kernels/reduce.py)."""
    if HAS_RES:
        b_r = tl.load(p_res + i_t * stride_res + o_h, mask=m_h, other=0.0).to(tl.float32)
        # the residual stream is stored rounded; the norm reads the stored value
        b_x = (b_x + b_r).to(p_res_out.dtype.element_ty)
        tl.store(p_res_out + i_t * stride_res_out + o_h, b_x, mask=m_h)
        b_x = b_x.to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(sum_squares(b_x, 0) / H + eps)
    b_w = tl.load(p_w + o_h, mask=m_h, other=0.0).to(tl.float32)
    tl.store(p_out + i_t * stride_out + o_h, (b_x * b_rstd * b_w).to(p_out.dtype.element_ty), mask=m_h)
