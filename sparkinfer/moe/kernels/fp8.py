"""FP8 block-scaled (W8A8) helpers of the MoE GEMM kernels: activation group
quantization, E4M3 loads and stores, and the per-block scaled dot.

Legend: BN weight rows per tile, BM routed rows per tile, BK = G = 128
reduction elements per step (one weight scale block, one activation group).
Names follow kernels/common.py (`p_` pointers, `o_` offsets, `m_` masks, `b_`
block values).

Numerics (`sparkinfer.quant.fp8` is the torch definition): an activation group
of 128 elements gets s = max(amax, ACT_AMIN) / 448 and q = e4m3(x * (1 / s)),
both divisions correctly rounded (div.rn.f32, once per group: a div.rn per
element is a long instruction sequence, and FC1's epilogue at BM 128 spilled
with it), the conversion nearest-even and saturating
(cvt.rn.satfinite.e4m3x2.f32 on sm_90). A K step multiplies the
fp32 result of one e4m3 x e4m3 tensor-core dot by w_scale[row block, k block]
* a_scale[row, k block] and adds it to the fp32 accumulator (the scales change
every 128 elements of K, so they cannot ride inside the MMA accumulation as
they are).

RESCALE (TileConfig.fp8_rescale, `rescaled_dot`; plan.FP8_RESCALE, on): the
accumulator is kept in units of the latest step's scale, per routed row: before a
step it is multiplied by (previous scale / this scale) and the step's MMAs, summed
from zero, are added to it; the end multiplies by the last scale (`rescaled_sum`).
ROWS (grouped tiles of BM >= 64, `TileConfig.rows_on_mma_m`): the accumulator is
[BM, BN], the routed rows on the MMA's M side, so a row's scale is a register or
two of each thread's accumulator rows instead of a vector across its columns
(swap-AB puts the rows on N), and the dot's lowering adds the step's partial. For
sm_90 at Qwen3-30B-A3B's dims, BM 128, compiled on the CPU
(tests/moe/test_compile_sm90.py): FC1 in one pass 248 registers and no spill, FC2
166 and none, where the scaled dot in swap-AB spills 1,172 and 216 bytes
(plan.FP8_MAX_BLOCK_M). The sums round differently (the accumulator is rescaled
each step), so a plan takes RESCALE for every token count or none.

The Triton interpreter converts fp32 to fp8e4nv wrongly (500 -> 256, 464 ->
NaN, 17 -> 18, subnormals to 0: checked on Triton 3.6), and its dots are
numpy's, so under INTERPRET the rounding is done here in fp32 arithmetic
(`_e4m3_round`) and operands stay fp32; the values (and stored bytes) are
those of the GPU path. Its fp8 -> fp32 conversion is exact for every finite
code, so loads use it.
"""

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
ACT_AMIN = tl.constexpr(1e-12)  # sparkinfer.quant.fp8.ACT_AMIN
RNE_SHIFTER = tl.constexpr(8388608.0)  # 2**23: x + 2**23 - 2**23 rounds 0 <= x < 2**22 to even


@triton.jit
def _e4m3_parts(y):
    """|y| (already within +-448) as (e, n): value = n * 2**(e - 3), e >= -6 the
    binade (-6 for subnormals), n = the rounded multiple of the binade's step
    (8..16 for normals; 16 means the next binade, mantissa 0)."""
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    n = (a / step + RNE_SHIFTER) - RNE_SHIFTER  # exact division by a power of two
    return e, n


@triton.jit
def _e4m3_round(y):
    """fp32 value of y (within +-448) rounded to E4M3, nearest even (interpreter)."""
    e, n = _e4m3_parts(y)
    v = n * ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    # * -1.0, not -v: the interpreter negates as 0 - v, which turns a rounded-away
    # negative (-0 on the GPU) into +0
    return tl.where(y < 0, v * -1.0, v)


@triton.jit
def _e4m3_code(v):
    """E4M3 byte of an fp32 value that E4M3 holds exactly: exponent field e + 7
    and 3 mantissa bits are (e + 6) * 8 + n for n in 8..16 (and n < 8 for
    subnormals, e = -6), sign in bit 7."""
    e, n = _e4m3_parts(v)
    code = (e + 6) * 8 + n.to(tl.int32)
    # the sign bit, not v < 0: a negative value rounded to zero is -0 (0x80) on the GPU
    return (tl.where(v.to(tl.int32, bitcast=True) < 0, code | 0x80, code)).to(tl.uint8)


@triton.jit
def group_scales(amax):
    """Per-group amax fp32 [BM] -> (s: the dequantizing scales, 1 / s), both divisions
    correctly rounded, once per group."""
    b_s = tl.math.div_rn(tl.maximum(amax, ACT_AMIN), E4M3_MAX)
    return b_s, tl.math.div_rn(1.0, b_s)


