"""Low-latency (LL) transport: every 8-byte staged word carries 4 bytes of
payload and a 4-byte flag, so data and readiness arrive together and the
receiver needs no release/acquire round trip (NCCL's LL idea).

Flag word (high 32 bits of each int64): 1 << 31 | (sequence & 0x7FFF) << 16 |
(fingerprint & 0xFFFF); never 0. LL words live in their own region (channel.py)
and the reader zeroes every word it consumed, so a word in the region is either
0 or the current op's: stale or foreign bytes can never pass for a flag. The
sequence bits only tell apart a peer's next op, which lands in the other slot.
Only @triton.jit helpers live here.
"""

import triton
import triton.language as tl

from sparkinfer.comm.protocol import (
    ERR_MISMATCH,
    ERR_TIMEOUT,
    _report,
    abort_for,
    addr_of,
    flag_word,
    ld_acquire,
    now_ns,
)

LOW32 = tl.constexpr(0xFFFFFFFF)
# ll_wait_sum: spin rounds between the slow checks (an acquire load of the abort word,
# the timer); a round that finds the words late costs a load and one reduction.
STUCK_EVERY = tl.constexpr(32)
SPIN_LOADS = 64  # _spin_word: loads per thread per round


@triton.jit
def ll_flag(epoch, fp):
    """The 32-bit LL flag of operation (epoch, fingerprint), as int64."""
    return (1 << 31) | (((epoch + 1) & 0x7FFF) << 16) | (fp.to(tl.int64) & 0xFFFF)


@triton.jit
def ll_pack(d32, flag):
    """int32 payload words -> int64 LL words."""
    return (d32.to(tl.int64) & LOW32) | (flag << 32)


@triton.jit
def _ll_stuck(got, flag, p_table, rank, peer, epoch, deadline, op, W: tl.constexpr, INTERPRET: tl.constexpr):
    """Checks of a spin round that found words not yet carrying `flag` (got: their
    flag halves, `flag` where nothing is awaited): a foreign flag, an abort word
    or the deadline. Returns the error code (recorded, peers aborted) or 0."""
    p_hdr = addr_of(p_table, rank).to(tl.pointer_type(tl.int64))
    wrong = tl.max(((got != 0) & (got != flag)).to(tl.int32), axis=0)
    ab = abort_for(p_hdr, epoch, INTERPRET)
    # A peer in a flag-synchronized op at this very sequence number (it signalled
    # block 0's first phase in this rank's slab) is running another collective: it
    # would never write these LL words, so say mismatch now rather than time out.
    stage_peer = tl.full([], -1, tl.int32)
    stage_v = tl.zeros([], tl.int64)
    for r in tl.static_range(W):
        if r != rank:
            v = ld_acquire(p_hdr + flag_word(epoch, 0, r, 0, W), INTERPRET)
            if (v & LOW32) == ((epoch + 1) & LOW32):
                stage_peer = tl.full([], r, tl.int32)
                stage_v = v
    status = tl.zeros([], tl.int32)
    if wrong != 0:
        status = tl.full([], ERR_MISMATCH, tl.int32)
        foreign = tl.max(tl.where((got != 0) & (got != flag), got, 0), axis=0)  # never `flag` itself
        _report(p_table, rank, status, peer, rank, epoch, foreign, flag, op, W, INTERPRET)
    elif stage_peer >= 0:
        status = tl.full([], ERR_MISMATCH, tl.int32)
        _report(p_table, rank, status, stage_peer, rank, epoch, stage_v, flag, op, W, INTERPRET)
    elif ab != 0:
        status = ((ab >> 32) & 0xFFFF).to(tl.int32)
        _report(p_table, rank, status, (ab & 0xFFFF).to(tl.int32), ((ab >> 16) & 0xFFFF).to(tl.int32),
                epoch, tl.min(got, axis=0), flag, op, W, INTERPRET)
    elif now_ns(INTERPRET) > deadline:
        status = tl.full([], ERR_TIMEOUT, tl.int32)
        _report(p_table, rank, status, peer, rank, epoch, tl.min(got, axis=0), flag, op, W, INTERPRET)
    return status


@triton.jit
def ll_wait_tile(p_lane, o_n, m_n, flag, p_table, rank, peer, epoch, deadline, op,
                 W: tl.constexpr, INTERPRET: tl.constexpr):
    """Spin until every word lane[o] (where m) carries `flag`; returns (words, status).

    status 0: all arrived; else the error code (recorded, peers aborted)."""
    v = tl.load(p_lane + o_n, mask=m_n, other=0, volatile=True)
    ready = tl.min(tl.where(m_n, ((v >> 32) & LOW32) == flag, 1).to(tl.int32), axis=0)
    status = tl.zeros([], tl.int32)
    while ready == 0:
        v = tl.load(p_lane + o_n, mask=m_n, other=0, volatile=True)
        got = tl.where(m_n, (v >> 32) & LOW32, flag)  # the shift sign-extends: mask it
        ready = tl.min((got == flag).to(tl.int32), axis=0)
        if ready == 0:
            status = _ll_stuck(got, flag, p_table, rank, peer, epoch, deadline, op, W, INTERPRET)
            ready = (status != 0).to(tl.int32)
    return v, status


@triton.jit
def _ready_sum(ok_a, v_a, ok_b, v_b):
    return tl.minimum(ok_a, ok_b), v_a + v_b


