"""Device-side protocol shared by every comm kernel (only @triton.jit helpers).

Rules that hold on PCIe as well as NVLink: ranks write to peers and poll only
their own slab; no peer atomics (the only atomics touch local device memory);
release/acquire at system scope between data and flags; every spin has a
deadline; an error is recorded in host-visible memory and broadcast to peers as
an abort word so nobody waits for a deadline that is already known to be missed.

Names in every comm and MoE kernel: `p_` pointers (arguments included),
`i_` program ids, `o_` offsets, `m_` masks, `b_` block values, `a_` integer
byte addresses (peer-mapped memory, made pointers by `as_ptr`), `stride_`
strides in elements; constexprs in capitals, `INTERPRET` for the interpreter.
"""

from __future__ import annotations

import time

import triton
import triton.language as tl
from triton.language.extra import cuda as tlcuda

from sparkinfer.comm.channel import FLAGS_OFF, MAX_BLOCKS, NUM_PHASES

# header words (int64 index into the slab)
HDR_EPOCH = tl.constexpr(0)
HDR_ARRIVE = tl.constexpr(1)
HDR_ABORT = tl.constexpr(2)
HDR_CLAIM = tl.constexpr(3)
FLAGS_WORD = tl.constexpr(FLAGS_OFF // 8)
NPHASE = tl.constexpr(NUM_PHASES)
NBLK = tl.constexpr(MAX_BLOCKS)
LOW32 = tl.constexpr(0xFFFFFFFF)

# error codes in the record's word 0 (mirrored in comm/dispatch.py)
ERR_TIMEOUT = tl.constexpr(1)
ERR_MISMATCH = tl.constexpr(2)


def _host_now_ns():
    return time.monotonic_ns()


_HOST_NOW = tl.constexpr(_host_now_ns)  # interpreter only: a constexpr callable the GPU never sees


@triton.jit
def now_ns(INTERPRET: tl.constexpr):
    if INTERPRET:
        t = tl.full([], _HOST_NOW(), tl.int64)
    else:
        t = tlcuda.globaltimer().to(tl.int64)
    return t


@triton.jit
def ld_acquire(p_word, INTERPRET: tl.constexpr):
    """Load an int64 word of *local* memory with acquire semantics at system scope."""
    if INTERPRET:
        v = tl.atomic_add(p_word, 0, sem="acquire", scope="sys")
    else:
        v = tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [p_word], dtype=tl.int64, is_pure=False, pack=1
        )
    return v


@triton.jit
def st_release(p_word, v, INTERPRET: tl.constexpr):
    """Store an int64 word (possibly in a peer's memory) with release semantics at
    system scope, from thread 0 of the block only (callers put a block barrier
    before it, which makes every thread's earlier stores part of the release).
    A plain store, not an atomic: peer atomics are not portable over PCIe."""
    if INTERPRET:
        tl.atomic_xchg(p_word, v, sem="release", scope="sys")
    else:
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred %p_t0;\n\t.reg .b32 %r_tid;\n\tmov.u32 %r_tid, %tid.x;\n\t"
            "setp.eq.u32 %p_t0, %r_tid, 0;\n\t@%p_t0 st.release.sys.global.b64 [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
            "=r,l,l",
            [p_word, v],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def addr_of(p_table, r):
    """Base address (int64) of group rank r's slab as mapped in this process."""
    return tl.multiple_of(tl.load(p_table + r), 16)


@triton.jit
def as_ptr(a, like):
    """Integer address -> pointer with the element type of pointer `like`."""
    return tl.multiple_of(a.to(tl.pointer_type(like.dtype.element_ty)), 16)


@triton.jit
def begin(p_table, rank, timeout_ns, INTERPRET: tl.constexpr):
    """Read this op's epoch. Returns (epoch, deadline_ns)."""
    p_hdr = tl.load(p_table + rank).to(tl.pointer_type(tl.int64))
    epoch = tl.load(p_hdr + HDR_EPOCH)
    return epoch, now_ns(INTERPRET) + timeout_ns


@triton.jit
def flag_word(epoch, phase, src, blk, W: tl.constexpr):
    """Index (int64 words from the slab base) of flag [epoch % 2][phase][src][blk]."""
    return FLAGS_WORD + (((epoch % 2) * NPHASE + phase) * W + src) * NBLK + blk


