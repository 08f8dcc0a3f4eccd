"""Fused all-reduce + residual add + RMSNorm kernel.

Symbols: T rows (tokens), H hidden size, W ranks.

One-shot shape: every block owns whole rows. It pushes its rows of x into
lane[rank] of every peer, signals, waits for the peers' rows, then per row sums
the W copies in rank order (fp32), adds the residual, rounds to the storage
dtype (residual_out), and normalizes that rounded row. Every rank runs the same
arithmetic on the same bits, so every rank holds bitwise the same outputs.

A row that fits one tile (NUM_TILES == 1) stays in registers: one pass over
HBM. A longer row takes two passes: the first writes residual_out and sums the
squares, the second re-reads this block's own residual_out row (just written,
still in L2) and writes out.
"""

import triton
import triton.language as tl

from sparkinfer.comm.protocol import begin, block_range, finish, push_to_peers, reduce_lanes, signal_peers, wait_peers


@triton.jit
def _residual_tile(p_x, p_res, p_res_out, o, m, table, rank, epoch, stage_off, slot_bytes, lane_bytes,
                   W: tl.constexpr):
    """residual_out[o] = round(sum over ranks of x[o] + residual[o]); returns it as fp32."""
    acc = reduce_lanes(p_x, o, m, table, rank, epoch, stage_off, slot_bytes, lane_bytes, W)
    b_r = (acc + tl.load(p_res + o, mask=m, other=0.0).to(tl.float32)).to(p_res_out.dtype.element_ty)
    tl.store(p_res_out + o, b_r, mask=m)
    return b_r.to(tl.float32)


@triton.jit
def _norm_tile(b_r, rstd, p_w, p_out, o_h, o, m):
    """out[o] = r * rstd * weight[o_h]."""
    b_w = tl.load(p_w + o_h, mask=m, other=0.0).to(tl.float32)
    tl.store(p_out + o, (b_r * rstd * b_w).to(p_out.dtype.element_ty), mask=m)


@triton.jit
def all_reduce_add_rms_norm_kernel(
    p_x, p_res, p_w, p_out, p_res_out, n_rows, H, eps,
    table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
    NUM_TILES: tl.constexpr, INTERP: tl.constexpr,
):
    """x, residual, out, residual_out: [T, H] contiguous; weight: [H].

    residual_out = sum over ranks of x + residual;  out = rmsnorm(residual_out) * weight.
    """
    epoch, deadline = begin(table, rank, timeout_ns, INTERP)
    row_lo, row_hi = block_range(n_rows, 1)
    push_to_peers(p_x, row_lo * H, row_hi * H, table, rank, epoch, stage_off, slot_bytes, lane_bytes, W, BLOCK)
    signal_peers(table, rank, epoch, 0, fp, W, INTERP)
    status = wait_peers(table, rank, epoch, 0, fp, deadline, OP, W, INTERP)
    if status == 0:
        o_h = tl.arange(0, BLOCK_H)
        for row in range(row_lo, row_hi):
            base = row * H
            if NUM_TILES == 1:
                m = o_h < H
                b_r = _residual_tile(p_x, p_res, p_res_out, base + o_h, m, table, rank, epoch,
                                     stage_off, slot_bytes, lane_bytes, W)
                rstd = tl.math.rsqrt(tl.sum(b_r * b_r, axis=0) / H + eps)
                _norm_tile(b_r, rstd, p_w, p_out, o_h, base + o_h, m)
            else:
                ss = tl.zeros([BLOCK_H], tl.float32)
                for k in tl.static_range(NUM_TILES):
                    m = k * BLOCK_H + o_h < H
                    b_r = _residual_tile(p_x, p_res, p_res_out, base + k * BLOCK_H + o_h, m, table, rank, epoch,
                                         stage_off, slot_bytes, lane_bytes, W)
                    ss += b_r * b_r
                rstd = tl.math.rsqrt(tl.sum(ss, axis=0) / H + eps)
                for k in tl.static_range(NUM_TILES):
                    o = base + k * BLOCK_H + o_h
                    m = k * BLOCK_H + o_h < H
                    b_r = tl.load(p_res_out + o, mask=m, other=0.0).to(tl.float32)
                    _norm_tile(b_r, rstd, p_w, p_out, k * BLOCK_H + o_h, o, m)
    finish(table, rank, epoch)
