"""Decode-context-parallel kernels: the log-sum-exp merge and the head gather.

Symbols: T tokens, H heads, D head dim, W ranks, Hs heads per result
(H / W when scattering over heads, else H). A "row" is one (token, head) pair:
D contiguous elements; rows are numbered i = t * Hs + h_local.

Both kernels stage rows packed: rank r writes into lane[r] of a peer, rows i
in order ([rows, D] of o's dtype), then for the merge the rows' lse (fp32) at
byte `lse_off`. Inputs may be strided (token-major or head-major); only the
D axis must be contiguous. Block b of every rank handles the same row range,
so its flags cover exactly the rows it reads.
"""

import triton
import triton.language as tl

from sparkinfer.comm.protocol import as_ptr, begin, block_range, finish, signal_peers, stage_addr, wait_peers


@triton.jit
def _copy_rows(p_src, stride_st, stride_sh, h0_src, p_dst, stride_dt, stride_dh, h0_dst, lo, hi, Hs, D,
               R: tl.constexpr, BLOCK_D: tl.constexpr):
    """dst[t, h0_dst + hl, :D] = src[t, h0_src + hl, :D] for rows i = t * Hs + hl in [lo, hi)."""
    o_d = tl.arange(0, BLOCK_D)
    for start in range(lo, hi, R):
        o_i = start + tl.arange(0, R)
        t = o_i // Hs
        hl = o_i % Hs
        m_id = (o_i < hi)[:, None] & (o_d < D)[None, :]
        p_s = p_src + (t * stride_st + (h0_src + hl) * stride_sh)[:, None] + o_d[None, :]
        p_d = p_dst + (t * stride_dt + (h0_dst + hl) * stride_dh)[:, None] + o_d[None, :]
        tl.store(p_d, tl.load(p_s, mask=m_id), mask=m_id)


@triton.jit
def _source(r, rank, o_i, o_d, t, h, p_o, stride_ot, stride_oh, p_lse, stride_lt, stride_lh, a_lane, lse_off, D):
    """Pointers to rank r's rows [R, BLOCK_D] and lse [R]: own input or staging lane."""
    if r == rank:
        p_rows = p_o + (t * stride_ot + h * stride_oh)[:, None] + o_d[None, :]
        p_l = p_lse + t * stride_lt + h * stride_lh
    else:
        p_rows = as_ptr(a_lane, p_o) + (o_i * D)[:, None] + o_d[None, :]
        p_l = as_ptr(a_lane + lse_off, p_lse) + o_i
    return p_rows, p_l


@triton.jit
def _merge_rows(p_o, stride_ot, stride_oh, p_lse, stride_lt, stride_lh, h0, p_out, stride_ut, stride_uh,
                p_lse_out, lo, hi, Hs, D, p_table, rank, epoch, stage_off, slot_bytes, lane_bytes, lse_off,
                W: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, BASE2: tl.constexpr,
                RETURN_LSE: tl.constexpr):
    """out = sum_r exp(lse_r - max) o_r / sum_r exp(lse_r - max), in rank order.

    A shard with lse = -inf (empty) is selected out, its o (possibly NaN) never
    multiplied; every other shard's o is multiplied even where its weight
    underflows to 0, so a NaN or inf in it reaches the row as 0 * NaN = NaN (as
    in attention over the whole sequence; a select on the weight dropped it).
    Rows where every shard is empty give o = 0 and lse = -inf; a +inf lse on
    any shard gives o = NaN, lse = +inf (softmax with a +inf score is NaN, its
    logsumexp +inf; the weights exp(lse - max) were inf - inf = NaN and the row
    came out as zeros); a NaN lse on any shard makes o and lse NaN."""
    o_d = tl.arange(0, BLOCK_D)
    for start in range(lo, hi, R):
        o_i = start + tl.arange(0, R)
        m_i = o_i < hi
        m_id = m_i[:, None] & (o_d < D)[None, :]
        t = o_i // Hs
        h = h0 + o_i % Hs
        b_max = tl.full([R], float("-inf"), tl.float32)
        b_nan = tl.zeros([R], tl.int32)  # rows with a NaN lse on some shard: NaN out (as the reference)
        b_inf = tl.zeros([R], tl.int32)  # rows with a +inf lse on some shard: NaN out, +inf lse
        for r in tl.static_range(W):
            a_lane = stage_addr(p_table, rank, epoch, r, stage_off, slot_bytes, lane_bytes)
            p_rows, p_l = _source(r, rank, o_i, o_d, t, h, p_o, stride_ot, stride_oh, p_lse, stride_lt, stride_lh,
                                  a_lane, lse_off, D)
            b_l = tl.load(p_l, mask=m_i, other=float("-inf"))
            b_nan = b_nan | (b_l != b_l).to(tl.int32)
            b_inf = b_inf | (b_l == float("inf")).to(tl.int32)
            b_max = tl.maximum(b_max, tl.where(b_l != b_l, float("-inf"), b_l))
        # a finite reference: rows with a +inf lse are overwritten below, their weights need not mean anything
        b_ref = tl.where((b_max == float("-inf")) | (b_max == float("inf")), 0.0, b_max)
        acc = tl.zeros([R, BLOCK_D], tl.float32)
        den = tl.zeros([R], tl.float32)
        for r in tl.static_range(W):
            a_lane = stage_addr(p_table, rank, epoch, r, stage_off, slot_bytes, lane_bytes)
            p_rows, p_l = _source(r, rank, o_i, o_d, t, h, p_o, stride_ot, stride_oh, p_lse, stride_lt, stride_lh,
                                  a_lane, lse_off, D)
            b_l = tl.load(p_l, mask=m_i, other=float("-inf"))
            if BASE2:
                b_w = tl.exp2(b_l - b_ref)
            else:
                b_w = tl.exp(b_l - b_ref)
            b_o = tl.load(p_rows, mask=m_id, other=0.0).to(tl.float32)
            acc += tl.where((b_l != float("-inf"))[:, None], b_o * b_w[:, None], 0.0)
            den += b_w
        full = den > 0.0
        b_out = acc / tl.where(full, den, 1.0)[:, None]
        b_out = tl.where((b_nan | b_inf)[:, None] != 0, float("nan"), b_out)
        p_dst = p_out + (t * stride_ut + (o_i % Hs) * stride_uh)[:, None] + o_d[None, :]
        tl.store(p_dst, b_out.to(p_out.dtype.element_ty), mask=m_id)
        if RETURN_LSE:
            if BASE2:
                b_lse = b_max + tl.log2(tl.where(full, den, 1.0))
            else:
                b_lse = b_max + tl.log(tl.where(full, den, 1.0))
            b_lse = tl.where(full, b_lse, float("-inf"))
            b_lse = tl.where(b_inf != 0, float("inf"), b_lse)
            tl.store(p_lse_out + o_i, tl.where(b_nan != 0, float("nan"), b_lse), mask=m_i)


