"""Shared @triton.jit helpers of the MoE GEMM kernels: weight tile decode,
activation tile load, activation functions, and the routed-row resolution of
the `micro` and `grouped` families.

Legend: T tokens, K top-k, E experts, BN weight rows per tile, BM routed rows
per tile, BK reduction elements per step (one prepared pack chunk).

Every GEMM is computed transposed ("swap AB"): acc[BN, BM] = W[BN, BK] @ A^T[BK, BM],
so the dequantized weight tile is the left operand (it may stay in registers
for Hopper's wgmma) and a handful of tokens fill the narrow right side.

Prepared weight layout (see `sparkinfer.moe.weights`): the reduction axis is
cut into chunks of BK elements; bf16 weights are plain row-major, NVFP4 bytes
hold element j of a chunk in the low nibble and element j + BK/2 in the high
nibble: the low nibbles decode to the first half-chunk and the high ones to
the second, each a contiguous run of K, joined in registers into one [BN, BK]
operand. One tl.dot of K = BK per step (not two of BK/2 on one accumulator)
lets Triton keep a step's wgmma in flight while the next step loads and
decodes: the sm_90 PTX went from a wait after every dot to one per step.
"""

import triton
import triton.language as tl

# act codes (constexpr ACT)
ACT_SILU = 0
ACT_RELU2 = 1
ACT_SWIGLU_OAI = 2


