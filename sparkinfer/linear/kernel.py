"""Triton kernel: out[M, N] = x[M, K] @ w[N, K].T (+ bias) for M <= BM (16).

One program per BN output features and K slice. With one slice (SPLIT = 1) a
program sums all of K and stores the row. With SPLIT slices each program stores
its fp32 partial, and the last of a feature block's programs to finish (a
per-block semaphore the caller owns, counted up and reset to zero here) adds the
SPLIT partials in slice order: the sum order is fixed whatever order the
programs finish in, so a row is bitwise the same at any M and any batch. The
weight tile is the MMA's left operand ([BN, BK] x [BK, BM]), so M pads only to
the MMA's narrow side.
"""

import triton
import triton.language as tl


@triton.jit
def linear_rows_kernel(p_x, p_w, p_b, p_out, p_part, p_sync, M, N, K, K_SLICE, stride_xm, stride_wn, stride_om,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                       SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = tl.arange(0, BM)
    o_k = tl.arange(0, BK)
    m_n = o_n < N
    m_m = o_m < M
    k0 = tl.program_id(1) * K_SLICE
    k1 = tl.minimum(k0 + K_SLICE, K)
    p_wt = p_w + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :]
    p_xt = p_x + o_m[None, :] * stride_xm + o_k[:, None]
    b_acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k in range(k0, k1, BK):
        if EVEN_K:
            b_w = tl.load(p_wt + k, mask=m_n[:, None], other=0.0)
            b_x = tl.load(p_xt + k, mask=m_m[None, :], other=0.0)
        else:
            m_k = (k + o_k) < K
            b_w = tl.load(p_wt + k, mask=m_n[:, None] & m_k[None, :], other=0.0)
            b_x = tl.load(p_xt + k, mask=m_m[None, :] & m_k[:, None], other=0.0)
        if INTERPRET:  # its bf16 dots are fp16 ones: exact fp32 products of the bf16 values
            b_acc = tl.dot(b_w.to(tl.float32), b_x.to(tl.float32), b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_w, b_x, b_acc)
    last = True
    if SPLIT > 1:
        # partials [SPLIT, N_blocks * BN, BM] fp32 (rows of padded features are never read)
        o_p = o_n[:, None].to(tl.int64) * BM + o_m[None, :]
        slab = tl.num_programs(0) * BN * BM
        m_p = m_m[None, :] & (o_n[:, None] >= 0)  # only the M rows this call has
        tl.store(p_part + tl.program_id(1) * slab + o_p, b_acc, mask=m_p)
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        ticket = tl.atomic_add(p_sync + i_n, 1, sem="acq_rel")
        last = ticket == SPLIT - 1
        if last:  # the block's last program: the others' partials are visible to it
            b_acc = tl.zeros([BN, BM], dtype=tl.float32)
            for s in range(SPLIT):  # slice order, whoever finished first
                b_acc += tl.load(p_part + s * slab + o_p, mask=m_p, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(p_sync + i_n, 0)  # zero again for the next call (and graph replay)
    if HAS_BIAS:
        b_acc += tl.load(p_b + o_n, mask=m_n, other=0.0).to(tl.float32)[:, None]
    tl.store(p_out + o_m[None, :] * stride_om + o_n[:, None], b_acc.to(p_out.dtype.element_ty),
             mask=m_n[:, None] & m_m[None, :] & last)
