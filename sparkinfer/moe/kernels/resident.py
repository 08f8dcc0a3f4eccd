"""`resident`: the whole micro layer (FC1, activation, FC2, weighted top-k sum)
in one persistent kernel, launched cooperatively (every program resident).

Legend: T tokens, K top-k, E experts, H hidden, I intermediate, R = T*K route
slots, NB1 = cdiv(I, BN1), NB2 = cdiv(H, BN2), S1 / S2 split counts, G programs.

Work items are the `micro` family's programs, taken in order by the G
programs (item i by program i % G), FC1's before FC2's:
- FC1 item (r, n, s) (slot-major): `fc1_tile` of the expert slot r owns
  (`micro_rows`). Unsplit (S1 == 1) it stores the bf16 activation rows; split,
  fp32 partials, and the last of the S1 items of (r, n) to arrive (counter
  `rn[r, n]`) sums them in split order and stores the activation (`act_tile`,
  the bits `moe_act_kernel` makes). Either way the tile that completes (r, n)
  adds one to `ready[r]`.
- FC2 item (r, n, s): waits until `ready[r]` == NB1 (slot r's activation rows
  are complete), then `fc2_tile` into fp32 partials. Every FC2 item, owner or
  not, adds one to `cols[n]`; the last of the R * S2 items of column block n
  makes out[:, block n] for every token (`reduce_row`: the micro reduce, same
  order, same bits).
- The last program to finish (`done`) zeroes `ready` and `done`; `rn` and
  `cols` are zeroed by their last arrivals. The counters are zero again when
  the kernel ends, so replays and later calls start clean.

No atomic touches data; the counters only order it (acq_rel, GPU scope), so
the result is bitwise that of the `micro` family with the same tiles and
splits, and repeats bitwise. Every wait is bounded (timeout_ns of GPU time);
a program that gives up records (code 1, slot + 1) in ctl[1:3] and skips the
item, and `sparkinfer.moe.resident_status` reports it.

Deadlock freedom: a program finishes all its FC1 items before its first wait,
and a cooperative launch makes every program resident, so each awaited item
is done by a running program. Under the interpreter (programs run one after
another) the runner launches one program.

PREFETCH: 0, none; 1, each FC2 item's weights are prefetched into L2
(cp.async.bulk.prefetch) before its wait; 2, all of the program's FC2
weights are prefetched when the program starts.
"""

import triton
import triton.language as tl
from triton.language.extra import cuda as tlcuda

from sparkinfer.moe.kernels.common import TILE_ROWS, micro_rows, split_chunks
from sparkinfer.moe.kernels.fc1 import fc1_tile
from sparkinfer.moe.kernels.fc2 import act_tile, fc2_tile
from sparkinfer.moe.kernels.reduce import reduce_row


