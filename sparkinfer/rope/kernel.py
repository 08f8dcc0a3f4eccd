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

A row is held as its rotary halves, lo = dims [0, R/2) and hi = [R/2, R), and the
dims past R (`HAS_PASS`) apart: rotate_half pairs lo[i] with hi[i], so each element
is loaded, normalized and rotated once, and the cos / sin rows are R/2 wide. (The
kernel before loaded every dim with its partner again, normalizing both, and read
cos / sin at full width.) Offsets into qkv and q are int32 (launch.py checks they fit).

The head norm's sum of squares is `norm.kernel.sum_squares`, exact up to one
rounding: a tl.sum over a [BLOCK_ROWS, D] tile would round a head differently at
another BLOCK_ROWS, and the launcher picks BLOCK_ROWS by T, so a token's q and k
would depend on the batch. Being exact, it is the same whichever tile holds the row."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sparkinfer.norm.kernel import sum_squares


@triton.jit
def rope_qk_cache_kernel(p_qkv, p_pos, p_slot, p_cos, p_sin, p_qw, p_kw, p_q, p_k, p_v,
                         stride_qkv, stride_cs, stride_qt, stride_qh,
                         stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh,
                         T, HQ, KVH, D, R, L, KV_STRIDE, KV_OFFSET, eps,
                         HAS_NORM: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr = False):
    heads = HQ + KVH
    o_r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    m_r = o_r < T * heads
    i_t = tl.where(m_r, o_r // heads, 0)  # [BLOCK_ROWS] token of each row
    o_h = o_r % heads  # its head: q below HQ, k from HQ
    is_q = o_h < HQ
    half = R // 2
    o_f = tl.arange(0, BLOCK_H)  # a dim of lo; hi's is o_f + half
    m_f = m_r[:, None] & (o_f < half)[None, :]
    # positions, slots and the rotary table are the step's inputs, not the predecessor's
    # output: read before waiting for it (PDL)
    b_pos = tl.load(p_pos + i_t, mask=m_r, other=0)  # [BLOCK_ROWS]
    b_slot = tl.load(p_slot + i_t, mask=m_r, other=0).to(tl.int64)
    p_cs = b_pos[:, None] * stride_cs + o_f[None, :]
    b_cos = tl.load(p_cos + p_cs, mask=m_f, other=1.0)
    b_sin = tl.load(p_sin + p_cs, mask=m_f, other=0.0)
    if PDL:
        gdc_launch_dependents()  # attention (launched with PDL) may launch now and wait for this grid
        gdc_wait()
    base = (i_t * stride_qkv + o_h * D)[:, None]
    b_lo = tl.load(p_qkv + base + o_f[None, :], mask=m_f, other=0.0).to(tl.float32)
    b_hi = tl.load(p_qkv + base + half + o_f[None, :], mask=m_f, other=0.0).to(tl.float32)
    if HAS_PASS:  # the dims past R: normalized, not rotated
        o_p = R + tl.arange(0, BLOCK_P)
        m_p = m_r[:, None] & (o_p < D)[None, :]
        b_ps = tl.load(p_qkv + base + o_p[None, :], mask=m_p, other=0.0).to(tl.float32)
    dt = p_q.dtype.element_ty
    if HAS_NORM:
        if HAS_PASS:  # the whole row once more for the sum (exact: the same bits as from the parts)
            o_d = tl.arange(0, BLOCK_D)
            b_x = tl.load(p_qkv + base + o_d[None, :], mask=m_r[:, None] & (o_d < D)[None, :],
                          other=0.0).to(tl.float32)
            b_ss = sum_squares(b_x, 1)
        else:
            b_ss = sum_squares(tl.reshape(tl.join(b_lo, b_hi), [BLOCK_ROWS, 2 * BLOCK_H]), 1)
        b_rstd = (1.0 / tl.sqrt(b_ss / D + eps))[:, None]
        q_row = is_q[:, None]
        b_lo = _normed(b_lo, b_rstd, p_qw, p_kw, o_f, o_f < half, q_row, dt)
        b_hi = _normed(b_hi, b_rstd, p_qw, p_kw, half + o_f, o_f < half, q_row, dt)
        if HAS_PASS:
            b_ps = _normed(b_ps, b_rstd, p_qw, p_kw, o_p, o_p < D, q_row, dt)
    y_lo = b_lo * b_cos + (-b_hi) * b_sin
    y_hi = b_hi * b_cos + b_lo * b_sin
    p_qrow = p_q + (i_t * stride_qt + o_h * stride_qh)[:, None]
    m_q = is_q[:, None]
    tl.store(p_qrow + o_f[None, :], y_lo.to(dt), mask=m_f & m_q)
    tl.store(p_qrow + half + o_f[None, :], y_hi.to(dt), mask=m_f & m_q)
    if HAS_PASS:
        tl.store(p_qrow + o_p[None, :], b_ps.to(dt), mask=m_p & m_q)
    i_l = (b_pos // KV_STRIDE).to(tl.int64)
    own = m_r & (~is_q) & ((b_pos % KV_STRIDE) == KV_OFFSET) & (i_l < L)
    o_kh = (o_h - HQ).to(tl.int64)
    m_k = own[:, None]
    p_krow = p_k + (b_slot * stride_ks + i_l * stride_kl + o_kh * stride_kh)[:, None]
    tl.store(p_krow + o_f[None, :], y_lo.to(p_k.dtype.element_ty), mask=m_f & m_k)
    tl.store(p_krow + half + o_f[None, :], y_hi.to(p_k.dtype.element_ty), mask=m_f & m_k)
    if HAS_PASS:
        tl.store(p_krow + o_p[None, :], b_ps.to(p_k.dtype.element_ty), mask=m_p & m_k)
    o_v = tl.arange(0, BLOCK_D)
    m_v = m_k & (o_v < D)[None, :]
    b_v = tl.load(p_qkv + (i_t * stride_qkv + (o_h + KVH) * D)[:, None] + o_v[None, :], mask=m_v, other=0.0)
    p_vrow = p_v + (b_slot * stride_vs + i_l * stride_vl + o_kh * stride_vh)[:, None]
    tl.store(p_vrow + o_v[None, :], b_v, mask=m_v)


@triton.jit
def _normed(b_x, b_rstd, p_qw, p_kw, o_d, m_d, q_row, dt: tl.constexpr):
    """Dims o_d of each row normalized and weighted (q_norm's weight on q rows, k_norm's on
    k rows), rounded as transformers rounds: the normalized head to the storage dtype
    before the weight, the product again."""
    w = tl.where(q_row, tl.load(p_qw + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :],
                 tl.load(p_kw + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :])
    return (w * (b_x * b_rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
