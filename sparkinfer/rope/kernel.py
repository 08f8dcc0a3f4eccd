"""Triton kernel: q/k head RMSNorm, rotate_half rotary on the first R dims, q out,
k and v into the cache at (slot, position // KV_STRIDE) when this rank owns the
position (position % KV_STRIDE == KV_OFFSET).

A program takes BLOCK_ROWS consecutive (token, head) rows of the T x (HQ + KVH)
q and k heads, token-major: row r is head r % (HQ + KVH) of token r // (HQ + KVH),
so a block runs on across tokens and no lane idles on a head count that is not a
power of two (launch.py sizes the block). Each row gathers its own position,
rotary row and cache slot. PDL (launched with launch_pdl after the qkv projection,
which lets its successor launch at entry): those are read, then the kernel waits for
the projection (`gdc_wait`) before reading qkv.

The head norm's sum of squares is `norm.kernel.sum_squares`, exact up to one
rounding: a tl.sum over a [BLOCK_ROWS, D] tile would round a head differently at
another BLOCK_ROWS, and the launcher picks BLOCK_ROWS by T, so a token's q and k
would depend on the batch."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sparkinfer.norm.kernel import sum_squares


@triton.jit
def rope_qk_cache_kernel(p_qkv, p_pos, p_slot, p_cos, p_sin, p_qw, p_kw, p_q, p_k, p_v,
                         stride_qkv, stride_cs, stride_qt, stride_qh,
                         stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
                         T, HQ, KVH, D, R, L, KV_STRIDE, KV_OFFSET, eps,
                         HAS_NORM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr = False):
    heads = HQ + KVH
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    m_r = o_r < T * heads
    i_t = tl.where(m_r, o_r // heads, 0)  # [BLOCK_ROWS] token of each row
    o_h = (o_r % heads).to(tl.int32)  # its head: q below HQ, k from HQ
    o_d = tl.arange(0, BLOCK_D)
    half = R // 2
    # rotate_half partner of each dim: d + R/2 below R/2, d - R/2 in [R/2, R), itself past R
    o_pair = tl.where(o_d < half, o_d + half, tl.where(o_d < R, o_d - half, o_d))
    m_d = o_d < D
    m = m_r[:, None] & m_d[None, :]
    # positions, slots and the rotary table are the step's inputs, not the predecessor's
    # output: read before waiting for it (PDL)
    b_pos = tl.load(p_pos + i_t, mask=m_r, other=0)  # [BLOCK_ROWS]
    b_slot = tl.load(p_slot + i_t, mask=m_r, other=0).to(tl.int64)[:, None]
    m_rot = o_d < R
    o_f = tl.where(o_d < half, o_d, o_d - half)
    p_cs = b_pos.to(tl.int64)[:, None] * stride_cs + o_f[None, :]
    m_cs = m_r[:, None] & m_rot[None, :]
    b_cos = tl.load(p_cos + p_cs, mask=m_cs, other=1.0)
    b_sin = tl.load(p_sin + p_cs, mask=m_cs, other=0.0)
    if PDL:
        gdc_launch_dependents()  # attention (launched with PDL) may launch now and wait for this grid
        gdc_wait()
    p_row = p_qkv + i_t[:, None] * stride_qkv + o_h[:, None] * D
    b_x = tl.load(p_row + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_xp = tl.load(p_row + o_pair[None, :], mask=m, other=0.0).to(tl.float32)
    is_q = (o_h < HQ)[:, None]
    if HAS_NORM:
        b_rstd = (1.0 / tl.sqrt(sum_squares(b_x, 1) / D + eps))[:, None]
        b_w = tl.where(is_q, tl.load(p_qw + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :],
                       tl.load(p_kw + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :])
        b_wp = tl.where(is_q, tl.load(p_qw + o_pair, mask=m_d, other=0.0).to(tl.float32)[None, :],
                        tl.load(p_kw + o_pair, mask=m_d, other=0.0).to(tl.float32)[None, :])
        # transformers rounds the normalized head to the storage dtype before the weight
        dt = p_q.dtype.element_ty
        b_x = (b_w * (b_x * b_rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        b_xp = (b_wp * (b_xp * b_rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    b_sign = tl.where(o_d < half, -1.0, 1.0)[None, :]
    b_y = tl.where(m_rot[None, :], b_x * b_cos + b_sign * b_xp * b_sin, b_x)
    tl.store(p_q + i_t[:, None] * stride_qt + o_h[:, None] * stride_qh + o_d[None, :],
             b_y.to(p_q.dtype.element_ty), mask=m & is_q)
    i_l = (b_pos // KV_STRIDE).to(tl.int64)[:, None]
    own = ((b_pos % KV_STRIDE) == KV_OFFSET)[:, None] & (i_l < L)
    o_kh = (o_h - HQ)[:, None]
    m_k = m & (~is_q) & own
    tl.store(p_k + b_slot * stride_ks + i_l * stride_kl + o_kh * stride_kh + o_d[None, :],
             b_y.to(p_k.dtype.element_ty), mask=m_k)
    b_v = tl.load(p_qkv + i_t[:, None] * stride_qkv + (o_kh + HQ + KVH) * D + o_d[None, :], mask=m_k,
                  other=0.0)
    tl.store(p_v + b_slot * stride_vs + i_l * stride_vl + o_kh * stride_vh + o_d[None, :], b_v, mask=m_k)