@triton.jit
def e2m1_to_f32(nib):
    """E2M1 codes (int32, 0..15) -> fp32 values scaled by 2**-14.

    The 3 magnitude bits go to fp16 bits 11..9 (exponent low bits + top mantissa
    bit) and the sign to bit 15: as fp16 that is value * 2**-14 exactly, with
    the E2M1 subnormal 0.5 landing on an fp16 subnormal. Callers fold 2**14
    into the block scale.
    """
    bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_to_f32(byte):
    """E4M3 bits (int32, 0..255) -> fp32 values scaled by 2**-8 (exact, subnormals too)."""
    bits = ((byte & 0x7F) << 7) | ((byte & 0x80) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


# E2M1 -> bf16 for 8 values per 32-bit word (4 prepared bytes, each holding one
# value of the first half-chunk in its low nibble and one of the second in its
# high nibble), times bf16 block scales. prmt is an 8-entry byte table lookup:
# the 3 magnitude bits of 4 nibbles select the high and the low byte of the
# bf16 encodings of 0, .5, 1, 1.5, 2, 3, 4, 6; two more prmt interleave those
# bytes into bf16 pairs; the nibble sign bits are moved to bits 15 / 31 with
# prmt + lop3 (a | (b & c), LUT 0xF8). e2m1 * e4m3 has <= 6 significant bits,
# so mul.rn.bf16x2 by the (exact) bf16 scale is exact. $0,$1: low-nibble
# values (elements 0,1 | 2,3); $2,$3: high-nibble values; $4: the 4 bytes;
# $5..$8 / $9..$12: per element, a 32-bit (scale, scale) bf16 pair of its low /
# high value (no assumption on which elements Triton packs together).
# tests/moe/test_dequant_asm.py emulates this text bit for bit.
E2M1_BF16_ASM = tl.constexpr("""
{
.reg .b32 th0, th1, tl0, tl1, sel, h, l, t, w4, m, sa, sb;
mov.b32 th0, 0x3F3F3F00;
mov.b32 th1, 0x40404040;
mov.b32 tl0, 0xC0800000;
mov.b32 tl1, 0xC0804000;
mov.b32 m, 0x80008000;
shl.b32 w4, $4, 4;
and.b32 sel, $4, 0x7777;
prmt.b32 h, th0, th1, sel;
prmt.b32 l, tl0, tl1, sel;
prmt.b32 $0, l, h, 0x6240;
prmt.b32 $2, l, h, 0x7351;
prmt.b32 t, w4, w4, 0x1100;
lop3.b32 $0, $0, t, m, 0xF8;
prmt.b32 t, $4, $4, 0x1100;
lop3.b32 $2, $2, t, m, 0xF8;
shr.b32 sel, $4, 16;
and.b32 sel, sel, 0x7777;
prmt.b32 h, th0, th1, sel;
prmt.b32 l, tl0, tl1, sel;
prmt.b32 $1, l, h, 0x6240;
prmt.b32 $3, l, h, 0x7351;
prmt.b32 t, w4, w4, 0x3322;
lop3.b32 $1, $1, t, m, 0xF8;
prmt.b32 t, $4, $4, 0x3322;
lop3.b32 $3, $3, t, m, 0xF8;
prmt.b32 sa, $5, $6, 0x7610;
prmt.b32 sb, $7, $8, 0x7610;
mul.rn.bf16x2 $0, $0, sa;
mul.rn.bf16x2 $1, $1, sb;
prmt.b32 sa, $9, $10, 0x7610;
prmt.b32 sb, $11, $12, 0x7610;
mul.rn.bf16x2 $2, $2, sa;
mul.rn.bf16x2 $3, $3, sb;
}
""")


@triton.jit
def bf16_pair(x):
    """fp32 x (exactly representable in bf16) -> int32 holding (bf16(x), bf16(x))."""
    b = x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
    return b | (b << 16)


@triton.jit
def load_scales(s_ptr, rows, row_mask, k0, stride_s, BK: tl.constexpr):
    """E4M3 scale bytes [len(rows), BK/16] of reduction elements k0..k0+BK.

    One load of whole scale rows (8 contiguous bytes at BK 128) is what lets
    Triton's pipeliner turn it into cp.async stages like the codes: it needs
    >= 4 bytes per thread, so callers load >= 512 bytes at 4 warps (1024 at 8).
    Smaller loads stay a synchronous ld.global, one HBM round trip per step.
    """
    o_s = tl.arange(0, BK // 16)
    p_s = s_ptr + rows[:, None] * stride_s + k0 // 16 + o_s[None, :]
    return tl.load(p_s, mask=row_mask[:, None], other=0)


@triton.jit
def load_scales_2(s_ptr, row0, n_rows, offset, k0, stride_s, BN: tl.constexpr,
                  BK: tl.constexpr):
    """Scale bytes of rows row0..row0+BN and the same rows + offset (gate and up),
    rows >= n_rows masked, as one [2BN, BK/16] load (twice the bytes per thread
    of two loads), returned as two [BN, BK/16] tiles."""
    o_2 = tl.arange(0, 2 * BN)
    r = row0 + o_2 % BN
    b_s = load_scales(s_ptr, r + (o_2 // BN) * offset, r < n_rows, k0, stride_s, BK)
    return tl.split(tl.permute(tl.reshape(b_s, [2, BN, BK // 16]), (1, 2, 0)))


@triton.jit
def weight_tile(w_ptr, b_s, rows, row_mask, k0, stride_w,
                  BN: tl.constexpr, BK: tl.constexpr, NVFP4: tl.constexpr,
                  PTX_DECODE: tl.constexpr, INTERPRET: tl.constexpr):
    """Weight tile [BN, BK] of rows `rows` [BN] and reduction elements k0..k0+BK
    in the dot dtype (`dot_operand`), for one tl.dot of K = BK per step (two dots
    of BK/2 on one accumulator made each wait for the other on Hopper).

    bf16: w_ptr -> bf16 [N, R] of one expert, stride_w = R; b_s is ignored.
    NVFP4: w_ptr -> packed uint8 [N, R/2] (prepared interleave); b_s: the
    rows' E4M3 bits [BN, BK/16] of this step (`load_scales`). Returns e2m1 * e4m3
    exactly (bf16 holds the product); the caller multiplies its fp32
    accumulator by the expert's global scale.
    PTX_DECODE selects `E2M1_BF16_ASM` on the GPU; otherwise (and always under
    the interpreter, which cannot run PTX) the same math runs as fp32
    arithmetic. Both are exact, so both give the same bits.
    """
    HALF: tl.constexpr = BK // 2
    if NVFP4:
        G: tl.constexpr = BK // 32  # scale groups per half chunk
        o_g = tl.arange(0, G)
        o_j = tl.arange(0, 16)
        p_b = (w_ptr + rows[:, None, None] * stride_w + k0 // 2 + o_g[None, :, None] * 16
               + o_j[None, None, :])
        b_b = tl.load(p_b, mask=row_mask[:, None, None], other=0)  # [BN, G, 16] uint8
        b_slo, b_shi = tl.split(tl.permute(tl.reshape(b_s, [BN, 2, G]), (0, 2, 1)))
        b_slo = b_slo.to(tl.int32)[:, :, None]  # [BN, G, 1]: scales of the first half chunk
        b_shi = b_shi.to(tl.int32)[:, :, None]
        if INTERPRET or not PTX_DECODE:
            b_i = b_b.to(tl.int32)
            b_lo = e2m1_to_f32(b_i & 15) * (e4m3_to_f32(b_slo) * 4194304.0)  # 2**22
            b_hi = e2m1_to_f32(b_i >> 4) * (e4m3_to_f32(b_shi) * 4194304.0)
            b_lo = b_lo.to(tl.bfloat16)
            b_hi = b_hi.to(tl.bfloat16)
        else:
            s_lo = tl.broadcast_to(bf16_pair(e4m3_to_f32(b_slo) * 256.0), [BN, G, 16])
            s_hi = tl.broadcast_to(bf16_pair(e4m3_to_f32(b_shi) * 256.0), [BN, G, 16])
            b_lo, b_hi = tl.inline_asm_elementwise(
                E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [b_b, s_lo, s_hi],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        lo = tl.reshape(b_lo, [BN, HALF])
        hi = tl.reshape(b_hi, [BN, HALF])
        # natural K order: columns 0..HALF from the low nibbles, HALF..BK from the high
        w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [BN, BK])
    else:
        o_k = tl.arange(0, BK)
        p_w = w_ptr + rows[:, None] * stride_w + k0 + o_k[None, :]
        w = tl.load(p_w, mask=row_mask[:, None], other=0.0).to(tl.bfloat16)
    return dot_operand(w, INTERPRET)


@triton.jit
def dot_operand(x, INTERPRET: tl.constexpr):
    """bf16 tensor-core operand on the GPU; fp32 under the Triton interpreter,
    whose bf16 tl.dot is not exact (values are bf16 already, so fp32 loses nothing)."""
    if INTERPRET:
        return x.to(tl.float32)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def activation(g, u, ACT: tl.constexpr, alpha, limit):
    """Elementwise activation in fp32. u is ignored for relu2 (not gated)."""
    if ACT == 0:
        return g * tl.sigmoid(g) * u
    elif ACT == 1:
        r = tl.maximum(g, 0.0)
        return r * r
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return gc * tl.sigmoid(alpha * gc) * (uc + 1.0)


@triton.jit
def micro_rows(ids_ptr, pid_r, T, E: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
               KP: tl.constexpr, RP: tl.constexpr):
    """Routed rows of the `micro` program for route slot pid_r (no sort).

    The program owns expert e = ids[pid_r] when pid_r is the first slot naming
    e (so each active expert's weights are read once); rows are the T <= BM
    tokens, row t active when e is among its top-k. Returns (e or -1 when the
    program has nothing to do, route index t*K + k per row or -1).
    """
    o_r = tl.arange(0, RP)
    b_all = tl.load(ids_ptr + o_r, mask=o_r < T * K, other=-1)
    e = tl.load(ids_ptr + pid_r)
    first = tl.min(tl.where(b_all == e, o_r, RP), axis=0)
    own = (first == pid_r) & (e >= 0) & (e < E)
    o_t = tl.arange(0, BM)
    o_k = tl.arange(0, KP)
    m_tk = (o_t[:, None] < T) & (o_k[None, :] < K)
    b_ids = tl.load(ids_ptr + o_t[:, None] * K + o_k[None, :], mask=m_tk, other=-1)
    k_t = tl.max(tl.where(b_ids == e, o_k[None, :], -1), axis=1)  # [BM]
    route = tl.where((k_t >= 0) & own, o_t * K + k_t, -1)
    return tl.where(own, e, -1), route
