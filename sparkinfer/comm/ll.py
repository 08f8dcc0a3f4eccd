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


# Per-thread spin on the GPU: each thread polls its own LL words (at most
# SPIN_TRIES loads each) until they carry the flag, with no block barrier in
# the loop; the block then checks once (one reduction) and, while words are
# still missing, checks the abort word and the deadline before spinning again.
# Labels inside a { } block are local to it, so the asm may be inlined many times.
SPIN_TRIES = tl.constexpr(256)
LL_SPIN_ASM = tl.constexpr("""
{
.reg .pred %sw_skip, %sw_more;
.reg .b32 %sw_lo, %sw_hi, %sw_n;
mov.b64 $0, 0;
setp.eq.s32 %sw_skip, $3, 0;
@%sw_skip bra SW_DONE;
mov.u32 %sw_n, 0;
SW_LOOP:
ld.volatile.global.b64 $0, [$1];
mov.b64 {%sw_lo, %sw_hi}, $0;
add.u32 %sw_n, %sw_n, 1;
setp.ne.u32 %sw_more, %sw_hi, $2;
setp.lt.and.u32 %sw_more, %sw_n, $4, %sw_more;
@%sw_more bra SW_LOOP;
SW_DONE:
}
""")


@triton.jit
def _ll_poll(p_lane, o, m, flag, INTERP: tl.constexpr):
    """The words lane[o] (0 where not m): on the GPU after each thread spun on its own words."""
    if INTERP:
        v = tl.load(p_lane + o, mask=m, other=0, volatile=True)
    else:
        zero = tl.zeros(o.shape, tl.int32)
        v = tl.inline_asm_elementwise(
            LL_SPIN_ASM, "=l,l,r,r,r",
            [p_lane + o, zero + flag.to(tl.int32), m.to(tl.int32), zero + SPIN_TRIES],
            dtype=tl.int64, is_pure=False, pack=1)
    return v


@triton.jit
def ll_wait_tile(p_lane, o, m, flag, table, rank, peer, epoch, deadline, op,
                 W: tl.constexpr, INTERP: tl.constexpr):
    """Spin until every word lane[o] (where m) carries `flag`; returns (words, status).

    status 0: all arrived; else the error code (recorded, peers aborted). One
    block reduction per round: per word 0 arrived, 1 still 0, 2 foreign."""
    p_hdr = addr_of(table, rank).to(tl.pointer_type(tl.int64))
    status = tl.zeros([], tl.int32)
    v = _ll_poll(p_lane, o, m, flag, INTERP)
    got = tl.where(m, (v >> 32) & LOW32, flag)  # the shift sign-extends: mask it
    worst = tl.max(tl.where(got == flag, 0, tl.where(got == 0, 1, 2)), axis=0)
    while worst != 0:
        if worst == 2:
            status = tl.full([], ERR_MISMATCH, tl.int32)
            _report(table, rank, status, peer, rank, epoch, tl.max(tl.where(got == flag, 0, got), axis=0), flag, op,
                    W, INTERP)
            worst = 0
        else:
            ab = ld_acquire(p_hdr + HDR_ABORT, INTERP)
            if ab != 0:
                status = ((ab >> 32) & 0xFFFF).to(tl.int32)
                _report(table, rank, status, (ab & 0xFFFF).to(tl.int32), ((ab >> 16) & 0xFFFF).to(tl.int32),
                        epoch, tl.min(got, axis=0), flag, op, W, INTERP)
                worst = 0
            elif now_ns(INTERP) > deadline:
                status = tl.full([], ERR_TIMEOUT, tl.int32)
                _report(table, rank, status, peer, rank, epoch, tl.min(got, axis=0), flag, op, W, INTERP)
                worst = 0
            else:
                v = _ll_poll(p_lane, o, m, flag, INTERP)
                got = tl.where(m, (v >> 32) & LOW32, flag)
                worst = tl.max(tl.where(got == flag, 0, tl.where(got == 0, 1, 2)), axis=0)
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
