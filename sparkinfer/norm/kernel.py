"""Triton kernel of residual add + RMSNorm: one program per row, fp32 math.

PDL: the kernel lets its successor launch at entry (`gdc_launch_dependents`).
The norm itself launches like any kernel (it waits for its predecessor), but
the projection after it (`sparkinfer.linear`, launched with programmatic
dependent launch) may then start while the norm runs and load its weights,
waiting in `gdc_wait` only for x (MEASURED.md, H200: a 2048 x 2048 GEMV chain
4.18 -> 2.76 us once the predecessor let it launch early). A successor launched
without PDL is unaffected.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents


@triton.jit
def add_rms_norm_kernel(p_x, p_res, p_w, p_out, p_res_out, H, stride_x, stride_res, stride_out,
                        stride_res_out, eps, HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr,
                        PDL: tl.constexpr = False):
    if PDL:
        gdc_launch_dependents()
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    b_x = tl.load(p_x + i_t * stride_x + o_h, mask=m_h, other=0.0).to(tl.float32)
    if HAS_RES:
        b_r = tl.load(p_res + i_t * stride_res + o_h, mask=m_h, other=0.0).to(tl.float32)
        # the residual stream is stored rounded; the norm reads the stored value
        b_x = (b_x + b_r).to(p_res_out.dtype.element_ty)
        tl.store(p_res_out + i_t * stride_res_out + o_h, b_x, mask=m_h)
        b_x = b_x.to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=0) / H + eps)
    b_w = tl.load(p_w + o_h, mask=m_h, other=0.0).to(tl.float32)
    tl.store(p_out + i_t * stride_out + o_h, (b_x * b_rstd * b_w).to(p_out.dtype.element_ty), mask=m_h)