@triton.jit
def quantize_with(b_x, b_r, INTERPRET: tl.constexpr):
    """fp32 [rows, BM] times each column's 1 / s (`group_scales`), clamped, to e4m3 (its
    fp32 values under INTERPRET)."""
    y = b_x * b_r[None, :]
    y = tl.minimum(tl.maximum(y, -E4M3_MAX), E4M3_MAX)
    if INTERPRET:
        return _e4m3_round(y)
    else:
        return y.to(tl.float8e4nv)


@triton.jit
def quantize_groups(b_x, INTERPRET: tl.constexpr):
    """fp32 [G, BM], one 128-element group per column -> (q [G, BM]: e4m3, or
    its fp32 values under INTERPRET; s fp32 [BM]: the dequantizing scales)."""
    b_s, b_r = group_scales(tl.max(tl.abs(b_x), axis=0))
    return quantize_with(b_x, b_r, INTERPRET), b_s


@triton.jit
def load_e4m3(p_tile, mask, INTERPRET: tl.constexpr):
    """E4M3 tile at pointers p_tile (0 where masked) as a dot operand: e4m3 on
    the GPU, its exact fp32 values under the interpreter."""
    b = tl.load(p_tile, mask=mask, other=0.0)
    if INTERPRET:
        return b.to(tl.float32)
    else:
        return b


@triton.jit
def store_e4m3(p_base, offsets, b_q, mask, INTERPRET: tl.constexpr):
    """Store `quantize_groups` values at p_base (an e4m3 pointer) + offsets."""
    if INTERPRET:
        tl.store(p_base.to(tl.pointer_type(tl.uint8)) + offsets, _e4m3_code(b_q), mask=mask)
    else:
        tl.store(p_base + offsets, b_q, mask=mask)


@triton.jit
def act_operand(p_a, o_rows, m_row, o_k, c, stride_a, BK: tl.constexpr, FP8: tl.constexpr,
                QUANTIZE: tl.constexpr, INTERPRET: tl.constexpr):
    """Activation tile [BK, BM] of rows o_rows (masked by m_row), reduction
    elements c*BK + o_k, as the dot's right operand, and its scales [BM].

    Not FP8: bf16 rows (scales: a placeholder). FP8 and QUANTIZE: bf16 rows
    quantized here (`quantize_groups`; BK is the 128-element group). FP8: e4m3
    rows, whose scales the caller loads (`step_scales`)."""
    p_tile = p_a + o_rows[None, :].to(tl.int64) * stride_a + c * BK + o_k[:, None]
    b_as = 0
    if FP8 and QUANTIZE:
        b_a, b_as = quantize_groups(tl.load(p_tile, mask=m_row[None, :], other=0.0).to(
            tl.float32), INTERPRET)
    elif FP8:
        b_a = load_e4m3(p_tile, m_row[None, :], INTERPRET)
    else:
        b_a = tl.load(p_tile, mask=m_row[None, :], other=0.0)
        if INTERPRET:  # interpreted bf16 dots are not exact; the values are bf16 already
            b_a = b_a.to(tl.float32)
    return b_a, b_as


