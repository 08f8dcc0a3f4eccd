"""Shared @triton.jit helpers of the MoE GEMM kernels: weight tile decode,
activation tile load, activation functions, and the routed-row resolution of
the `micro` and `grouped` families.

Legend: T tokens, K top-k, E experts, BN weight rows per tile, BM routed rows
per tile, BK reduction elements per step. Names follow comm/protocol.py: `p_`
pointers, `i_` program ids, `o_` offsets, `m_` masks, `b_` block values,
`stride_` strides.

Every GEMM is computed transposed ("swap AB"): acc[BN, BM] = W[BN, BK] @ A^T[BK, BM],
so the dequantized weight tile is the left operand (it may stay in registers
for Hopper's wgmma) and a handful of tokens fill the narrow right side.

Prepared NVFP4 layout (see `sparkinfer.moe.weights`): 32-bit words of 8
consecutive elements whose bits sit where a rotate-and-mask decode wants them
(NVFP4_WORD_ASM), and one re-encoded scale byte per 16 elements, both tiled:
the BK-element slices of TILE_ROWS consecutive rows for one chunk are one
contiguous block (`tile_slices`), so a program's step reads whole blocks
instead of 64 bytes from each of BN rows. The dot's K
order inside a chunk is `k_order`, not the natural one: each thread of the
wgmma A fragment then decodes whole words of one contiguous run of K (LDS.128,
one scale per 16 elements) straight into its operand registers, and the
activation tile is gathered in the same order (the sum is over the same
elements, in a different order).
"""

import triton
import triton.language as tl

# act codes (constexpr ACT)
ACT_SILU = 0
ACT_RELU2 = 1
ACT_SWIGLU_OAI = 2


# NVFP4 word decode. A prepared word (`sparkinfer.moe.weights.pack_words`) holds
# the 8 consecutive elements 8n..8n+7 of a row; output register j (bf16x2) gets
# elements 8n+2j (low half) and 8n+2j+1 (high half). Each half is laid out as
# sign<<15 | e1<<8 | e0<<7 | m<<6 (E2M1 sign, exponent, mantissa), which as bf16
# is exactly e2m1 * 2**-126 (code 1, 0.5, lands on a bf16 subnormal). The
# word's bits are placed so that register j is a rotation of the word under the
# mask 0x81C081C0, except register 3, which takes bits 6 and 22 from one
# rotation and the rest from the word itself: 4 rotations + 5 masks.
# Multiplying by the bf16 pair s * 2**118 (`scale_pair`) gives e2m1 * s * 2**-8
# exactly (<= 6 significant bits, >= 2**-18); the caller folds 2**8 into the
# global scale.
# Plain Python values for `sparkinfer.moe.weights` (which places the bits), and the
# same as constexprs for the kernels.
NVFP4_WORD_ROT = (2, 6, 12, 24)  # rotate-left of registers 0..3 (register 3: bits 6, 22 only)
NVFP4_WORD_MASK = 0x81C081C0  # sign<<15 | mag<<6 in both halves
NVFP4_WORD_MASK3 = 0x81808180  # register 3's bits taken from the word itself
WORD_ROT = tl.constexpr(NVFP4_WORD_ROT)
WORD_MASK = tl.constexpr(NVFP4_WORD_MASK - (1 << 32))  # as int32
WORD_MASK3 = tl.constexpr(NVFP4_WORD_MASK3 - (1 << 32))
WORD_MASK3_ROT = tl.constexpr(NVFP4_WORD_MASK ^ NVFP4_WORD_MASK3)
DECODE_UNSCALE = tl.constexpr(256.0)  # 2**8, folded into the expert's global scale
# Rows per tile of the prepared NVFP4 layout. Rows stored as 64-byte slices
# (one per row per step) ran at 48% / 57% of the HBM floor (DeepSeek-V3 shape,
# M 1 / 8) where 64-row blocks of contiguous slices ran at 58% / 71%
# (H200 A/B at 6902a06, benchmarks/results/sweeps/moe_layout_ab_h200.json).
NVFP4_TILE_ROWS = 64
TILE_ROWS = tl.constexpr(NVFP4_TILE_ROWS)