@triton.jit
def signal_peers(p_table, rank, epoch, phase, fp, W: tl.constexpr, INTERPRET: tl.constexpr):
    """Tell every peer that this block's phase-`phase` data for `epoch` is in place.

    Call after this block's data stores; the barrier makes every thread's stores
    part of what the release publishes."""
    tl.debug_barrier()
    v = (fp.to(tl.int64) << 32) | ((epoch + 1) & LOW32)
    blk = tl.program_id(0)
    for r in tl.static_range(W):
        if r != rank:
            p_flag = addr_of(p_table, r).to(tl.pointer_type(tl.int64))
            st_release(p_flag + flag_word(epoch, phase, rank, blk, W), v, INTERPRET)


@triton.jit
def _i64(x):
    return x + tl.zeros([], tl.int64)


@triton.jit
def _report(p_table, rank, code, peer, origin, epoch, observed, expect, op, W: tl.constexpr, INTERPRET: tl.constexpr):
    """Record this rank's first error in host-visible memory; if it was found
    here (origin == rank), broadcast an abort word to every rank."""
    p_hdr = addr_of(p_table, rank).to(tl.pointer_type(tl.int64))
    first = tl.atomic_cas(p_hdr + HDR_CLAIM, _i64(0), _i64(1), sem="acq_rel", scope="gpu")  # local atomic
    if first == 0:
        p_err = tl.load(p_table + W).to(tl.pointer_type(tl.int64))
        tl.store(p_err + 1, _i64(rank))
        tl.store(p_err + 2, _i64(peer))
        tl.store(p_err + 3, _i64(op))
        tl.store(p_err + 4, epoch)
        tl.store(p_err + 5, observed)
        tl.store(p_err + 6, expect)
        tl.store(p_err + 7, _i64(origin))
        st_release(p_err, _i64(code), INTERPRET)
        if origin == rank:
            abort = ((epoch & 0x7FFF) << 48) | (_i64(code) << 32) | (_i64(origin) << 16) | _i64(peer)
            for r in tl.static_range(W):
                st_release(addr_of(p_table, r).to(tl.pointer_type(tl.int64)) + HDR_ABORT, abort, INTERPRET)


@triton.jit
def abort_for(p_hdr, epoch, INTERPRET: tl.constexpr):
    """This rank's abort word (`_report`: epoch & 0x7FFF << 48 | code << 32 | origin
    << 16 | peer) if it stops the op at `epoch`, else 0. An abort raised at a later
    sequence does not: its origin finished this op, so every word this op awaits from
    it was sent; this op completes and the next one raises. (CI, 3 CPU ranks: rank 2
    still finishing sequence 6 raised a mismatch that rank 1 found at 7.)"""
    ab = ld_acquire(p_hdr + HDR_ABORT, INTERPRET)
    ahead = ((ab >> 48) - epoch) & 0x7FFF
    return tl.where((ahead >= 1) & (ahead < 0x4000), 0, ab)


@triton.jit
def wait_peers(p_table, rank, epoch, phase, fp, deadline, op, W: tl.constexpr, INTERPRET: tl.constexpr):
    """Wait until every peer signalled (epoch, phase) for this block.

    Returns 0 when all arrived with the expected fingerprint, else an error code
    (the error is recorded and broadcast; the caller skips its data phase)."""
    return wait_peers_at(p_table, rank, epoch, phase, fp, deadline, op, tl.program_id(0), W, INTERPRET)