@triton.jit(do_not_specialize=["rank"])  # same code on every rank (rank 1 would be a constant)
def dcp_merge_kernel(
    p_o, stride_ot, stride_oh, p_lse, stride_lt, stride_lh, p_out, stride_ut, stride_uh, p_lse_out, n_rows, Hs, D,
    lse_off,
    p_table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, SCATTER: tl.constexpr,
    BASE2: tl.constexpr, RETURN_LSE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """o: [T, H, D] (strides stride_ot, stride_oh, 1); lse: [T, H] fp32 (strides
    stride_lt, stride_lh). out: [T, Hs, D] (strides stride_ut, stride_uh, 1); lse_out: [T, Hs] fp32 contiguous;
    n_rows = T * Hs. SCATTER: rank c merges heads [c * Hs, (c + 1) * Hs), and
    peers send it only those rows; else every rank receives and merges all."""
    epoch, deadline = begin(p_table, rank, timeout_ns, INTERPRET)
    lo, hi = block_range(n_rows, R)
    for c in tl.static_range(W):
        if c != rank:
            a_lane = stage_addr(p_table, c, epoch, rank, stage_off, slot_bytes, lane_bytes)
            if SCATTER:
                h0 = c * Hs
            else:
                h0 = 0
            _copy_rows(p_o, stride_ot, stride_oh, h0, as_ptr(a_lane, p_o), Hs * D, D, 0, lo, hi, Hs, D, R, BLOCK_D)
            _copy_rows(p_lse, stride_lt, stride_lh, h0, as_ptr(a_lane + lse_off, p_lse), Hs, 1, 0, lo, hi, Hs, 1, R, 1)
    signal_peers(p_table, rank, epoch, 0, fp, W, INTERPRET)
    status = wait_peers(p_table, rank, epoch, 0, fp, deadline, OP, W, INTERPRET)
    if status == 0:
        if SCATTER:
            h0 = rank * Hs
        else:
            h0 = 0
        _merge_rows(p_o, stride_ot, stride_oh, p_lse, stride_lt, stride_lh, h0, p_out, stride_ut, stride_uh,
                    p_lse_out, lo, hi, Hs, D,
                    p_table, rank, epoch, stage_off, slot_bytes, lane_bytes, lse_off, W, R, BLOCK_D, BASE2, RETURN_LSE)
    finish(p_table, rank, epoch, OP, W, INTERPRET)


@triton.jit(do_not_specialize=["rank"])  # same code on every rank (rank 1 would be a constant)
def all_gather_heads_kernel(
    p_x, stride_xt, stride_xh, p_out, stride_ut, stride_uh, n_rows, Hs, D,
    p_table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    """x: [T, Hs, D] (strides stride_xt, stride_xh, 1) -> out: [T, W * Hs, D] (strides
    stride_ut, stride_uh, 1),
    rank r's heads at [r * Hs, (r + 1) * Hs), bitwise copies; n_rows = T * Hs."""
    epoch, deadline = begin(p_table, rank, timeout_ns, INTERPRET)
    lo, hi = block_range(n_rows, R)
    for c in tl.static_range(W):
        if c != rank:
            a_lane = stage_addr(p_table, c, epoch, rank, stage_off, slot_bytes, lane_bytes)
            _copy_rows(p_x, stride_xt, stride_xh, 0, as_ptr(a_lane, p_x), Hs * D, D, 0, lo, hi, Hs, D, R, BLOCK_D)
    _copy_rows(p_x, stride_xt, stride_xh, 0, p_out, stride_ut, stride_uh, rank * Hs, lo, hi, Hs, D, R, BLOCK_D)
    signal_peers(p_table, rank, epoch, 0, fp, W, INTERPRET)
    status = wait_peers(p_table, rank, epoch, 0, fp, deadline, OP, W, INTERPRET)
    if status == 0:
        for r in tl.static_range(W):
            if r != rank:
                a_lane = stage_addr(p_table, rank, epoch, r, stage_off, slot_bytes, lane_bytes)
                _copy_rows(as_ptr(a_lane, p_x), Hs * D, D, 0, p_out, stride_ut, stride_uh, r * Hs, lo, hi, Hs, D, R,
                           BLOCK_D)
    finish(p_table, rank, epoch, OP, W, INTERPRET)