NVFP4_WORD_ASM = tl.constexpr("""
{
.reg .b32 a, b, c, d;
shf.l.wrap.b32 a, $4, $4, 2;
shf.l.wrap.b32 b, $4, $4, 6;
shf.l.wrap.b32 c, $4, $4, 12;
shf.l.wrap.b32 d, $4, $4, 24;
and.b32 a, a, 0x81C081C0;
and.b32 b, b, 0x81C081C0;
and.b32 c, c, 0x81C081C0;
and.b32 $3, $4, 0x81808180;
lop3.b32 d, $3, d, 0x00400040, 0xF8;
mul.rn.bf16x2 $0, a, $5;
mul.rn.bf16x2 $1, b, $5;
mul.rn.bf16x2 $2, c, $5;
mul.rn.bf16x2 $3, d, $5;
}
""")


@triton.jit
def scale_pair(b_c):
    """Prepared scale codes (int32, 0..255) -> int32 holding the bf16 pair (S, S),
    S = s * 2**118: bits (c << 4) + (236 << 7) in each half (one IMAD)."""
    return b_c * 0x00100010 + 0x76007600


@triton.jit
def _rotl(x, r: tl.constexpr):
    u = x.to(tl.uint32, bitcast=True)
    return ((u << r) | (u >> (32 - r))).to(tl.int32, bitcast=True)


