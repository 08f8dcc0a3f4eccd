"""Fused all-reduce + residual add + RMSNorm kernel.

Symbols: T rows (tokens), H hidden size, W ranks, S pieces per row.

Work is cut into pieces: piece p = row * S + c covers hidden elements
[c * CH, min((c + 1) * CH, H)) of row p // S; block b owns pieces
[b * per, (b + 1) * per). ONE_PASS (S = 1, a row fits one register tile) is
the default wherever a row fits (launch.norm_config): each block owns whole
rows, keeps a row in registers and needs no other block. S > 1 splits rows so
that more blocks push at once, at the price of a cross-block exchange:

1. Every block pushes its pieces of x into lane[rank] of every peer, signals,
   and waits for the peers' flags of the same block (they pushed the same pieces).
2. Per piece: sum the W lanes in rank order (fp32), add the residual, round to
   the storage dtype -> residual_out; post the piece's sum of squares (fp32) in
   this rank's gather region, tagged like a flag.
3. Per piece: wait for the S partial sums of its row (posted by sibling blocks,
   co-resident), add them in piece order, then out = residual_out * rstd * w
   (residual_out re-read from L2).
A piece only ever reads and writes its own elements, so out = x and
residual_out = residual (in place) are safe; every rank and every block of a
row adds the same bits in the same order, so all ranks agree bitwise.

A whole row (ONE_PASS, either kernel) takes its sum of squares exactly up to one
rounding (`norm.kernel.sum_squares`): the flag and the LL kernels hold a row in
different tiles and warps, and the launcher picks between them by the tensor's
bytes, so with a tree sum a row's bits would change with the number of rows
beside it. Split rows add fp32 partials per piece (their count follows the
rows, launch.norm_config), so batch-invariant calls never split a row that fits
a tile.

The LL kernel does the same over the LL transport (ll.py) for latency-bound
sizes: pieces travel as int32 words inside int64 words carrying their flag, so
step 1 has no separate flag round trip; values are handled as (lo, hi) halves
of int32 words. Its x, residual and weight loads are issued before it spins
on the peers' words, so their latency hides under the link's instead of
following it. Its split path posts each piece's sum of squares as one LL word
(flag | fp32) in this rank's own LL lane, which no peer writes: step 3 polls
all S partials of a row with one vector load and no atomics (a partial per
load with an atomic round trip each cost more than the split saved),
readiness and sum from one reduction (ll_wait_sum). With one piece per
block (ONE_PIECE, the GPU shapes) the block runs straight-line code, keeps its
residual_out and weight tiles in registers, posts its partial into a private
128-byte line of each other block of the row, takes its own from registers,
zeroes its line once every warp has read it (a block barrier: each warp polls
its own copy of the line), and counts itself done (arrive_last) before it
waits, so that round trip overlaps the wait. Otherwise a row's partials share
one line, which the last block to finish clears (every block of the row read
them).
"""

import triton
import triton.language as tl

from sparkinfer.comm.ll import ll_clear, ll_flag, ll_pack, ll_wait_sum, ll_wait_tile, pack_out, unpack_add
from sparkinfer.comm.protocol import (
    LOW32,
    arrive_last,
    as_ptr,
    begin,
    close_epoch,
    finish,
    publish_local,
    push_to_peers,
    reduce_lanes,
    signal_peers,
    stage_addr,
    wait_local,
    wait_peers,
)
from sparkinfer.norm.kernel import sum_squares, sum_squares_2


@triton.jit
def _residual_tile(p_x, p_res, o_n, m_n, p_table, rank, epoch, stage_off, slot_bytes, lane_bytes, W: tl.constexpr):
    """residual_out values at o: round(sum over ranks of x + residual), as fp32 (masked lanes 0)."""
    acc = reduce_lanes(p_x, o_n, m_n, p_table, rank, epoch, stage_off, slot_bytes, lane_bytes, W)
    b_r = (acc + tl.load(p_res + o_n, mask=m_n, other=0.0).to(tl.float32)).to(p_res.dtype.element_ty)
    return b_r.to(tl.float32)


@triton.jit
def _out_tile(b_r, rstd, b_w, p_out, o_n, m_n):
    """out[o] = r * rstd * w (b_w: the weight at o's hidden positions, fp32)."""
    tl.store(p_out + o_n, (b_r * rstd * b_w).to(p_out.dtype.element_ty), mask=m_n)


