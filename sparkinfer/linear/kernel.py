"""Triton kernel of `linear`: out[M, N] = x[M, K] @ w[N, K].T (+ bias) for M <= 128.

Legend: BN output features per program, BK the K of one streamed step, KS the K
of one program (its slice), S slices per feature block (split K), BM = 16 rows
of x per row block, RB row blocks.

A row's result does not depend on M. The weight tile is the MMA's left operand
([BN, k] x [k, BM]) and x enters in blocks of 16 rows, row r at column r % 16 of
block r // 16, so no product of a block sees another block's rows; every
constant that orders a sum (BN, BK, KS, S, the warps) comes from the weight and
the device (`config.py`), never from M; M is not specialized; with S > 1 each
slice stores its fp32 partial and the last program of the feature block to
finish (a per-block semaphore the caller owns, counted up and reset to zero
here) adds the S partials in slice order, whatever order the programs finished.

Two schedules of one program body (constexpr STREAM; two entry points, so
profiles name them apart), each one fixed sum per element:
- `linear_preload_kernel` (decode projections): the program's whole [BN, KS]
  slice is loaded before `gdc_wait` (EARLY; else after it, for A/B runs:
  `launch.PRELOAD_EARLY`). Nothing in a step writes weights, so these
  loads may run while the predecessor grid still computes x: on an H200 that
  made a 2048 x 2048 GEMV stream at 63% of 4.8 TB/s against 29% for cuBLAS
  (MEASURED.md, 2026-12-03). Each row block of x is then multiplied by the tile
  held in shared memory: the weight is read once at any M. ptxas (sm_90) at
  [64, 512]: 96 registers, 100 KB of shared memory, two programs an SM.
- `linear_stream_kernel` (weights many waves deep, LM heads): the program
  streams its [BN, KS] in [BN, BK] steps through the software pipeline after
  `gdc_wait`, each step multiplied with all RB row blocks (RB fp32 accumulators
  in a tuple). With SLICE (a preload tile's coarse call, config.py) the chain
  starts from zero every SLICE of K and each finished chain is added to the
  program's group sum, so its sums are those of the preload schedule's slices
  and finisher, in the same order (`_finish_split`).

PDL (the launch sets launch_pdl=True): at entry the kernel lets its successor
launch (`gdc_launch_dependents`: a successor launched with PDL must itself wait
before reading what this kernel writes); it waits for its predecessor
(`gdc_wait`) before its first read of x and before any write. Off under the
interpreter, which has no inline assembly.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BM = tl.constexpr(16)  # rows of a row block: the MMA's narrow side (config.BLOCK_M)
# x blocks of the preload schedule loaded at once: 4 x [16, 512] bf16 are 128 registers a
# thread at 4 warps beside the weight slice (8 would spill)
X_GROUP = tl.constexpr(4)


@triton.jit
def _mma(b_w, b_x, b_acc, PRECISION: tl.constexpr):
    """b_acc + b_w [BN, k] @ b_x [k, BM], fp32. PRECISION: "tf32x3" for fp32 weights on
    the GPU, "ieee" under the interpreter (its bf16 dots are fp16 ones: upcast)."""
    if PRECISION == "ieee":
        b_acc = tl.dot(b_w.to(tl.float32), b_x.to(tl.float32), b_acc, input_precision="ieee")
    elif PRECISION == "tf32x3":  # a 16-bit x upcasts exactly
        b_acc = tl.dot(b_w, b_x.to(tl.float32), b_acc, input_precision="tf32x3")
    else:
        b_acc = tl.dot(b_w, b_x, b_acc)
    return b_acc


@triton.jit
def _x_block(p_x, o_k, m_k, r0, M, K, stride_xm, stride_xk, GATED: tl.constexpr, R: tl.constexpr = BM):
    """Rows r0..r0+R of x, columns o_k, as the MMA's right operand [k, R]; rows >= M
    zero. GATED: x holds [gate | up] ([M, 2K]) and the operand is silu(gate) * up,
    rounded as torch's bf16 `F.silu(g) * u` rounds (silu in fp32, rounded; the
    product in fp32, rounded), so a dense MLP's down projection needs no
    activation kernels before it."""
    o_m = r0 + tl.arange(0, R)
    p = p_x + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :] * stride_xk
    m = (o_m < M)[:, None] & m_k[None, :]
    b_x = tl.load(p, mask=m, other=0.0)  # [R, k], 16-byte vectors along K
    if GATED:
        b_g = b_x.to(tl.float32)
        b_s = (b_g / (1.0 + tl.exp(-b_g))).to(b_x.dtype)
        b_u = tl.load(p + K * stride_xk, mask=m, other=0.0)
        b_x = (b_s.to(tl.float32) * b_u.to(tl.float32)).to(b_x.dtype)
    return tl.trans(b_x)  # transposed in shared memory


@triton.jit
def _store_rows(b_acc, o_n, m_n, r0, M, p_b, p_out, stride_om, HAS_BIAS: tl.constexpr, R: tl.constexpr = BM):
    """out[r0..r0+R, o_n] = b_acc [BN, R] (+ bias), rounded once."""
    o_m = r0 + tl.arange(0, R)
    if HAS_BIAS:
        b_acc += tl.load(p_b + o_n, mask=m_n, other=0.0).to(tl.float32)[:, None]
    p = p_out + o_m[None, :].to(tl.int64) * stride_om + o_n[:, None]
    tl.store(p, b_acc.to(p_out.dtype.element_ty), mask=m_n[:, None] & (o_m < M)[None, :])


@triton.jit
def _emit(b_acc, o_n, m_n, r0, M, i_s, p_b, p_out, p_part, stride_om, stride_ps, stride_pn,
          SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, R: tl.constexpr = BM):
    """One block of R rows' sums: the output, or with SPLIT > 1 this slice's fp32 partial
    (part [S, NB * BN, MP]; rows of padded features are written, never read)."""
    if SPLIT > 1:
        o_m = r0 + tl.arange(0, R)
        p = p_part + i_s * stride_ps + o_n[:, None] * stride_pn + o_m[None, :]
        tl.store(p, b_acc, mask=(o_n >= 0)[:, None] & (o_m < M)[None, :])
    else:
        _store_rows(b_acc, o_n, m_n, r0, M, p_b, p_out, stride_om, HAS_BIAS, R)


@triton.jit
def _finish_split(i_n, o_n, m_n, M, p_b, p_out, p_part, p_sync, stride_om, stride_ps, stride_pn,
                  SPLIT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, FR: tl.constexpr):
    """The feature block's last program to finish adds the S partials: each group of
    GROUP consecutive ones in order from zero, then the group sums in order from zero
    (config.py's two-level order; a coarse call's partials are group sums: GROUP 1),
    FR rows at a time (a coarse call: all its rows in one pass, whose loads are in flight
    together; a loop over 16-row blocks paid an L2 round trip per block)."""
    tl.debug_barrier()  # every thread's partial is written before the count goes up
    ticket = tl.atomic_add(p_sync + i_n, 1, sem="acq_rel")
    if ticket == SPLIT - 1:  # the others' partials are visible to it
        for r0 in range(0, M, FR):
            o_m = r0 + tl.arange(0, FR)
            m = (o_n >= 0)[:, None] & (o_m < M)[None, :]
            p = p_part + o_n[:, None] * stride_pn + o_m[None, :]
            b_acc = tl.zeros([o_n.shape[0], FR], dtype=tl.float32)
            b_grp = tl.zeros([o_n.shape[0], FR], dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # unrolled: every load in flight at once
                b_grp += tl.load(p + s * stride_ps, mask=m, other=0.0, cache_modifier=".cg")
                if (s + 1) % GROUP == 0 or s == SPLIT - 1:
                    b_acc += b_grp
                    b_grp = tl.zeros([o_n.shape[0], FR], dtype=tl.float32)
            _store_rows(b_acc, o_n, m_n, r0, M, p_b, p_out, stride_om, HAS_BIAS, FR)
        tl.atomic_xchg(p_sync + i_n, 0)  # zero again for the next call (and graph replay)


@triton.jit
def _linear_program(p_x, p_w, p_b, p_out, p_part, p_sync, M, N, K, k_slice, stride_xm, stride_xk, stride_wn,
                    stride_om, stride_ps, stride_pn, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                    RB: tl.constexpr, STREAM: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr,
                    SLICE: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr,
                    PDL: tl.constexpr, EARLY: tl.constexpr = True):
    """One program of either schedule (the two entry points below name them apart in
    profiles). grid (NB = ceil(N / BN), S). KS: the preloaded slice (preload; =
    k_slice); RB: row blocks (>= ceil(M / BM); a power of two in the preload schedule; blocks past M are
    masked, so their loads and stores do nothing). k_slice: K of a program (a multiple of BK).
    GROUP: the finisher's slices per group; SLICE (stream): the K of one chain from zero
    (0: the program's whole K is one chain; > 0: the RB row blocks are one [k, RB * BM]
    operand, a power of two: an element's products are the same k16 MMA chain at any
    operand width, as gemm.py and the MoE kernels rely on too)."""
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    p_wn = p_w + o_n[:, None].to(tl.int64) * stride_wn
    if PDL:
        gdc_launch_dependents()
    if STREAM:
        if PDL:
            gdc_wait()
        k0 = i_s * k_slice
        k1 = tl.minimum(k0 + k_slice, K)
        if SLICE > 0:  # a coarse call: chains of SLICE folded into the group's sum as they end
            R: tl.constexpr = RB * BM
            b_acc = tl.zeros([BN, R], dtype=tl.float32)
            b_sum = tl.zeros([BN, R], dtype=tl.float32)
            for k in range(k0, k1, BK):
                o_k = k + tl.arange(0, BK)
                m_k = o_k < K
                b_w = tl.load(p_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
                b_x = _x_block(p_x, o_k, m_k, 0, M, K, stride_xm, stride_xk, GATED, R)
                b_acc = _mma(b_w, b_x, b_acc, PRECISION)
                end = ((k + BK - k0) % SLICE == 0) | (k + BK >= k1)
                b_sum = tl.where(end, b_sum + b_acc, b_sum)
                b_acc = tl.where(end, 0.0, b_acc)
            if SPLIT == 1:  # unsplit: the finisher's sum of one group, 0 + the group's sum
                b_sum = tl.zeros([BN, R], dtype=tl.float32) + b_sum
            _emit(b_sum, o_n, m_n, 0, M, i_s, p_b, p_out, p_part, stride_om, stride_ps, stride_pn, SPLIT,
                  HAS_BIAS, R)
        else:
            accs = ()
            for _j in tl.static_range(RB):
                accs = accs + (tl.zeros([BN, BM], dtype=tl.float32),)
            for k in range(k0, k1, BK):
                o_k = k + tl.arange(0, BK)
                m_k = o_k < K
                b_w = tl.load(p_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
                nxt = ()
                for j in tl.static_range(RB):
                    b_x = _x_block(p_x, o_k, m_k, j * BM, M, K, stride_xm, stride_xk, GATED)
                    nxt = nxt + (_mma(b_w, b_x, accs[j], PRECISION),)
                accs = nxt
            for j in tl.static_range(RB):
                _emit(accs[j], o_n, m_n, j * BM, M, i_s, p_b, p_out, p_part, stride_om, stride_ps, stride_pn,
                      SPLIT, HAS_BIAS)
    else:
        o_k = i_s * KS + tl.arange(0, KS)
        m_k = o_k < K
        if PDL and not EARLY:
            gdc_wait()
        b_w = tl.load(p_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)  # [BN, KS]
        if PDL and EARLY:
            gdc_wait()
        # RB row blocks in groups of XG: a group's x blocks are all loaded before its
        # first MMA, so their latencies overlap (a loop of load -> MMA -> store per block
        # paid RB of them in turn: Qwen3-30B-A3B's qkv took 28.9 us at M = 64 against
        # 11.1 at M = 8 in a serving step, step_profile). Each block's products are the
        # same instructions at any RB, so rows keep their bits.
        XG: tl.constexpr = RB if RB < X_GROUP else X_GROUP
        for g in range(0, RB, XG):
            xs = ()
            for j in tl.static_range(XG):
                xs = xs + (_x_block(p_x, o_k, m_k, (g + j) * BM, M, K, stride_xm, stride_xk, GATED),)
            for j in tl.static_range(XG):
                b_acc = _mma(b_w, xs[j], tl.zeros([BN, BM], dtype=tl.float32), PRECISION)
                _emit(b_acc, o_n, m_n, (g + j) * BM, M, i_s, p_b, p_out, p_part, stride_om, stride_ps,
                      stride_pn, SPLIT, HAS_BIAS)
    if SPLIT > 1:
        _finish_split(i_n, o_n, m_n, M, p_b, p_out, p_part, p_sync, stride_om, stride_ps, stride_pn,
                      SPLIT, GROUP, HAS_BIAS, BM * RB if SLICE > 0 else BM)


@triton.jit(do_not_specialize=["M"])
def linear_preload_kernel(p_x, p_w, p_b, p_out, p_part, p_sync, M, N, K, k_slice, stride_xm, stride_xk, stride_wn,
                          stride_om, stride_ps, stride_pn, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                          RB: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr, SLICE: tl.constexpr,
                          HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                          EARLY: tl.constexpr = True):
    _linear_program(p_x, p_w, p_b, p_out, p_part, p_sync, M, N, K, k_slice, stride_xm, stride_xk, stride_wn,
                    stride_om, stride_ps, stride_pn, BN, BK, KS, RB, False, SPLIT, GROUP, SLICE, HAS_BIAS, GATED,
                    PRECISION, PDL, EARLY)


@triton.jit(do_not_specialize=["M"])
def linear_stream_kernel(p_x, p_w, p_b, p_out, p_part, p_sync, M, N, K, k_slice, stride_xm, stride_xk, stride_wn,
                         stride_om, stride_ps, stride_pn, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                         RB: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr, SLICE: tl.constexpr,
                         HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    _linear_program(p_x, p_w, p_b, p_out, p_part, p_sync, M, N, K, k_slice, stride_xm, stride_xk, stride_wn,
                    stride_om, stride_ps, stride_pn, BN, BK, KS, RB, True, SPLIT, GROUP, SLICE, HAS_BIAS, GATED,
                    PRECISION, PDL)
