"""All-reduce kernels: one-shot and two-shot (reduce-scatter + all-gather).

Both push data into peers' staging lanes (writes to peers), then reduce from
local memory in rank order 0..W-1 with fp32 accumulation, so every rank holds
bitwise the same result. The two-shot kernel with GATHER=False is the
standalone reduce-scatter.

Slab staging (per epoch slot): lanes[W] (lane r written by rank r), gather region.
"""

import triton
import triton.language as tl

from sparkinfer.comm.ll import ll_flag, ll_pack, ll_wait_tile, pack_out, unpack_add
from sparkinfer.comm.protocol import (
    as_ptr,
    begin,
    block_range,
    copy_range,
    finish,
    push_to_peers,
    reduce_lanes,
    signal_peers,
    stage_addr,
    wait_peers,
)


@triton.jit
def sub_range(lo, hi, s, PIPE: tl.constexpr, BLOCK: tl.constexpr):
    """Piece s of PIPE pieces of [lo, hi), in whole BLOCKs (may be empty)."""
    step = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), PIPE), BLOCK) * BLOCK
    s_lo = lo + s * step
    return s_lo, tl.minimum(s_lo + step, hi)


@triton.jit(do_not_specialize=["rank"])  # same code on every rank (rank 1 would be a constant)
def oneshot_all_reduce_kernel(
    p_x, p_out, n, p_table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, PIPE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """out[n] = sum over ranks of x[n]; each rank reduces every peer's pushed input locally.

    PIPE pieces per block, each with its own flag phase: piece s is pushed and
    signalled before piece s + 1 is pushed, so reducing early pieces overlaps
    the transfer of later ones."""
    epoch, deadline = begin(p_table, rank, timeout_ns, INTERPRET)
    lo, hi = block_range(n, BLOCK)
    for s in tl.static_range(PIPE):
        s_lo, s_hi = sub_range(lo, hi, s, PIPE, BLOCK)
        push_to_peers(p_x, s_lo, s_hi, p_table, rank, epoch, stage_off, slot_bytes, lane_bytes, W, BLOCK)
        signal_peers(p_table, rank, epoch, s, fp, W, INTERPRET)
    status = tl.zeros([], tl.int32)
    for s in tl.static_range(PIPE):
        if status == 0:
            status = wait_peers(p_table, rank, epoch, s, fp, deadline, OP, W, INTERPRET)
        if status == 0:
            s_lo, s_hi = sub_range(lo, hi, s, PIPE, BLOCK)
            for start in range(s_lo, s_hi, BLOCK):
                o_n = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
                m_n = o_n < s_hi
                acc = reduce_lanes(p_x, o_n, m_n, p_table, rank, epoch, stage_off, slot_bytes, lane_bytes, W)
                tl.store(p_out + o_n, acc.to(p_out.dtype.element_ty), mask=m_n)
    finish(p_table, rank, epoch, OP, W, INTERPRET)


@triton.jit(do_not_specialize=["rank"])  # same code on every rank (rank 1 would be a constant)
def twoshot_all_reduce_kernel(
    p_x, p_out, n, chunk, p_table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr, PIPE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Rank c owns x[c*chunk : (c+1)*chunk] (the last chunk may be short).

    Reduce-scatter (flag phases 0..PIPE-1): push every chunk's share to its
    owner's lane[rank]; the owner reduces. All-gather (GATHER, phases
    PIPE..2*PIPE-1): the owner pushes its reduced chunk into every peer's gather
    region; each rank copies the other chunks out. Each block's share is cut into
    PIPE pieces so one piece's reduction overlaps the next piece's transfer.
    GATHER=False is reduce-scatter: out[chunk] holds this rank's reduced chunk.
    """
    epoch, deadline = begin(p_table, rank, timeout_ns, INTERPRET)
    lo, hi = block_range(chunk, BLOCK)
    for s in tl.static_range(PIPE):
        s_lo, s_hi = sub_range(lo, hi, s, PIPE, BLOCK)
        for c in tl.static_range(W):
            if c != rank:
                p_lane = as_ptr(stage_addr(p_table, c, epoch, rank, stage_off, slot_bytes, lane_bytes), p_x)
                copy_range(p_x + c * chunk, p_lane, s_lo, tl.minimum(s_hi, n - c * chunk), BLOCK)
        signal_peers(p_table, rank, epoch, s, fp, W, INTERPRET)
    mine = rank * chunk
    status = tl.zeros([], tl.int32)
    for s in tl.static_range(PIPE):
        if status == 0:
            status = wait_peers(p_table, rank, epoch, s, fp, deadline, OP, W, INTERPRET)
        if status == 0:
            s_lo, s_hi = sub_range(lo, hi, s, PIPE, BLOCK)
            hi_mine = tl.minimum(s_hi, n - mine)
            for start in range(s_lo, hi_mine, BLOCK):
                o_n = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
                m_n = o_n < hi_mine
                res = reduce_lanes(p_x + mine, o_n, m_n, p_table, rank, epoch, stage_off, slot_bytes, lane_bytes,
                                   W).to(p_out.dtype.element_ty)
                if GATHER:
                    tl.store(p_out + mine + o_n, res, mask=m_n)
                    for c in tl.static_range(W):
                        if c != rank:
                            p_g = as_ptr(stage_addr(p_table, c, epoch, W, stage_off, slot_bytes, lane_bytes), p_out)
                            tl.store(p_g + mine + o_n, res, mask=m_n)
                else:
                    tl.store(p_out + o_n, res, mask=m_n)
            if GATHER:
                signal_peers(p_table, rank, epoch, PIPE + s, fp, W, INTERPRET)
    if GATHER:
        p_g = as_ptr(stage_addr(p_table, rank, epoch, W, stage_off, slot_bytes, lane_bytes), p_out)
        for s in tl.static_range(PIPE):
            if status == 0:
                status = wait_peers(p_table, rank, epoch, PIPE + s, fp, deadline, OP, W, INTERPRET)
            if status == 0:
                s_lo, s_hi = sub_range(lo, hi, s, PIPE, BLOCK)
                for c in tl.static_range(W):
                    if c != rank:
                        copy_range(p_g + c * chunk, p_out + c * chunk, s_lo, tl.minimum(s_hi, n - c * chunk), BLOCK)
    finish(p_table, rank, epoch, OP, W, INTERPRET)


@triton.jit(do_not_specialize=["rank"])  # same code on every rank (rank 1 would be a constant)
def oneshot_ll_all_reduce_kernel(
    p_x, p_out, nwords, p_table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One-shot all-reduce over the LL transport, for latency-bound sizes.

    x is moved as int32 words (nwords = bytes / 4); each travels to every peer
    inside an int64 word with its flag, so there is no separate flag round trip.
    stage_off/slot_bytes/lane_bytes here describe the LL region (ll_channel_args).
    Reduction in rank order with fp32 accumulation, as in the plain one-shot."""
    DT: tl.constexpr = p_x.dtype.element_ty
    epoch, deadline = begin(p_table, rank, timeout_ns, INTERPRET)
    flag = ll_flag(epoch, fp)
    p_x32 = p_x.to(tl.pointer_type(tl.int32), bitcast=True)
    p_out32 = p_out.to(tl.pointer_type(tl.int32), bitcast=True)
    lo, hi = block_range(nwords, BLOCK)
    for start in range(lo, hi, BLOCK):
        o_n = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        m_n = o_n < hi
        w = ll_pack(tl.load(p_x32 + o_n, mask=m_n), flag)
        for r in tl.static_range(W):
            if r != rank:
                p_lane = as_ptr(stage_addr(p_table, r, epoch, rank, stage_off, slot_bytes, lane_bytes), p_table)
                tl.store(p_lane + o_n, w, mask=m_n)
    status = tl.zeros([], tl.int32)
    for start in range(lo, hi, BLOCK):
        o_n = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        m_n = o_n < hi
        acc_lo = tl.zeros([BLOCK], tl.float32)
        acc_hi = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(W):
            if r == rank:
                d = tl.load(p_x32 + o_n, mask=m_n, other=0)
            else:
                p_lane = as_ptr(stage_addr(p_table, rank, epoch, r, stage_off, slot_bytes, lane_bytes), p_table)
                v, st = ll_wait_tile(p_lane, o_n, m_n, flag, p_table, rank, r, epoch, deadline, OP, W, INTERPRET)
                status = tl.maximum(status, st)
                d = (v & 0xFFFFFFFF).to(tl.int32)
                tl.store(p_lane + o_n, tl.zeros_like(v), mask=m_n)  # consumed: 0 can never pass for a flag
            acc_lo, acc_hi = unpack_add(acc_lo, acc_hi, d, HALF, DT)
        if status == 0:
            tl.store(p_out32 + o_n, pack_out(acc_lo, acc_hi, HALF, DT), mask=m_n)
    finish(p_table, rank, epoch, OP, W, INTERPRET)