@triton.jit
def _now(INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.full([], 0, tl.int64)
    else:
        return tlcuda.globaltimer().to(tl.int64)


@triton.jit
def _ld_acquire(p, INTERPRET: tl.constexpr):
    """int32 load with acquire semantics at GPU scope."""
    if INTERPRET:
        return tl.atomic_add(p, 0, sem="acquire", scope="gpu")
    else:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [p],
                                         dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _signal(p):
    """Add one to counter p once every thread's earlier stores are done (release)."""
    tl.debug_barrier()
    tl.atomic_add(p, 1, sem="release", scope="gpu")


@triton.jit
def _arrive(p):
    """Add one to counter p (acq_rel) after this program's stores; returns the old count."""
    tl.debug_barrier()
    return tl.atomic_add(p, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _wait_ready(p, target, deadline, ctl_ptr, slot, INTERPRET: tl.constexpr):
    """Spin until *p >= target; past the deadline (under the interpreter, after
    32 polls) record the error and give up. Returns whether the count was reached."""
    v = _ld_acquire(p, INTERPRET)
    waiting = v < target
    polls = 0
    while waiting:
        v = _ld_acquire(p, INTERPRET)
        waiting = v < target
        polls += 1
        if waiting & (polls % 32 == 0):
            late = _now(INTERPRET) > deadline
            if INTERPRET:
                late = True
            if late:
                tl.atomic_cas(ctl_ptr + 1, 0, 1, sem="relaxed", scope="gpu")
                tl.atomic_cas(ctl_ptr + 2, 0, slot + 1, sem="relaxed", scope="gpu")
                waiting = False
    tl.debug_barrier()
    return v >= target


@triton.jit
def prefetch_l2(ptrs, nbytes):
    """cp.async.bulk.prefetch.L2 of nbytes (a multiple of 16) at each of ptrs
    (16-byte aligned). GPU only."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                              [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_weights(p_w, p_s, i_n, c_lo, c_hi, num_chunks, stride_wn, H, BN: tl.constexpr,
                     BK: tl.constexpr, NVFP4: tl.constexpr):
    """L2 prefetch of the weights (and NVFP4 scales) of FC2 rows i_n*BN.. over
    chunks [c_lo, c_hi): NVFP4, one contiguous run per TILE_ROWS-row tile
    (`tile_slices`); bf16, one run per row."""
    n_c = c_hi - c_lo
    if NVFP4:
        rb = (i_n * BN) // TILE_ROWS + tl.arange(0, BN // TILE_ROWS)
        ok = rb * TILE_ROWS < H
        first = tl.where(ok, rb * num_chunks + c_lo, 0)
        prefetch_l2(p_w + first * (TILE_ROWS * BK // 2), tl.where(ok, n_c * (TILE_ROWS * BK // 2), 16))
        prefetch_l2(p_s + first * (TILE_ROWS * BK // 16),
                    tl.where(ok, n_c * (TILE_ROWS * BK // 16), 16))
    else:
        o_n = i_n * BN + tl.arange(0, BN)
        row = tl.where(o_n < H, o_n, 0)
        prefetch_l2(p_w + row.to(tl.int64) * stride_wn + c_lo * BK,
                    tl.where(o_n < H, n_c * BK * 2, 16))


@triton.jit
def _fc2_item(i2, NB2: tl.constexpr, S2: tl.constexpr):
    return i2 // (NB2 * S2), (i2 // S2) % NB2, i2 % S2


@triton.jit
def moe_resident_kernel(
    x_ptr, w1_ptr, s1_ptr, g1_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr,
    p1_ptr, a_ptr, p2_ptr, out_ptr, ready_ptr, rn_ptr, cols_ptr, ctl_ptr,
    T, H, I, chunks1, cps1, chunks2, cps2,
    stride_x, sw1e, sw1n, ss1e, sw2e, sw2n, ss2e,
    stride_p1s, stride_p1r, stride_ar, stride_p2s, stride_p2r, stride_o,
    alpha, limit, timeout_ns,
    E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
    BM: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
    NB1: tl.constexpr, NB2: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, NVFP4: tl.constexpr,
    WEIGHT_BEFORE: tl.constexpr, WEIGHT_AFTER: tl.constexpr, PTX_DECODE: tl.constexpr,
    PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    R = T * K
    deadline = _now(INTERPRET) + timeout_ns
    if PREFETCH == 2 and not INTERPRET:  # this program's FC2 weights, now
        for i2 in range(pid, R * NB2 * S2, G):
            r, i_n, i_s = _fc2_item(i2, NB2, S2)
            e, route = micro_rows(ids_ptr, r, T, E, K, BM, KP, RP)
            if e >= 0:
                c_lo, c_hi = split_chunks(i_s, cps2, chunks2)
                prefetch_weights(w2_ptr + e.to(tl.int64) * sw2e, s2_ptr + e.to(tl.int64) * ss2e,
                                 i_n, c_lo, c_hi, chunks2, sw2n, H, BN2, BK, NVFP4)
    for i1 in range(pid, R * NB1 * S1, G):
        r = i1 // (NB1 * S1)
        i_n = (i1 // S1) % NB1
        i_s = i1 % S1
        e, route = micro_rows(ids_ptr, r, T, E, K, BM, KP, RP)
        if e >= 0:
            if S1 == 1:
                fc1_tile(x_ptr, w1_ptr, s1_ptr, g1_ptr, topk_w_ptr, a_ptr, e, route, route, i_n,
                         0, I, chunks1, cps1, stride_x, sw1e, sw1n, ss1e, 0, stride_ar, alpha,
                         limit, K, BM, BN1, BK, False, GATED, ACT, NVFP4, WEIGHT_BEFORE,
                         PTX_DECODE, INTERPRET, False)
                _signal(ready_ptr + r)
            else:
                fc1_tile(x_ptr, w1_ptr, s1_ptr, g1_ptr, topk_w_ptr, p1_ptr, e, route, route, i_n,
                         i_s, I, chunks1, cps1, stride_x, sw1e, sw1n, ss1e, stride_p1s,
                         stride_p1r, alpha, limit, K, BM, BN1, BK, True, GATED, ACT, NVFP4,
                         WEIGHT_BEFORE, PTX_DECODE, INTERPRET, False)
                if _arrive(rn_ptr + r * NB1 + i_n) == S1 - 1:  # the last split: activate
                    o_c = tl.arange(0, BN1)
                    b_h = act_tile(p1_ptr, route, route >= 0, o_c, i_n * BN1, I, stride_p1s,
                                   stride_p1r, topk_w_ptr, alpha, limit, S1, GATED, ACT,
                                   WEIGHT_BEFORE, INTERPRET)
                    p_a = a_ptr + route[None, :].to(tl.int64) * stride_ar + i_n * BN1 + o_c[:, None]
                    tl.store(p_a, b_h.to(a_ptr.dtype.element_ty),
                             mask=(route >= 0)[None, :] & (i_n * BN1 + o_c < I)[:, None])
                    tl.store(rn_ptr + r * NB1 + i_n, 0)
                    _signal(ready_ptr + r)
    for i2 in range(pid, R * NB2 * S2, G):
        r, i_n, i_s = _fc2_item(i2, NB2, S2)
        e, route = micro_rows(ids_ptr, r, T, E, K, BM, KP, RP)
        if e >= 0:
            p_w = w2_ptr + e.to(tl.int64) * sw2e
            p_s = s2_ptr + e.to(tl.int64) * ss2e
            if PREFETCH == 1 and not INTERPRET:
                c_lo, c_hi = split_chunks(i_s, cps2, chunks2)
                prefetch_weights(p_w, p_s, i_n, c_lo, c_hi, chunks2, sw2n, H, BN2, BK, NVFP4)
            if _wait_ready(ready_ptr + r, NB1, deadline, ctl_ptr, r, INTERPRET):
                fc2_tile(a_ptr, w2_ptr, s2_ptr, g2_ptr, p2_ptr, e, route, route, i_n, i_s, H,
                         chunks2, cps2, stride_ar, sw2e, sw2n, ss2e, stride_p2s, stride_p2r, BM,
                         BN2, BK, NVFP4, PTX_DECODE, INTERPRET, False)
        if _arrive(cols_ptr + i_n) == R * S2 - 1:  # the last tile of column block i_n
            o_h = i_n * BN2 + tl.arange(0, BN2)
            for t in range(T):
                reduce_row(p2_ptr, ids_ptr, topk_w_ptr, out_ptr, t, o_h, H, S2, stride_p2s,
                           stride_p2r, stride_o, E, K, KP, WEIGHT_AFTER)
            tl.store(cols_ptr + i_n, 0)
    if _arrive(ctl_ptr) == G - 1:  # every program is past its waits: reset for the next call
        o_r = tl.arange(0, RP)
        tl.store(ready_ptr + o_r, 0, mask=o_r < R)
        tl.store(ctl_ptr, 0)
