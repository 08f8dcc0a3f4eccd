"""Triton kernel: out[M, N] = x[M, K] @ w[N, K].T (+ bias) for M <= BM (16).

One program per BN output features over the whole K (no split, so every row's
sum runs in one fixed order: bitwise the same for any M and any batch). The
weight tile is the MMA's left operand ([BN, BK] x [BK, BM]), so M pads only to
the MMA's narrow side.
"""

import triton
import triton.language as tl


@triton.jit
def _operand(x, INTERPRET: tl.constexpr):
    # the interpreter computes bf16 dots in fp16 (wrong for bf16 ranges): fp32 there
    if INTERPRET:
        return x.to(tl.float32)
    return x


@triton.jit
def linear_rows_kernel(p_x, p_w, p_b, p_out, M, N, K, stride_xm, stride_wn, stride_om,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    o_n = tl.program_id(0) * BN + tl.arange(0, BN)
    o_m = tl.arange(0, BM)
    o_k = tl.arange(0, BK)
    m_n = o_n < N
    m_m = o_m < M
    p_wt = p_w + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :]
    p_xt = p_x + o_m[None, :] * stride_xm + o_k[:, None]
    b_acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k in range(0, K, BK):
        if EVEN_K:
            b_w = tl.load(p_wt + k, mask=m_n[:, None], other=0.0)
            b_x = tl.load(p_xt + k, mask=m_m[None, :], other=0.0)
        else:
            m_k = (k + o_k) < K
            b_w = tl.load(p_wt + k, mask=m_n[:, None] & m_k[None, :], other=0.0)
            b_x = tl.load(p_xt + k, mask=m_m[None, :] & m_k[:, None], other=0.0)
        if IEEE:  # fp32 weights (GLM-4.5's router) keep fp32 products, not TF32
            b_acc = tl.dot(_operand(b_w, INTERPRET), _operand(b_x, INTERPRET), b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_w, b_x, b_acc)
    if HAS_BIAS:
        b_acc += tl.load(p_b + o_n, mask=m_n, other=0.0).to(tl.float32)[:, None]
    tl.store(p_out + o_m[None, :] * stride_om + o_n[:, None], b_acc.to(p_out.dtype.element_ty),
             mask=m_n[:, None] & m_m[None, :])