# _spin_word's loop (labels are local to the braces, so the asm may be inlined many times)
_SPIN_ASM = tl.constexpr(
    "{\n\t.reg .pred %sp<2>;\n\t.reg .b32 %sr<3>;\n\t.reg .b64 %sv;\n\t"
    "mov.b64 %sv, 0;\n\tmov.u32 %sr0, 0;\n\tsetp.eq.u32 %sp0, $3, 0;\n\t@%sp0 bra SPIN_DONE;\n"
    "SPIN_LOOP:\n\tld.volatile.global.b64 %sv, [$1];\n\tmov.b64 {%sr1, %sr2}, %sv;\n\t"
    "setp.eq.u32 %sp1, %sr2, $2;\n\t@%sp1 bra SPIN_DONE;\n\tadd.u32 %sr0, %sr0, 1;\n\t"
    f"setp.lt.u32 %sp1, %sr0, {SPIN_LOADS};\n\t@%sp1 bra SPIN_LOOP;\n"
    "SPIN_DONE:\n\tmov.b64 $0, %sv;\n\t}"
)


@triton.jit
def _spin_word(p_word, flag, active):
    """Per thread: load the LL word at p_word until it carries `flag`, at most
    SPIN_LOADS times (no block-wide step between loads); 0 where not active."""
    return tl.inline_asm_elementwise(_SPIN_ASM, "=l,l,r,r", [p_word, flag, active], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _poll_sum(p_words, o_n, m_n, own, own_val, flag, INTERPRET: tl.constexpr):
    """One poll of LL words p_words[o_n] (where m): (their flag halves, 1 if all
    carry `flag`, the fp32 sum of their payloads with own_val at index own), from
    one reduction (inside each warp: every warp holds a copy of the words). On the
    GPU each thread first spins on its own word (_spin_word), so a late word is
    seen one load after it lands."""
    if INTERPRET:
        v = tl.load(p_words + o_n, mask=m_n, other=0, volatile=True)
    else:
        v = _spin_word(p_words + o_n, flag.to(tl.int32), m_n.to(tl.int32))
    got = tl.where(m_n, (v >> 32) & LOW32, flag)
    vals = tl.where(m_n, (v & LOW32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    ready, total = tl.reduce(((got == flag).to(tl.int32), tl.where(o_n == own, own_val, vals)), 0, _ready_sum)
    return got, ready, total


@triton.jit
def ll_wait_sum(p_words, lo, n, own, own_val, flag, p_table, rank, epoch, deadline, op, W: tl.constexpr,
                NP: tl.constexpr, INTERPRET: tl.constexpr):
    """Spin until the n (<= NP) LL words p_words[lo:lo + n] carry `flag`; returns
    (the fp32 sum of their payloads, status). Posted by blocks of this launch on
    this rank: a timeout names this rank. Word `own` (-1: none) was posted by
    this block with payload own_val: it is taken from registers, not awaited
    (its store need not be visible to every thread yet). A round is one load
    and one reduction (readiness and sum together); the foreign-flag,
    abort and deadline checks run every STUCK_EVERY rounds. The sum's order
    depends only on n and NP, so every block of the row gets the same bits.
    NP is below the block's thread count, so every warp holds its own copy of
    the words and decides readiness on its own: warps leave the loop at
    different times, and a caller that zeroes the words must put a block
    barrier before that store (tests/comm/test_ll_zeroing.py)."""
    o_n = tl.arange(0, NP)
    m_n = (o_n < n) & (o_n != own)
    got, ready, total = _poll_sum(p_words + lo, o_n, m_n, own, own_val, flag, INTERPRET)
    status = tl.zeros([], tl.int32)
    rounds = 0
    while ready == 0:
        got, ready, total = _poll_sum(p_words + lo, o_n, m_n, own, own_val, flag, INTERPRET)
        rounds += 1
        if (ready == 0) & (rounds % STUCK_EVERY == 0):
            status = _ll_stuck(got, flag, p_table, rank, rank, epoch, deadline, op, W, INTERPRET)
            ready = (status != 0).to(tl.int32)
    return total, status


@triton.jit
def ll_clear(p_words, n, BLOCK: tl.constexpr):
    """p_words[0:n] = 0 (int64 LL words)."""
    o_n = tl.arange(0, BLOCK)
    for k in range(0, n, BLOCK):
        tl.store(p_words + k + o_n, tl.zeros([BLOCK], tl.int64), mask=k + o_n < n)


@triton.jit
def unpack_add(acc_lo, acc_hi, d32, HALF: tl.constexpr, DT: tl.constexpr):
    """Add the values held in int32 words d32 to fp32 accumulators.

    HALF: each word holds two 16-bit values of dtype DT (low half first);
    else one fp32 value (acc_hi unused)."""
    if HALF:
        lo = (d32 & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
        hi = ((d32 >> 16) & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
        acc_lo += lo.to(tl.float32)
        acc_hi += hi.to(tl.float32)
    else:
        acc_lo += d32.to(tl.float32, bitcast=True)
    return acc_lo, acc_hi


@triton.jit
def pack_out(acc_lo, acc_hi, HALF: tl.constexpr, DT: tl.constexpr):
    """fp32 accumulators -> int32 words of the output dtype (inverse of unpack_add)."""
    if HALF:
        lo = acc_lo.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = acc_hi.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        w = lo | (hi << 16)
    else:
        w = acc_lo.to(tl.int32, bitcast=True)
    return w
