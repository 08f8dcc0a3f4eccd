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

from sparkinfer.comm.protocol import ERR_MISMATCH, ERR_TIMEOUT, HDR_ABORT, _report, addr_of, ld_acquire, now_ns

LOW32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def ll_flag(epoch, fp):
    """The 32-bit LL flag of operation (epoch, fingerprint), as int64."""
    return (1 << 31) | (((epoch + 1) & 0x7FFF) << 16) | (fp.to(tl.int64) & 0xFFFF)


@triton.jit
def ll_pack(d32, flag):
    """int32 payload words -> int64 LL words."""
    return (d32.to(tl.int64) & LOW32) | (flag << 32)


@triton.jit
def ll_wait_tile(p_lane, o, m, flag, table, rank, peer, epoch, deadline, op,
                 W: tl.constexpr, INTERP: tl.constexpr):
    """Spin until every word lane[o] (where m) carries `flag`; returns (words, status).

    status 0: all arrived; else the error code (recorded, peers aborted)."""
    p_hdr = addr_of(table, rank).to(tl.pointer_type(tl.int64))
    v = tl.load(p_lane + o, mask=m, other=0, volatile=True)
    ready = tl.min(tl.where(m, ((v >> 32) & LOW32) == flag, 1).to(tl.int32), axis=0)
    status = tl.zeros([], tl.int32)
    while ready == 0:
        v = tl.load(p_lane + o, mask=m, other=0, volatile=True)
        got = tl.where(m, (v >> 32) & LOW32, flag)  # the shift sign-extends: mask it
        ready = tl.min((got == flag).to(tl.int32), axis=0)
        if ready == 0:
            wrong = tl.max(((got != 0) & (got != flag)).to(tl.int32), axis=0)
            ab = ld_acquire(p_hdr + HDR_ABORT, INTERP)
            if wrong != 0:
                status = tl.full([], ERR_MISMATCH, tl.int32)
                _report(table, rank, status, peer, rank, epoch, tl.max(got, axis=0), flag, op, W, INTERP)
                ready = 1
            elif ab != 0:
                status = ((ab >> 32) & 0xFFFF).to(tl.int32)
                _report(table, rank, status, (ab & 0xFFFF).to(tl.int32), ((ab >> 16) & 0xFFFF).to(tl.int32),
                        epoch, tl.min(got, axis=0), flag, op, W, INTERP)
                ready = 1
            elif now_ns(INTERP) > deadline:
                status = tl.full([], ERR_TIMEOUT, tl.int32)
                _report(table, rank, status, peer, rank, epoch, tl.min(got, axis=0), flag, op, W, INTERP)
                ready = 1
    return v, status


@triton.jit
def ll_wait_sum(p_words, lo, n, flag, table, rank, epoch, deadline, op, W: tl.constexpr, NP: tl.constexpr,
                INTERP: tl.constexpr):
    """Spin until the n (<= NP) LL words p_words[lo:lo + n] carry `flag`; returns
    (the fp32 sum of their payloads, status). Posted by blocks of this launch on
    this rank: a timeout names this rank. The sum's order depends only on n and
    NP, so every block that reads the same words gets the same bits."""
    o_n = tl.arange(0, NP)
    v, status = ll_wait_tile(p_words, lo + o_n, o_n < n, flag, table, rank, rank, epoch, deadline, op, W, INTERP)
    vals = (v & LOW32).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.sum(tl.where(o_n < n, vals, 0.0), axis=0), status


@triton.jit
def ll_clear(p_words, n, BLOCK: tl.constexpr):
    """p_words[0:n] = 0 (int64 LL words)."""
    o = tl.arange(0, BLOCK)
    for k in range(0, n, BLOCK):
        tl.store(p_words + k + o, tl.zeros([BLOCK], tl.int64), mask=k + o < n)


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