@triton.jit
def wait_peers_at(p_table, rank, epoch, phase, fp, deadline, op, blk, W: tl.constexpr, INTERPRET: tl.constexpr):
    """wait_peers for the flags of block `blk` (a kernel whose blocks read data
    that other blocks pushed waits on those blocks' flags)."""
    p_hdr = addr_of(p_table, rank).to(tl.pointer_type(tl.int64))
    expect = (fp.to(tl.int64) << 32) | ((epoch + 1) & LOW32)
    status = tl.zeros([], tl.int32)
    for r in tl.static_range(W):
        if (r != rank) & (status == 0):
            p_flag = p_hdr + flag_word(epoch, phase, r, blk, W)
            v = ld_acquire(p_flag, INTERPRET)
            pending = (v & LOW32) != (expect & LOW32)
            while pending:
                v = ld_acquire(p_flag, INTERPRET)
                pending = (v & LOW32) != (expect & LOW32)
                if pending:
                    ab = abort_for(p_hdr, epoch, INTERPRET)
                    if ab != 0:
                        status = ((ab >> 32) & 0xFFFF).to(tl.int32)
                        _report(p_table, rank, status, (ab & 0xFFFF).to(tl.int32), ((ab >> 16) & 0xFFFF).to(tl.int32),
                                epoch, v, expect, op, W, INTERPRET)
                        pending = False
                    elif now_ns(INTERPRET) > deadline:
                        status = tl.full([], ERR_TIMEOUT, tl.int32)
                        _report(p_table, rank, status, r, rank, epoch, v, expect, op, W, INTERPRET)
                        pending = False
            if (status == 0) & (v != expect):
                status = tl.full([], ERR_MISMATCH, tl.int32)
                _report(p_table, rank, status, r, rank, epoch, v, expect, op, W, INTERPRET)
    return status


@triton.jit
def arrive_last(p_table, rank):
    """Count this block as done; True in the last block to arrive, which then
    sees every other block's memory accesses of this launch (acq_rel counter)."""
    tl.debug_barrier()
    p_hdr = tl.load(p_table + rank).to(tl.pointer_type(tl.int64))
    old = tl.atomic_add(p_hdr + HDR_ARRIVE, 1, sem="acq_rel", scope="gpu")
    return old == tl.num_programs(0) - 1


@triton.jit
def close_epoch(p_table, rank, epoch, op, W: tl.constexpr, INTERPRET: tl.constexpr):
    """The last block (arrive_last) resets the counter and bumps the epoch.

    It also looks at the abort word once: a rank that arrived after a peer
    timed out and aborted the group found every flag in place and finished,
    but the group is broken; recording the abort here makes this call (or,
    on the GPU, the next host check) raise on this rank too. One local load."""
    p_hdr = tl.load(p_table + rank).to(tl.pointer_type(tl.int64))
    ab = abort_for(p_hdr, epoch, INTERPRET)
    if ab != 0:  # first claim only: a no-op where this rank already recorded an error
        _report(p_table, rank, ((ab >> 32) & 0xFFFF).to(tl.int32), (ab & 0xFFFF).to(tl.int32),
                ((ab >> 16) & 0xFFFF).to(tl.int32), epoch, _i64(0), _i64(0), op, W, INTERPRET)
    tl.store(p_hdr + HDR_ARRIVE, 0)
    tl.store(p_hdr + HDR_EPOCH, epoch + 1)


@triton.jit
def finish(p_table, rank, epoch, op, W: tl.constexpr, INTERPRET: tl.constexpr):
    """Every block calls this last; the last block to arrive bumps the epoch
    (and records an abort a peer broadcast, see close_epoch)."""
    if arrive_last(p_table, rank):
        close_epoch(p_table, rank, epoch, op, W, INTERPRET)


@triton.jit
def block_range(n, BLOCK: tl.constexpr):
    """This block's [lo, hi) share of n elements, in whole BLOCKs."""
    per = tl.cdiv(tl.cdiv(n, tl.num_programs(0)), BLOCK) * BLOCK
    lo = tl.program_id(0) * per
    return lo, tl.minimum(lo + per, n)


@triton.jit
def stage_addr(p_table, owner, epoch, lane, stage_off, slot_bytes, lane_bytes):
    """Address of `lane` (W = the gather region) in this epoch's slot of `owner`'s slab."""
    return addr_of(p_table, owner) + stage_off + (epoch % 2) * slot_bytes + lane * lane_bytes


@triton.jit
def copy_range(p_src, p_dst, lo, hi, BLOCK: tl.constexpr):
    """p_dst[lo:hi] = p_src[lo:hi] (elements)."""
    for start in range(lo, hi, BLOCK):
        o_n = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        m_n = o_n < hi
        tl.store(p_dst + o_n, tl.load(p_src + o_n, mask=m_n), mask=m_n)


