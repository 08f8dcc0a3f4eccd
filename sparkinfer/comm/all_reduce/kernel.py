"""All-reduce kernels: one-shot and two-shot (reduce-scatter + all-gather).

Both push data into peers' staging lanes (writes to peers), then reduce from
local memory in rank order 0..W-1 with fp32 accumulation, so every rank holds
bitwise the same result. The two-shot kernel with GATHER=False is the
standalone reduce-scatter.

Slab staging (per epoch slot): lanes[W] (lane r written by rank r), gather region.
"""

import triton
import triton.language as tl

from sparkinfer.comm.protocol import (
    as_ptr,
    begin,
    block_range,
    copy_range,
    finish,
    signal_peers,
    stage_addr,
    wait_peers,
)


@triton.jit
def oneshot_all_reduce_kernel(
    p_x, p_out, n, table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr,
):
    """out[n] = sum over ranks of x[n]; each rank reads every peer's input locally."""
    epoch, deadline = begin(table, rank, timeout_ns, INTERP)
    lo, hi = block_range(n, BLOCK)
    for r in tl.static_range(W):
        if r != rank:
            p_lane = as_ptr(stage_addr(table, r, epoch, rank, stage_off, slot_bytes, lane_bytes), p_x)
            copy_range(p_x, p_lane, lo, hi, BLOCK)
    signal_peers(table, rank, epoch, 0, fp, W, INTERP)
    status = wait_peers(table, rank, epoch, 0, fp, deadline, OP, W, INTERP)
    if status == 0:
        for start in range(lo, hi, BLOCK):
            o = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
            m = o < hi
            acc = tl.zeros([BLOCK], tl.float32)
            for r in tl.static_range(W):
                if r == rank:
                    b = tl.load(p_x + o, mask=m)
                else:
                    p_lane = as_ptr(stage_addr(table, rank, epoch, r, stage_off, slot_bytes, lane_bytes), p_x)
                    b = tl.load(p_lane + o, mask=m)
                acc += b.to(tl.float32)
            tl.store(p_out + o, acc.to(p_out.dtype.element_ty), mask=m)
    finish(table, rank, epoch)


@triton.jit
def twoshot_all_reduce_kernel(
    p_x, p_out, n, chunk, table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr, INTERP: tl.constexpr,
):
    """Rank c owns x[c*chunk : (c+1)*chunk] (the last chunk may be short).

    Phase 0: push every chunk's share to its owner's lane[rank]; the owner reduces.
    Phase 1 (GATHER): the owner pushes its reduced chunk into every peer's gather
    region; each rank copies the other chunks out. GATHER=False is reduce-scatter:
    out[chunk] holds this rank's reduced chunk.
    """
    epoch, deadline = begin(table, rank, timeout_ns, INTERP)
    lo, hi = block_range(chunk, BLOCK)
    for c in tl.static_range(W):
        if c != rank:
            p_lane = as_ptr(stage_addr(table, c, epoch, rank, stage_off, slot_bytes, lane_bytes), p_x)
            copy_range(p_x + c * chunk, p_lane, lo, tl.minimum(hi, n - c * chunk), BLOCK)
    signal_peers(table, rank, epoch, 0, fp, W, INTERP)
    status = wait_peers(table, rank, epoch, 0, fp, deadline, OP, W, INTERP)
    if status == 0:
        mine = rank * chunk
        hi_mine = tl.minimum(hi, n - mine)
        for start in range(lo, hi_mine, BLOCK):
            o = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
            m = o < hi_mine
            acc = tl.zeros([BLOCK], tl.float32)
            for r in tl.static_range(W):
                if r == rank:
                    b = tl.load(p_x + mine + o, mask=m)
                else:
                    p_lane = as_ptr(stage_addr(table, rank, epoch, r, stage_off, slot_bytes, lane_bytes), p_x)
                    b = tl.load(p_lane + o, mask=m)
                acc += b.to(tl.float32)
            res = acc.to(p_out.dtype.element_ty)
            if GATHER:
                tl.store(p_out + mine + o, res, mask=m)
                for c in tl.static_range(W):
                    if c != rank:
                        p_g = as_ptr(stage_addr(table, c, epoch, W, stage_off, slot_bytes, lane_bytes), p_out)
                        tl.store(p_g + mine + o, res, mask=m)
            else:
                tl.store(p_out + o, res, mask=m)
        if GATHER:
            signal_peers(table, rank, epoch, 1, fp, W, INTERP)
            status = wait_peers(table, rank, epoch, 1, fp, deadline, OP, W, INTERP)
            if status == 0:
                p_g = as_ptr(stage_addr(table, rank, epoch, W, stage_off, slot_bytes, lane_bytes), p_out)
                for c in tl.static_range(W):
                    if c != rank:
                        copy_range(p_g + c * chunk, p_out + c * chunk, lo, tl.minimum(hi, n - c * chunk), BLOCK)
    finish(table, rank, epoch)
