"""Triton kernel: q/k head RMSNorm, rotate_half rotary on the first R dims, q out,
k and v into the cache at (slot, position // KV_STRIDE) when this rank owns the
position (position % KV_STRIDE == KV_OFFSET). One program per (token, head block).

The head norm's sum of squares is `norm.kernel.sum_squares`, exact up to one
rounding: the launcher narrows the head blocks when a step has few tokens
(launch.py), and a tl.sum over a [BLOCK_HEADS, D] tile rounds a head differently
at another BLOCK_HEADS, so a token's q and k would depend on the batch."""

import triton
import triton.language as tl

from sparkinfer.norm.kernel import sum_squares


@triton.jit
def rope_qk_cache_kernel(p_qkv, p_pos, p_slot, p_cos, p_sin, p_qw, p_kw, p_q, p_k, p_v,
                         stride_qkv, stride_cs, stride_qt, stride_qh,
                         stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
                         HQ, KVH, D, R, L, KV_STRIDE, KV_OFFSET, eps,
                         HAS_NORM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    o_d = tl.arange(0, BLOCK_D)
    half = R // 2
    # rotate_half partner of each dim: d + R/2 below R/2, d - R/2 in [R/2, R), itself past R
    o_pair = tl.where(o_d < half, o_d + half, tl.where(o_d < R, o_d - half, o_d))
    m_d = o_d < D
    m = (o_h < HQ + KVH)[:, None] & m_d[None, :]
    p_row = p_qkv + i_t * stride_qkv + o_h[:, None] * D
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
    b_pos = tl.load(p_pos + i_t)
    m_r = o_d < R
    o_f = tl.where(o_d < half, o_d, o_d - half)
    b_cos = tl.load(p_cos + b_pos.to(tl.int64) * stride_cs + o_f, mask=m_r, other=1.0)[None, :]
    b_sin = tl.load(p_sin + b_pos.to(tl.int64) * stride_cs + o_f, mask=m_r, other=0.0)[None, :]
    b_sign = tl.where(o_d < half, -1.0, 1.0)[None, :]
    b_y = tl.where(m_r[None, :], b_x * b_cos + b_sign * b_xp * b_sin, b_x)
    tl.store(p_q + i_t * stride_qt + o_h[:, None] * stride_qh + o_d[None, :],
             b_y.to(p_q.dtype.element_ty), mask=m & is_q)
    b_slot = tl.load(p_slot + i_t).to(tl.int64)
    i_l = (b_pos // KV_STRIDE).to(tl.int64)
    own = ((b_pos % KV_STRIDE) == KV_OFFSET) & (i_l < L)
    o_kh = (o_h - HQ)[:, None]
    m_k = m & (o_h >= HQ)[:, None] & own
    tl.store(p_k + b_slot * stride_ks + i_l * stride_kl + o_kh * stride_kh + o_d[None, :],
             b_y.to(p_k.dtype.element_ty), mask=m_k)
    b_v = tl.load(p_qkv + i_t * stride_qkv + (o_kh + HQ + KVH) * D + o_d[None, :], mask=m_k, other=0.0)
    tl.store(p_v + b_slot * stride_vs + i_l * stride_vl + o_kh * stride_vh + o_d[None, :], b_v, mask=m_k)
