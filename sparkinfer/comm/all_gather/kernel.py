"""All-gather kernel: out[W * m] = concat over ranks of x[m], bitwise."""

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


@triton.jit(do_not_specialize=["rank"])  # same code on every rank (rank 1 would be a constant)
def all_gather_kernel(
    p_x, p_out, m, table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr,
):
    """Push x into every peer's gather region at rank * m; copy the rest out locally."""
    epoch, deadline = begin(table, rank, timeout_ns, INTERP)
    lo, hi = block_range(m, BLOCK)
    for r in tl.static_range(W):
        if r != rank:
            p_g = as_ptr(stage_addr(table, r, epoch, W, stage_off, slot_bytes, lane_bytes), p_x)
            copy_range(p_x, p_g + rank * m, lo, hi, BLOCK)
    copy_range(p_x, p_out + rank * m, lo, hi, BLOCK)
    signal_peers(table, rank, epoch, 0, fp, W, INTERP)
    status = wait_peers(table, rank, epoch, 0, fp, deadline, OP, W, INTERP)
    if status == 0:
        p_g = as_ptr(stage_addr(table, rank, epoch, W, stage_off, slot_bytes, lane_bytes), p_x)
        for r in tl.static_range(W):
            if r != rank:
                copy_range(p_g + r * m, p_out + r * m, lo, hi, BLOCK)
    finish(table, rank, epoch)