@triton.jit(do_not_specialize=["rank"])  # same code on every rank (rank 1 would be a constant)
def all_reduce_add_rms_norm_kernel(
    p_x, p_res, p_w, p_out, p_res_out, n_rows, H, S, CH, per, eps,
    p_table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ONE_PASS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """x, residual, out, residual_out: [T, H] contiguous; weight: [H].

    residual_out = sum over ranks of x + residual;  out = rmsnorm(residual_out) * weight.
    S pieces of CH elements per row; `per` pieces per block; BLOCK_H: row tile
    (ONE_PASS), BLOCK_C: piece tile.
    """
    epoch, deadline = begin(p_table, rank, timeout_ns, INTERPRET)
    p_lo = tl.program_id(0) * per
    p_hi = tl.minimum(p_lo + per, n_rows * S)
    for piece in range(p_lo, p_hi):
        lo = (piece // S) * H + (piece % S) * CH
        push_to_peers(p_x, lo, lo + tl.minimum(CH, H - (piece % S) * CH), p_table, rank, epoch,
                      stage_off, slot_bytes, lane_bytes, W, BLOCK)
    signal_peers(p_table, rank, epoch, 0, fp, W, INTERPRET)
    status = wait_peers(p_table, rank, epoch, 0, fp, deadline, OP, W, INTERPRET)
    if status == 0:
        if ONE_PASS:
            o_h = tl.arange(0, BLOCK_H)
            m_n = o_h < H
            b_w = tl.load(p_w + o_h, mask=m_n, other=0.0).to(tl.float32)  # once for all rows of the block
            for row in range(p_lo, p_hi):
                o_n = row * H + o_h
                b_r = _residual_tile(p_x, p_res, o_n, m_n, p_table, rank, epoch, stage_off, slot_bytes, lane_bytes, W)
                tl.store(p_res_out + o_n, b_r.to(p_res_out.dtype.element_ty), mask=m_n)
                rstd = tl.math.rsqrt(sum_squares(b_r, 0) / H + eps)
                _out_tile(b_r, rstd, b_w, p_out, o_n, m_n)
        else:
            tag = (fp.to(tl.int64) << 32) | ((epoch + 1) & LOW32)
            p_post = as_ptr(stage_addr(p_table, rank, epoch, W, stage_off, slot_bytes, lane_bytes), p_table)
            o_c = tl.arange(0, BLOCK_C)
            for piece in range(p_lo, p_hi):
                c_lo = (piece // S) * H + (piece % S) * CH
                c_hi = c_lo + tl.minimum(CH, H - (piece % S) * CH)
                ss = tl.zeros([BLOCK_C], tl.float32)
                for k in range(c_lo, c_hi, BLOCK_C):
                    m_n = k + o_c < c_hi
                    b_r = _residual_tile(p_x, p_res, k + o_c, m_n, p_table, rank, epoch, stage_off, slot_bytes,
                                         lane_bytes, W)
                    tl.store(p_res_out + k + o_c, b_r.to(p_res_out.dtype.element_ty), mask=m_n)
                    ss += b_r * b_r
                publish_local(p_post + 2 * piece, tl.sum(ss, axis=0), tag, INTERPRET)
            tl.debug_barrier()
            for piece in range(p_lo, p_hi):
                row = piece // S
                total = tl.zeros([], tl.float32)
                for c in range(0, S):
                    if status == 0:
                        part, status = wait_local(p_table, rank, p_post + 2 * (row * S + c), tag, deadline, epoch,
                                                  OP, W, INTERPRET)
                        total += part
                rstd = tl.math.rsqrt(total / H + eps)
                c_lo = row * H + (piece % S) * CH
                c_hi = c_lo + tl.minimum(CH, H - (piece % S) * CH)
                for k in range(c_lo, c_hi, BLOCK_C):
                    m_n = k + o_c < c_hi
                    b_r = tl.load(p_res_out + k + o_c, mask=m_n, other=0.0).to(tl.float32)
                    b_w = tl.load(p_w + k + o_c - row * H, mask=m_n, other=0.0).to(tl.float32)
                    _out_tile(b_r, rstd, b_w, p_out, k + o_c, m_n)
    finish(p_table, rank, epoch, OP, W, INTERPRET)


@triton.jit
def _piece_words(piece, S, CH, H, EPW: tl.constexpr):
    """[lo, hi) in int32 words of piece `piece` (EPW elements per word). Rows are
    16-byte multiples and CH a multiple of 64 elements: lo is a multiple of 4."""
    e_lo = (piece // S) * H + (piece % S) * CH
    w_lo = tl.multiple_of(e_lo // EPW, 4)
    return w_lo, (e_lo + tl.minimum(CH, H - (piece % S) * CH)) // EPW


@triton.jit
def _ll_push(p_x32, w_lo, w_hi, flag, p_table, rank, epoch, ll_off, ll_slot_bytes, ll_lane_bytes,
             W: tl.constexpr, BLOCK_W: tl.constexpr):
    """Words x[w_lo:w_hi] -> LL words in lane[rank] of every peer (same word offsets)."""
    o_w = tl.arange(0, BLOCK_W)
    for k in range(w_lo, w_hi, BLOCK_W):
        o_n = tl.multiple_of(k, 4) + o_w
        m_n = o_n < w_hi
        w = ll_pack(tl.load(p_x32 + o_n, mask=m_n), flag)
        for r in tl.static_range(W):
            if r != rank:
                p_lane = as_ptr(stage_addr(p_table, r, epoch, rank, ll_off, ll_slot_bytes, ll_lane_bytes), p_table)
                tl.store(p_lane + o_n, w, mask=m_n)


@triton.jit
def _ll_residual_tile(p_x32, p_res32, o_n, m_n, flag, p_table, rank, epoch, deadline, ll_off, ll_slot_bytes,
                      ll_lane_bytes, OP: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr,
                      INTERPRET: tl.constexpr, SYNC: tl.constexpr):
    """residual_out at words o (where m) as fp32 (lo, hi) halves, and the wait status.

    Sum in rank order 0..W-1 in fp32 (this rank's x in its place), plus the
    residual, rounded to DT. x and residual are loaded before the first spin;
    every peer word is zeroed once consumed (ll.py). SYNC: the tile has fewer
    words than the block has threads, so warps hold copies of the same words and
    poll them each on their own (the readiness reduction stays inside a warp):
    a barrier keeps the zeroing until every warp has seen its copy."""
    d_x = tl.load(p_x32 + o_n, mask=m_n, other=0)
    d_res = tl.load(p_res32 + o_n, mask=m_n, other=0)
    acc_lo = tl.zeros(o_n.shape, tl.float32)
    acc_hi = tl.zeros(o_n.shape, tl.float32)
    status = tl.zeros([], tl.int32)
    for r in tl.static_range(W):
        if r == rank:
            d = d_x
        else:
            p_lane = as_ptr(stage_addr(p_table, rank, epoch, r, ll_off, ll_slot_bytes, ll_lane_bytes), p_table)
            v, st = ll_wait_tile(p_lane, o_n, m_n, flag, p_table, rank, r, epoch, deadline, OP, W, INTERPRET)
            status = tl.maximum(status, st)
            d = (v & LOW32).to(tl.int32)
            if SYNC:
                tl.debug_barrier()
            tl.store(p_lane + o_n, tl.zeros_like(v), mask=m_n)  # consumed: 0 never passes for a flag
        acc_lo, acc_hi = unpack_add(acc_lo, acc_hi, d, HALF, DT)
    acc_lo, acc_hi = unpack_add(acc_lo, acc_hi, d_res, HALF, DT)
    return acc_lo.to(DT).to(tl.float32), acc_hi.to(DT).to(tl.float32), status


@triton.jit
def _weight_halves(p_w, o_e, m_e, HALF: tl.constexpr):
    """fp32 weight of the elements held by the (lo, hi) halves of words whose low half is element o_e."""
    b_lo = tl.load(p_w + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_hi = tl.load(p_w + o_e + 1, mask=m_e & HALF, other=0.0).to(tl.float32)
    return b_lo, b_hi


@triton.jit(do_not_specialize=["rank"])  # same code on every rank (rank 1 would be a constant)
def all_reduce_add_rms_norm_ll_kernel(
    p_x, p_res, p_w, p_out, p_res_out, n_rows, H, S, CH, per, eps,
    p_table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes, ll_off, ll_slot_bytes, ll_lane_bytes,
    OP: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr, HALF: tl.constexpr, EPW: tl.constexpr,
    NP: tl.constexpr, ONE_PASS: tl.constexpr, ONE_PIECE: tl.constexpr, INTERPRET: tl.constexpr,
    SYNC: tl.constexpr = False,
):
    """all_reduce_add_rms_norm_kernel over the LL transport (same pieces, same math;
    sums of squares are taken over (lo, hi) halves). BLOCK_W: tile in int32 words
    (ONE_PASS: a whole row); HALF: 16-bit dtype (EPW = 2 elements per word), else fp32;
    NP: S rounded up to a power of two; ONE_PIECE: split rows with one piece per
    block that fits one tile; SYNC: BLOCK_W is under the block's thread count
    (_ll_residual_tile)."""
    DT: tl.constexpr = p_x.dtype.element_ty
    epoch, deadline = begin(p_table, rank, timeout_ns, INTERPRET)
    flag = ll_flag(epoch, fp)
    p_x32 = p_x.to(tl.pointer_type(tl.int32), bitcast=True)
    p_res32 = p_res.to(tl.pointer_type(tl.int32), bitcast=True)
    p_res_out32 = p_res_out.to(tl.pointer_type(tl.int32), bitcast=True)
    p_out32 = p_out.to(tl.pointer_type(tl.int32), bitcast=True)
    p_lo = tl.program_id(0) * per
    p_hi = tl.minimum(p_lo + per, n_rows * S)
    o_w = tl.arange(0, BLOCK_W)
    for piece in range(p_lo, p_hi):
        w_lo, w_hi = _piece_words(piece, S, CH, H, EPW)
        _ll_push(p_x32, w_lo, w_hi, flag, p_table, rank, epoch, ll_off, ll_slot_bytes, ll_lane_bytes, W, BLOCK_W)
    status = tl.zeros([], tl.int32)
    if ONE_PASS:  # a piece is a row; no other block is involved
        m_n = o_w < H // EPW
        b_wlo, b_whi = _weight_halves(p_w, o_w * EPW, m_n, HALF)
        for row in range(p_lo, p_hi):
            w_lo, w_hi = _piece_words(row, 1, H, H, EPW)
            o_n = w_lo + o_w
            r_lo, r_hi, st = _ll_residual_tile(p_x32, p_res32, o_n, m_n, flag, p_table, rank, epoch, deadline, ll_off,
                                               ll_slot_bytes, ll_lane_bytes, OP, W, HALF, DT, INTERPRET, SYNC)
            status = tl.maximum(status, st)
            rstd = tl.math.rsqrt(sum_squares_2(r_lo, r_hi) / H + eps)
            if status == 0:
                tl.store(p_res_out32 + o_n, pack_out(r_lo, r_hi, HALF, DT), mask=m_n)
                tl.store(p_out32 + o_n, pack_out(r_lo * rstd * b_wlo, r_hi * rstd * b_whi, HALF, DT), mask=m_n)
        finish(p_table, rank, epoch, OP, W, INTERPRET)
    else:
        # Partial sums travel as LL words (flag | fp32) in this rank's own lane of
        # the LL region, which no peer writes: one vector load polls all S of a
        # row, no atomics. Cleared by their reader (ONE_PIECE: a line per block)
        # or by the last block (otherwise: a line per row, read by many).
        p_part = as_ptr(stage_addr(p_table, rank, epoch, rank, ll_off, ll_slot_bytes, ll_lane_bytes), p_table)
        NPAD: tl.constexpr = NP if NP > 16 else 16  # words per line of partials (>= 128 bytes)
        if ONE_PIECE:  # the GPU shapes: piece = program id in one tile, kept in registers throughout
            piece = p_lo
            row = piece // S
            c = piece % S
            w_lo, w_hi = _piece_words(piece, S, CH, H, EPW)
            o_n = w_lo + o_w
            m_n = o_n < w_hi
            b_lo, b_hi = _weight_halves(p_w, o_n * EPW - row * H, m_n, HALF)  # issued before the spin
            r_lo, r_hi, status = _ll_residual_tile(p_x32, p_res32, o_n, m_n, flag, p_table, rank, epoch, deadline,
                                                   ll_off, ll_slot_bytes, ll_lane_bytes, OP, W, HALF, DT, INTERPRET,
                                                   SYNC)
            ss = tl.sum(r_lo * r_lo + r_hi * r_hi, axis=0)
            o_p = tl.arange(0, NP)
            others = (o_p < S) & (o_p != c)
            if status == 0:
                tl.store(p_res_out32 + o_n, pack_out(r_lo, r_hi, HALF, DT), mask=m_n)
                # the partial goes to the private line of every other block of the row
                # (block j's line: words (row * S + j) * NPAD + [0, S)); its own stays in registers
                word = ll_pack(ss.to(tl.int32, bitcast=True), flag) + tl.zeros([NP], tl.int64)
                tl.store(p_part + (row * S + o_p) * NPAD + c, word, mask=others)
            # Arrive now: the counter's round trip overlaps the wait below, and the last
            # block has nothing to clear (each block zeroes its own line once read).
            if arrive_last(p_table, rank):
                close_epoch(p_table, rank, epoch, OP, W, INTERPRET)
            if status == 0:
                p_line = p_part + (row * S + c) * NPAD
                total, status = ll_wait_sum(p_line, 0, S, c, ss, flag, p_table, rank, epoch, deadline, OP, W, NP,
                                            INTERPRET)
                # The NP words are copied in every warp and each warp polls its copies on its
                # own (ll_wait_sum's reduction stays inside a warp): zeroing the line as soon
                # as the first warp is done could hide a word from a warp yet to see it, which
                # would then wait out the deadline and leave its part of `out` unwritten.
                tl.debug_barrier()
                tl.store(p_line + o_p, tl.zeros([NP], tl.int64), mask=others)  # consumed
                rstd = tl.math.rsqrt(total / H + eps)
                if status == 0:
                    tl.store(p_out32 + o_n, pack_out(r_lo * rstd * b_lo, r_hi * rstd * b_hi, HALF, DT), mask=m_n)
        else:
            for piece in range(p_lo, p_hi):
                w_lo, w_hi = _piece_words(piece, S, CH, H, EPW)
                ss = tl.zeros([BLOCK_W], tl.float32)
                for k in range(w_lo, w_hi, BLOCK_W):
                    o_n = tl.multiple_of(k, 4) + o_w
                    m_n = o_n < w_hi
                    r_lo, r_hi, st = _ll_residual_tile(p_x32, p_res32, o_n, m_n, flag, p_table, rank, epoch, deadline,
                                                       ll_off, ll_slot_bytes, ll_lane_bytes, OP, W, HALF, DT, INTERPRET,
                                                       SYNC)
                    status = tl.maximum(status, st)
                    if status == 0:
                        tl.store(p_res_out32 + o_n, pack_out(r_lo, r_hi, HALF, DT), mask=m_n)
                    ss += r_lo * r_lo + r_hi * r_hi
                if status == 0:
                    tl.store(p_part + (piece // S) * NPAD + piece % S,
                             ll_pack(tl.sum(ss, axis=0).to(tl.int32, bitcast=True), flag))
            for piece in range(p_lo, p_hi):
                row = piece // S
                if status == 0:
                    total, status = ll_wait_sum(p_part, row * NPAD, S, -1, 0.0, flag, p_table, rank, epoch, deadline,
                                                OP, W, NP, INTERPRET)
                    rstd = tl.math.rsqrt(total / H + eps)
                    w_lo, w_hi = _piece_words(piece, S, CH, H, EPW)
                    for k in range(w_lo, w_hi, BLOCK_W):
                        o_n = tl.multiple_of(k, 4) + o_w
                        m_n = o_n < w_hi
                        zero = tl.zeros([BLOCK_W], tl.float32)
                        r_lo, r_hi = unpack_add(zero, zero, tl.load(p_res_out32 + o_n, mask=m_n, other=0), HALF, DT)
                        b_lo, b_hi = _weight_halves(p_w, o_n * EPW - row * H, m_n, HALF)
                        if status == 0:
                            b_out = pack_out(r_lo * rstd * b_lo, r_hi * rstd * b_hi, HALF, DT)
                            tl.store(p_out32 + o_n, b_out, mask=m_n)
            if arrive_last(p_table, rank):
                ll_clear(p_part, n_rows * NPAD, 256)
                close_epoch(p_table, rank, epoch, OP, W, INTERPRET)
