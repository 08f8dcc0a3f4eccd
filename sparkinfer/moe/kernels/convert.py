"""Format conversions around the MoE GEMMs: FP8 activation quantization (the
grouped FP8 path's x) and NVFP4 -> bf16 weight dequantization (the large-batch
NVFP4 path).

Legend: T tokens, H hidden, G = 128 elements per activation group, N weight
rows, R reduction length, BN rows per program, BK the prepared NVFP4 chunk.
"""

import triton
import triton.language as tl

from sparkinfer.moe.kernels.common import load_scales, nvfp4_tile
from sparkinfer.moe.kernels.fp8 import quantize_groups, store_e4m3


@triton.jit
def moe_quant_kernel(p_x, p_q, p_s, T, stride_x, n_groups, BT: tl.constexpr, G: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """x bf16 [T, H] -> q e4m3 [T, H] (row stride H) and s fp32 [T, H/G], one
    scale per token and group (`kernels/fp8.quantize_groups`). Grid
    (cdiv(T, BT), H / G). The grouped FP8 family quantizes x once here instead
    of in every FC1 program: at BM 128 an FC1 step's quantization (~5
    instructions per element of a 128 x 128 tile, 256 threads) would cost
    about as many issue slots as its two e4m3 128 x 128 x 128 MMAs."""
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_g = tl.arange(0, G)
    k0 = tl.program_id(1) * G
    b_x = tl.load(p_x + o_t[None, :].to(tl.int64) * stride_x + k0 + o_g[:, None],
                  mask=m_t[None, :], other=0.0).to(tl.float32)  # [G, BT]
    b_q, b_s = quantize_groups(b_x, INTERPRET)
    store_e4m3(p_q, o_t[None, :].to(tl.int64) * (n_groups * G) + k0 + o_g[:, None], b_q,
               m_t[None, :], INTERPRET)
    tl.store(p_s + o_t.to(tl.int64) * n_groups + tl.program_id(1), b_s, mask=m_t)


@triton.jit
def nvfp4_dequant_kernel(p_w, p_s, p_out, e_lo, E, N, R, num_chunks, stride_we, stride_se,
                         stride_oe, BN: tl.constexpr, BK: tl.constexpr,
                         PTX_DECODE: tl.constexpr, INTERPRET: tl.constexpr):
    """Experts e_lo + i_e (those < E) of a prepared NVFP4 matrix [E, N, R]
    (tiled words p_w and scale codes p_s, `sparkinfer.moe.weights`) -> bf16
    rows of e2m1 * e4m3 * 2**-8, exact (the GEMM multiplies by the global
    scale * 2**8, as the NVFP4 kernels do), each chunk of BK in the NVFP4
    kernels' K order: out[i_e, n, c * BK + k] = w[n, c * BK + k_order(k)]. FC1's
    bf16 tiles gather x in the same order (`step_k_order`) and store FC2's input
    in it (`k_position`), so every sum is the NVFP4 kernels' own, bit for bit, and
    a batch-invariant plan may take this path at any T (plan.py). Grid
    (experts of the chunk, cdiv(N, BN), R / BK): one chunk of BN rows per
    program, decoded as the GEMMs decode (`nvfp4_tile`), stored as decoded. No
    K loop: the loads have no dot to ride a cp.async pipeline, so many small
    programs keep them in flight; the bf16 writes (2 of the 2.56 bytes moved
    per weight) dominate."""
    e = e_lo + tl.program_id(0)
    if e < E:
        c = tl.program_id(2)
        o_n = tl.program_id(1) * BN + tl.arange(0, BN)
        m_n = o_n < N
        p_we = p_w + e.to(tl.int64) * stride_we
        b_c = load_scales(p_s + e.to(tl.int64) * stride_se, o_n, m_n, c, num_chunks, BK)
        b_w = nvfp4_tile(p_we, b_c, o_n, m_n, c, num_chunks, BN, BK, PTX_DECODE, INTERPRET)
        p_oe = p_out + tl.program_id(0).to(tl.int64) * stride_oe
        o_k = tl.arange(0, BK)
        tl.store(p_oe + o_n[:, None].to(tl.int64) * R + c * BK + o_k[None, :], b_w,
                 mask=m_n[:, None])