@triton.jit
def _halves(r):
    """int32 [..] holding a bf16 pair -> bf16 [.., 2] (low half first)."""
    lo = r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (r >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _scaled(r, b_sf):
    """bf16 pair bits r times the fp32 scale b_sf, as bf16 [.., 2]. The fp32
    products are exact and >= 2**-18; the factors are read as fp32 bits, since
    the interpreter's bf16 -> fp32 conversion drops subnormals (code 1 is one)."""
    lo = (r << 16).to(tl.float32, bitcast=True) * b_sf
    hi = (r & -65536).to(tl.float32, bitcast=True) * b_sf
    return tl.join(lo, hi).to(tl.bfloat16)


@triton.jit
def k_order(BK: tl.constexpr, NVFP4: tl.constexpr):
    """Reduction element (within a BK chunk) of each logical k of the dot: the
    weight operand's K order, which the activation tile is loaded in too.

    bf16: natural. NVFP4: k = q0 + 2c + 8 j0 + 16 j1 + 32 u (c = lane % 4 of the
    wgmma A fragment) reads element (BK/4) c + 8u + 4 j1 + 2 j0 + q0, so a
    thread's elements of one row are one contiguous BK/4 run (its prepared
    words, and at most two scale groups), and pairs stay adjacent (4-byte
    activation loads)."""
    k = tl.arange(0, BK)
    if NVFP4:
        return _nvfp4_element(k, BK)
    else:
        return k


@triton.jit
def _nvfp4_element(k, CH: tl.constexpr):
    """The element of a CH chunk that NVFP4's logical k reads (`k_order`)."""
    return (CH // 4) * ((k // 2) % 4) + 2 * (k // 8) + k % 2


@triton.jit
def step_k_order(o_k, c, BK: tl.constexpr, CH: tl.constexpr):
    """Offsets from c * BK of the reduction elements that step c of BK (dividing CH)
    reads: o_k, or, CH > 0, NVFP4's `k_order` within chunks of CH. The NVFP4
    dequantized path stores its bf16 copies in that order (`nvfp4_dequant_kernel`),
    so its bf16 steps sum a chunk's products in the NVFP4 kernels' order; FC1
    gathers x at these offsets to match. BK is a multiple of 32, so the step's
    first logical k f (a multiple of BK) only shifts the elements by f/4: the
    offsets are a constant pattern plus -3f/4, a multiple of 8 (told to Triton:
    without it the pairs' alignment is unknown and FC1's x tiles compiled to
    synchronous loads, 48 KB less staged, tests/moe/test_compile_sm90.py)."""
    if CH > 0:
        first = (c * BK) % CH  # this step's first logical k in its chunk
        return _nvfp4_element(tl.arange(0, BK), CH) + tl.multiple_of(first // 4 - first, 8)
    else:
        return o_k


@triton.jit
def k_position(j, CH: tl.constexpr):
    """Where column j of FC1's output goes in the dequantized path's FC2 input: at
    the logical k whose element it is within its chunk of CH (`k_order` inverted:
    element (CH/4) c + 8u + 4 j1 + 2 j0 + q0 -> k = q0 + 2c + 8 j0 + 16 j1 + 32u).
    FC2 then reads its input in natural order beside copies in `k_order` (TMA
    loads, no gather: a [64, 128] gather of int64 pointers spilled FC2 100 bytes at BM 128)."""
    el = j % CH
    r = el % (CH // 4)
    k = r % 2 + 2 * (el // (CH // 4)) + 8 * ((r // 2) % 2) + 16 * ((r // 4) % 2) + 32 * (r // 8)
    return j - el + k


@triton.jit
def rows_in_k_order(b, CH: tl.constexpr):
    """b [BN, BM] (BN a multiple of CH) with each chunk's rows reordered so that row
    k holds the row of element k_order(k): stored in natural order, each column j
    lands at `k_position(j)`. A shuffle in registers where per-element positions cost
    FC1 (BM 128, BN 128 at Qwen3-30B-A3B's dims, sm_90) a 180-byte spill."""
    BN: tl.constexpr = b.shape[0]
    BM: tl.constexpr = b.shape[1]
    b = tl.reshape(b, [BN // CH, 4, CH // 32, 2, 2, 2, BM])  # (chunk, c, u, j1, j0, q0, BM)
    return tl.reshape(tl.permute(b, (0, 2, 3, 4, 1, 5, 6)), [BN, BM])  # k = q0 + 2c + 8 j0 + 16 j1 + 32 u


@triton.jit
def tile_slices(o_n, c, num_chunks):
    """Position of rows `o_n`' slices of chunk c in the tiled NVFP4 layout, in
    slices (one slice: one row's BK elements of one chunk): blocks of TILE_ROWS
    rows, each block's chunks in order, each chunk's TILE_ROWS slices in row
    order (`sparkinfer.moe.weights.tile_rows`)."""
    return ((o_n // TILE_ROWS) * num_chunks + c) * TILE_ROWS + o_n % TILE_ROWS


@triton.jit
def load_scales(p_s, o_n, m_n, c, num_chunks, BK: tl.constexpr):
    """Prepared scale codes [len(o_n), BK/16] of rows o_n (masked by m_n) and
    chunk c (reduction elements c*BK..(c+1)*BK) of one expert's tiled scales.

    One load of whole scale slices (8 contiguous bytes at BK 128) is what lets
    Triton's pipeliner turn it into cp.async stages like the codes: it needs
    >= 4 bytes per thread, so callers load >= 512 bytes at 4 warps (1024 at 8).
    Smaller loads stay a synchronous ld.global, one HBM round trip per step.
    """
    o_s = tl.arange(0, BK // 16)
    p_tile = p_s + tile_slices(o_n, c, num_chunks)[:, None] * (BK // 16) + o_s[None, :]
    return tl.load(p_tile, mask=m_n[:, None], other=0)


@triton.jit
def load_scales_2(p_s, row0, n_rows, offset, c, num_chunks, BN: tl.constexpr,
                  BK: tl.constexpr):
    """Scale codes of rows row0..row0+BN and the same rows + offset (gate and up),
    rows >= n_rows masked, as one [2BN, BK/16] load (twice the bytes per thread
    of two loads), returned as two [BN, BK/16] tiles."""
    o_2 = tl.arange(0, 2 * BN)
    r = row0 + o_2 % BN
    b_s = load_scales(p_s, r + (o_2 // BN) * offset, r < n_rows, c, num_chunks, BK)
    return tl.split(tl.permute(tl.reshape(b_s, [2, BN, BK // 16]), (1, 2, 0)))


@triton.jit
def nvfp4_tile(p_w, b_c, o_n, m_n, c, num_chunks, BN: tl.constexpr, BK: tl.constexpr,
               PTX_DECODE: tl.constexpr, INTERPRET: tl.constexpr):
    """NVFP4 weight tile [BN, BK] in `k_order`, times 2**-8 (see NVFP4_WORD_ASM).

    Each thread loads its prepared words with LDS.128 and decodes them into the
    wgmma A registers with no layout conversion. Measured on the sm_90a SASS of
    the micro FC1 loop at Mixtral dims (benchmarks/sweeps/nvfp4_decode_sweep.py,
    128 weights per thread per step): 426 instructions per step (3.3 per weight,
    everything included) with the asm, 669 with the integer-op path; the old
    chunk-interleave decodes took 1064 (ptx) and 1368 (arith).
    """
    NW: tl.constexpr = BK // 8  # prepared words per row and chunk
    U: tl.constexpr = BK // 32  # words per wgmma lane quad and row
    o_w = tl.arange(0, NW)
    p_words = (p_w.to(tl.pointer_type(tl.int32)) + tile_slices(o_n, c, num_chunks)[:, None] * NW
           + o_w[None, :])
    b_w = tl.load(p_words, mask=m_n[:, None], other=0)  # [BN, NW]
    b_sp = scale_pair(b_c.to(tl.int32))  # [BN, BK/16]: two words per scale group
    b_sp = tl.reshape(tl.broadcast_to(b_sp[:, :, None], [BN, NW // 2, 2]), [BN, NW])
    if INTERPRET or not PTX_DECODE:
        b_sf = (b_sp << 16).to(tl.float32, bitcast=True)  # S as fp32
        r0 = _rotl(b_w, WORD_ROT[0]) & WORD_MASK
        r1 = _rotl(b_w, WORD_ROT[1]) & WORD_MASK
        r2 = _rotl(b_w, WORD_ROT[2]) & WORD_MASK
        r3 = (b_w & WORD_MASK3) | (_rotl(b_w, WORD_ROT[3]) & WORD_MASK3_ROT)
        h0 = _scaled(r0, b_sf)
        h1 = _scaled(r1, b_sf)
        h2 = _scaled(r2, b_sf)
        h3 = _scaled(r3, b_sf)
    else:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(
            NVFP4_WORD_ASM, "=r,=r,=r,=r,r,r", [b_w, b_sp], dtype=(tl.int32,) * 4,
            is_pure=True, pack=1)
        h0 = _halves(r0)
        h1 = _halves(r1)
        h2 = _halves(r2)
        h3 = _halves(r3)
    w = tl.join(tl.join(h0, h1), tl.join(h2, h3))  # [BN, NW, 2 (q0), 2 (j0), 2 (j1)]
    w = tl.reshape(w, [BN, 4, U, 2, 2, 2])
    return tl.reshape(tl.permute(w, (0, 2, 5, 4, 1, 3)), [BN, BK])


@triton.jit
def weight_tile(p_w, b_s, o_n, m_n, c, stride_w, num_chunks,
                BN: tl.constexpr, BK: tl.constexpr, NVFP4: tl.constexpr, FP8: tl.constexpr,
                PTX_DECODE: tl.constexpr, INTERPRET: tl.constexpr):
    """Weight tile [BN, BK] of rows `o_n` [BN] (masked by m_n) and chunk c (reduction elements
    c*BK..(c+1)*BK) in `k_order`, as the dot's left operand.

    bf16 / FP8: p_w -> bf16 / e4m3 [N, R] of one expert, stride_w = R; b_s and
    num_chunks are ignored; bf16 tiles are bf16 operands (`dot_operand`), e4m3
    tiles e4m3 (fp32 values under the interpreter, `kernels/fp8.py`).
    NVFP4: p_w -> one expert's tiled prepared words (num_chunks
    = R / BK chunks per row; stride_w is ignored); b_s: the rows' prepared
    scale codes [BN, BK/16] of this step (`load_scales`). Returns e2m1 * e4m3 * 2**-8
    exactly (bf16 holds it); the caller multiplies its fp32 accumulator by the
    expert's global scale * DECODE_UNSCALE.
    PTX_DECODE selects `NVFP4_WORD_ASM` on the GPU; otherwise (and always under
    the interpreter, which cannot run PTX) the same bit operations run as Triton
    integer ops and an fp32 multiply. Both are exact, so both give the same bits.
    """
    if NVFP4:
        w = dot_operand(nvfp4_tile(p_w, b_s, o_n, m_n, c, num_chunks, BN, BK, PTX_DECODE,
                                   INTERPRET), INTERPRET)
    else:
        o_k = tl.arange(0, BK)
        p_tile = p_w + o_n[:, None] * stride_w + c * BK + o_k[None, :]
        w = tl.load(p_tile, mask=m_n[:, None], other=0.0)
        if FP8:
            if INTERPRET:
                w = w.to(tl.float32)
        else:
            w = dot_operand(w.to(tl.bfloat16), INTERPRET)
    return w


@triton.jit
def dot_operand(x, INTERPRET: tl.constexpr):
    """bf16 tensor-core operand on the GPU; fp32 under the Triton interpreter,
    whose bf16 tl.dot is not exact (values are bf16 already, so fp32 loses nothing)."""
    if INTERPRET:
        return x.to(tl.float32)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _recip_one_plus_exp(x, INTERPRET: tl.constexpr):
    """1 / (1 + exp(x)) in fp32 (the sigmoid of -x). GPU: ex2.approx.ftz and
    rcp.approx.ftz (one MUFU each, 2**-22 and 1 ulp relative error) instead of
    tl.sigmoid's exp with denormal handling and IEEE division: FC2's fused
    split-sum + activation loop (DeepSeek-V3 dims, T 1, 2 FC1 splits, ptx decode)
    went from 624 to 511 SASS instructions per step
    (benchmarks/sweeps/nvfp4_decode_sweep.py). Deterministic either way."""
    if INTERPRET:
        return 1.0 / (1.0 + tl.exp(x))
    else:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f",
                                      [x * 1.4426950408889634], dtype=tl.float32,
                                      is_pure=True, pack=1)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def activation(g, u, ACT: tl.constexpr, alpha, limit, INTERPRET: tl.constexpr):
    """Elementwise activation in fp32. u is ignored for relu2 (not gated)."""
    if ACT == 0:
        return g * u * _recip_one_plus_exp(-g, INTERPRET)
    elif ACT == 1:
        r = tl.maximum(g, 0.0)
        return r * r
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return gc * (uc + 1.0) * _recip_one_plus_exp(-alpha * gc, INTERPRET)


@triton.jit
def micro_rows(p_ids, i_r, T, E: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
               KP: tl.constexpr, RP: tl.constexpr):
    """Routed rows of the `micro` program for route slot i_r (no sort).

    The program owns expert e = ids[i_r] when i_r is the first slot naming
    e (so each active expert's weights are read once); rows are the T <= BM
    tokens, row t active when e is among its top-k. Returns (e or -1 when the
    program has nothing to do, route index t*K + k per row or -1).
    """
    o_r = tl.arange(0, RP)
    b_all = tl.load(p_ids + o_r, mask=o_r < T * K, other=-1)
    e = tl.load(p_ids + i_r)
    first = tl.min(tl.where(b_all == e, o_r, RP), axis=0)
    own = (first == i_r) & (e >= 0) & (e < E)
    o_t = tl.arange(0, BM)
    o_k = tl.arange(0, KP)
    m_tk = (o_t[:, None] < T) & (o_k[None, :] < K)
    b_ids = tl.load(p_ids + o_t[:, None] * K + o_k[None, :], mask=m_tk, other=-1)
    k_t = tl.max(tl.where(b_ids == e, o_k[None, :], -1), axis=1)  # [BM]
    route = tl.where((k_t >= 0) & own, o_t * K + k_t, -1)
    return tl.where(own, e, -1), route


@triton.jit
def program_rows(p_ids, p_sorted, p_tile_e, i_m, T, E: tl.constexpr, K: tl.constexpr,
                 BM: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr, MICRO: tl.constexpr,
                 TILE_M: tl.constexpr = 0):
    """(expert or -1, route per row or -1, row index of the program's A/output rows)
    of GEMM program i_m: MICRO, route slot i_m (`micro_rows`; rows are indexed by
    route); else sorted tile i_m (`tile_expert`, `sorted_route`), or with TILE_M > 0
    (sorted tiles of TILE_M rows, BM dividing it) the BM rows from i_m * BM, of the expert
    of their tile, -1 where they are all padding."""
    if MICRO:
        e, route = micro_rows(p_ids, i_m, T, E, K, BM, KP, RP)
        o_row = route
    else:
        o_row = i_m * BM + tl.arange(0, BM)
        route = tl.load(p_sorted + o_row)
        if TILE_M > 0:
            e = tl.load(p_tile_e + (i_m * BM) // TILE_M)
            e = tl.where(tl.max(route, axis=0) >= 0, e, -1)
        else:
            e = tl.load(p_tile_e + i_m)
    return e, route, o_row


@triton.jit
def grouped_ids(N, BN: tl.constexpr, GROUP: tl.constexpr):
    """(tile, weight block) of this grouped program. GROUP 0: the grid's two axes.
    GROUP G: a 1-D grid of tiles x cdiv(N, BN) blocks, walked in groups of G
    consecutive tiles times every block, tiles first inside a group (TileConfig.group_m)."""
    if GROUP == 0:
        return tl.program_id(0), tl.program_id(1)
    nb = tl.cdiv(N, BN)
    pid = tl.program_id(0)
    per_group = GROUP * nb
    first = (pid // per_group) * GROUP
    size = tl.minimum(tl.num_programs(0) // nb - first, GROUP)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def tma_weight_tile(d_w, e_w, row0, c, BN: tl.constexpr, BK: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Weight tile [BN, BK] of expert e_w, rows row0.., reduction elements c*BK..
    through the TMA descriptor d_w over [E, N, R] (block [1, BN, BK]; rows past N
    read as zeros) as the dot's left operand (fp32 values under the interpreter)."""
    w = tl.reshape(d_w.load([e_w, row0, c * BK]), [BN, BK])
    if INTERPRET:
        w = w.to(tl.float32)
    return w


@triton.jit
def step_weight_tile(d_w, e_w, p_we, b_s, row0, o_n, m_n, c, stride_w, num_chunks,
                     BN: tl.constexpr, BK: tl.constexpr, NVFP4: tl.constexpr, FP8: tl.constexpr,
                     PTX_DECODE: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr):
    """A K step's weight tile [BN, BK] of rows row0.. (= o_n) of expert e_w: through the TMA
    descriptor d_w (`tma_weight_tile`) or the per-thread loads of `weight_tile` from p_we."""
    if TMA:
        return tma_weight_tile(d_w, e_w, row0, c, BN, BK, INTERPRET)
    else:
        return weight_tile(p_we, b_s, o_n, m_n, c, stride_w, num_chunks, BN, BK, NVFP4, FP8,
                           PTX_DECODE, INTERPRET)


@triton.jit
def split_chunks(i_s, chunks_per_split, num_chunks):
    """[lo, hi) chunks of reduction split i_s. The runner's split maths gives
    every split at least one chunk; saying so (tl.assume) removes the loop's
    zero-trip path, which made ptxas serialize every wgmma (its note C7515)."""
    c_lo = i_s * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, num_chunks)
    tl.assume(c_hi > c_lo)
    return c_lo, c_hi