@triton.jit
def step_scales(p_se, row0, row1, p_as, o_rows, m_row, c, num_chunks, BK: tl.constexpr,
                TWO: tl.constexpr, LOAD_AS: tl.constexpr):
    """FP8 scales of K step c: the weight block scales of the tiles starting at
    rows row0 and (TWO) row1 (a tile of <= 128 rows aligned to its size lies in
    one block: scalars), and (LOAD_AS) the activation scales of rows o_rows
    from p_as [rows, num_chunks]. Placeholders (0) for what is not loaded.

    The kernels load these one step ahead and carry them in registers: no cp.async
    stage carries them (Triton pipelines only loads that feed a dot's operands;
    sm_90 TTGIR of moe_fc2_kernel at DeepSeek-V3 dims shows them as plain loads
    after the stage wait), so loaded in their own step each would add a global
    memory round trip to every step."""
    b_w0 = tl.load(p_se + (row0 // BK) * num_chunks + c)
    b_w1 = 0.0
    if TWO:
        b_w1 = tl.load(p_se + (row1 // BK) * num_chunks + c)
    b_as = 0
    if LOAD_AS:
        b_as = tl.load(p_as + o_rows.to(tl.int64) * num_chunks + c, mask=m_row, other=0.0)
    return b_w0, b_w1, b_as


@triton.jit
def scaled_dot(b_w, b_a, b_acc, b_scale, FP8: tl.constexpr):
    """b_acc + W @ A: FP8, one K block's dot times b_scale [BM] (w_scale *
    a_scale of each column; the tile's rows share one weight block); else the
    tensor-core accumulation itself (b_scale ignored)."""
    if FP8:
        b_acc += tl.dot(b_w, b_a) * b_scale[None, :]
    else:
        b_acc = tl.dot(b_w, b_a, b_acc)
    return b_acc


@triton.jit
def fp8_acc(BN: tl.constexpr, BM: tl.constexpr, ROWS: tl.constexpr):
    """(a zero accumulator, [BM, BN] with ROWS else [BN, BM]; its units [BM], ones)."""
    if ROWS:
        b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    else:
        b_acc = tl.zeros([BN, BM], dtype=tl.float32)
    return b_acc, tl.full([BM], 1.0, dtype=tl.float32)


@triton.jit
def rescaled_dot(b_w, b_a, b_acc, b_unit, b_scale, ROWS: tl.constexpr):
    """RESCALE's K step (module docstring): b_acc (in units b_unit [BM]) brought to this
    step's scales b_scale [BM], W [BN, BK] @ A [BK, BM] accumulated into it by the MMA.
    A scale of 0 (a weight block of zeros, whose dot is 0) keeps the unit. Returns
    (b_acc, its units)."""
    b_c = tl.where(b_scale == 0.0, b_unit, b_scale)
    b_r = b_unit / b_c
    # Each step's MMAs sum from zero and that partial is added to the fp32 accumulator (the
    # scaled dot's precision). Inside the MMA accumulation (Triton's sm_90 default,
    # max_num_imprecise_acc 2**30) the whole K summed in Hopper's FP8 accumulator, of about
    # 14 bits of mantissa: an H100 at 884c46a gave Qwen3-30B-A3B's layer a relative error of
    # 1.08e-2 (T 1; the fp8_block bound 1e-2) and failed 11 of tests/moe/test_gpu.py's fp8
    # cases. ROWS (grouped) lets the dot's lowering add the partial (max_num_imprecise_acc =
    # BK): the same sum, timed on an H100 at 79e4281 (plan.FP8_RESCALE). The swap-AB micro
    # tiles add a fresh dot themselves: there that lowering waits on each m64 half of the
    # tile in turn, and Qwen3-30B-A3B at T 1 took 41.4 us against the scaled dot's 35.9.
    if ROWS:
        b_acc = tl.dot(tl.trans(b_a), tl.trans(b_w), b_acc * b_r[:, None],
                       max_num_imprecise_acc=b_w.shape[1])
    else:
        b_acc = b_acc * b_r[None, :] + tl.dot(b_w, b_a)
    return b_acc, b_c


@triton.jit
def rescaled_sum(b_acc, b_unit, ROWS: tl.constexpr):
    """The fp32 sum [BN, BM] of a RESCALE accumulator."""
    if ROWS:
        b_sum = tl.trans(b_acc * b_unit[:, None])
    else:
        b_sum = b_acc * b_unit[None, :]
    return b_sum


@triton.jit
def store_act(p_out, p_os, b_h, o_row, m_row, o_n, m_n, i_n, n_groups, stride_or,
              FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """Store the activation tile b_h fp32 [BN, BM] (rows o_n, routed rows o_row)
    as FC2's input: bf16, or (FP8, BN = 128: one group per column) e4m3 with
    its scale at p_os[o_row, i_n] (scales [rows, n_groups])."""
    m_out = m_n[:, None] & m_row[None, :]
    o_out = o_row[None, :].to(tl.int64) * stride_or + o_n[:, None]
    if FP8:
        b_q, b_s = quantize_groups(b_h, INTERPRET)
        store_e4m3(p_out, o_out, b_q, m_out, INTERPRET)
        tl.store(p_os + o_row.to(tl.int64) * n_groups + i_n, b_s, mask=m_row)
    else:
        tl.store(p_out + o_out, b_h.to(p_out.dtype.element_ty), mask=m_out)


@triton.jit
def store_act_pair(p_out, p_os, b_h0, b_h1, o_row, m_row, o_n0, o_n1, m_n0, m_n1, i_n, n_groups,
                   stride_or, INTERPRET: tl.constexpr):
    """`store_act` (FP8) of one activation group computed in two halves, b_h0 (rows o_n0)
    and b_h1 (rows o_n1), fp32 [G/2, BM] each: the group's amax is the larger of the
    halves' (max is exact), so the stored bytes and scale are those of the whole group."""
    amax = tl.maximum(tl.max(tl.abs(b_h0), axis=0), tl.max(tl.abs(b_h1), axis=0))
    b_s, b_r = group_scales(amax)
    o_r = o_row[None, :].to(tl.int64) * stride_or
    store_e4m3(p_out, o_r + o_n0[:, None], quantize_with(b_h0, b_r, INTERPRET),
               m_n0[:, None] & m_row[None, :], INTERPRET)
    store_e4m3(p_out, o_r + o_n1[:, None], quantize_with(b_h1, b_r, INTERPRET),
               m_n1[:, None] & m_row[None, :], INTERPRET)
    tl.store(p_os + o_row.to(tl.int64) * n_groups + i_n, b_s, mask=m_row)