@triton.jit
def push_to_peers(p_x, lo, hi, p_table, rank, epoch, stage_off, slot_bytes, lane_bytes,
                  W: tl.constexpr, BLOCK: tl.constexpr):
    """Copy x[lo:hi] into lane[rank] of every peer's slot, at the same element offsets."""
    for r in tl.static_range(W):
        if r != rank:
            p_lane = as_ptr(stage_addr(p_table, r, epoch, rank, stage_off, slot_bytes, lane_bytes), p_x)
            copy_range(p_x, p_lane, lo, hi, BLOCK)


@triton.jit
def reduce_lanes(p_x, o_n, m_n, p_table, rank, epoch, stage_off, slot_bytes, lane_bytes, W: tl.constexpr):
    """fp32 sum over ranks 0..W-1, in rank order, of x[o] (masked lanes read 0):
    this rank's value from p_x, every peer's from this rank's staging lane. The
    fixed order makes the sum bitwise identical on every rank."""
    acc = tl.zeros(o_n.shape, tl.float32)
    for r in tl.static_range(W):
        if r == rank:
            b = tl.load(p_x + o_n, mask=m_n, other=0.0)
        else:
            p_lane = as_ptr(stage_addr(p_table, rank, epoch, r, stage_off, slot_bytes, lane_bytes), p_x)
            b = tl.load(p_lane + o_n, mask=m_n, other=0.0)
        acc += b.to(tl.float32)
    return acc


@triton.jit
def publish_local(p_slot, value, tag, INTERPRET: tl.constexpr):
    """Post an fp32 `value` for other blocks of this grid: slot = [tag int64, value] in
    this rank's own slab. The tag (fingerprint << 32 | epoch + 1, as in flags) is
    released after the value, at gpu scope (a local atomic: no peer ever reads it)."""
    tl.store((p_slot + 1).to(tl.pointer_type(tl.float32)), value)
    tl.debug_barrier()
    tl.atomic_xchg(p_slot, tag, sem="release", scope="gpu")  # local word, same device: gpu scope suffices


@triton.jit
def wait_local(p_table, rank, p_slot, tag, deadline, epoch, op, W: tl.constexpr, INTERPRET: tl.constexpr):
    """Wait (bounded) until another block of this grid posted `tag` at p_slot; returns
    (value, status). The grid is co-resident, so only a broken launch times out; a
    timeout is recorded like a peer's (naming this rank)."""
    p_hdr = addr_of(p_table, rank).to(tl.pointer_type(tl.int64))
    v = tl.atomic_add(p_slot, 0, sem="acquire", scope="gpu")
    status = tl.zeros([], tl.int32)
    while (v != tag) & (status == 0):
        v = tl.atomic_add(p_slot, 0, sem="acquire", scope="gpu")
        if v != tag:
            ab = abort_for(p_hdr, epoch, INTERPRET)
            if ab != 0:  # a block that would post skipped its work: the group aborted
                status = ((ab >> 32) & 0xFFFF).to(tl.int32)
            elif now_ns(INTERPRET) > deadline:
                status = tl.full([], ERR_TIMEOUT, tl.int32)
                _report(p_table, rank, status, rank, rank, epoch, v, tag, op, W, INTERPRET)
    return tl.load((p_slot + 1).to(tl.pointer_type(tl.float32))), status


@triton.jit(do_not_specialize=["rank"])  # same code on every rank
def handshake_kernel(p_table, rank, fp, timeout_ns, stage_off, slot_bytes, lane_bytes,
                     OP: tl.constexpr, W: tl.constexpr, INTERPRET: tl.constexpr):
    """A collective that moves no data: every rank signals phase 0 with fingerprint
    fp and awaits its peers'. Run (one block) before an op leaves the peer channel
    for torch.distributed, so ranks that disagree on the path (sizes straddling the
    capacity) meet on the flags and raise CollectiveMismatch, instead of one rank
    waiting in a kernel and the other in NCCL forever."""
    epoch, deadline = begin(p_table, rank, timeout_ns, INTERPRET)
    signal_peers(p_table, rank, epoch, 0, fp, W, INTERPRET)
    wait_peers(p_table, rank, epoch, 0, fp, deadline, OP, W, INTERPRET)
    finish(p_table, rank, epoch, OP, W, INTERPRET)
