"""All-gather kernel: out[W * n] = concat over ranks of x[n], bitwise."""

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
    p_x, p_out, n, p_table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Push x into every peer's gather region at rank * n; copy the rest out locally."""
    epoch, deadline = begin(p_table, rank, timeout_ns, INTERPRET)
    lo, hi = block_range(n, BLOCK)
    for r in tl.static_range(W):
        if r != rank:
            p_g = as_ptr(stage_addr(p_table, r, epoch, W, stage_off, slot_bytes, lane_bytes), p_x)
            copy_range(p_x, p_g + rank * n, lo, hi, BLOCK)
    copy_range(p_x, p_out + rank * n, lo, hi, BLOCK)
    signal_peers(p_table, rank, epoch, 0, fp, W, INTERPRET)
    status = wait_peers(p_table, rank, epoch, 0, fp, deadline, OP, W, INTERPRET)
    if status == 0:
        p_g = as_ptr(stage_addr(p_table, rank, epoch, W, stage_off, slot_bytes, lane_bytes), p_x)
        for r in tl.static_range(W):
            if r != rank:
                copy_range(p_g + r * n, p_out + r * n, lo, hi, BLOCK)
    finish(p_table, rank, epoch, OP, W, INTERPRET)
