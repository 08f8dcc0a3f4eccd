"""Launch shape of `linear` for one weight on one device: a pure function of
(N, K, element size, SM count), never of M, so a row's sums are the same at any
batch (`kernel.py` says why that suffices).

Legend: N output features, K reduction, BN features per program, KS the K of a
program, S = ceil(K / KS) slices per feature block, NB = ceil(N / BN) feature
blocks, P = NB * S programs.

The choice, by the numbers it rests on (H200, 132 SMs, 4.8 TB/s specified; the
2026-12-03 PDL measurements in shared/MEASURED.md (the design brief's measurements), f64ac5d's split sweep
in benchmarks/results/sweeps/linear_split_sweep_h200.json):
- A decode projection moves a few MB to a few tens of MB: its time is the
  latency until the weight bytes are in flight, plus the slowest SM's share. So
  the preload schedule gives each program one slice of at most PRELOAD_BYTES,
  all of it loaded before the program waits for x, and picks KS to minimise the
  bytes the busiest SM pulls: ceil(P / SMs) x (slice + its partials' traffic).
  MEASURED's best GEMVs had 32 KB per program (2048 x 2048: 2.76 us, 63% of
  4.8 TB/s; 4096 x 4096: 8.92 us, 78%); the cap is twice that because at M = 64
  a slice is reused by 4 row blocks and the partials' traffic (2 x BN x M x 4
  bytes per slice) halves with each doubling of KS.
- A weight whose feature blocks alone fill every SM (LM heads, GLM-4.5-Air's
  qkv and dense gate_up) streams: one program per BN features over all of K,
  BLOCK_K steps STREAM_STAGES deep, each weight step multiplied with every row
  block.
- A weight too deep to preload in at most MAX_SPLIT slices (GLM-4.5-Air's o
  [4096, 12288], dense down [4096, 10944]) streams, split over idle SMs only
  where its blocks fill at most a third of them (f64ac5d: o 27.48 us unsplit,
  27.82 split 2; Qwen3-30B-A3B's o 8.17 split 4 vs 9.33 unsplit).
- The sum order of a preload tile is two-level: K is cut into slices of KS, each
  slice's products are one MMA chain from zero, the slices of a group of
  `group` consecutive slices are added in order, then the groups in order. A
  call of more than COARSE_MIN_ROWS rows runs one program per group instead of
  one per slice ("coarse": the stream schedule over the group's slices, each
  slice's chain folded into the group's sum as it ends), which gives every
  element the same sums in the same order, so the switch follows M freely. It
  exists because the fine split's fp32 partials grow with M: at M = 64 Qwen3-30B-A3B's
  qkv wrote and re-read 21 MB of partials beside its 21 MB of weights (43.8 us
  against cuBLAS's 9.0, sweeps/linear_preload_groups_ab_h200.json, 9c999e1).
  `group` makes about one program per SM in coarse mode (at most
  MAX_GROUPS groups, whose partials the last program adds). Where the fine
  split's programs of 64 KB slices (two an SM) take more than one wave, coarse
  calls serve every M (`coarse_always`): H200 at a9a3eda, M = 1 / 8, fine against
  coarse: Mixtral's qkv 21.7 / 23.6 us against 17.1 / 17.6, its o 14.4 / 15.6 against
  12.5 / 13.2, GLM-4.5-Air's shared gate_up 11.7 / 12.8 against 10.0 / 10.3; one
  wave or less (Qwen3-30B-A3B's o: 7.5 / 8.5 against 8.4 / 9.0), fine is faster
  (sweeps/linear_decode_sweep_h200.json). The same sweep timed other group sizes: one
  wave of programs or fewer was faster where the rule gives about 1.5 (Mixtral's o at
  M = 64: 15.0 us in 2 groups against 20.1 in 3), not adopted on one run.
`benchmarks/sweeps/linear_decode_sweep.py` times the alternatives beside cuBLAS
on every preset's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

__all__ = ["LinearTile", "linear_tile", "BLOCK_N", "BLOCK_M", "MAX_ROWS", "PRELOAD_BYTES", "MAX_SPLIT",
           "COARSE_MIN_ROWS", "COARSE_BLOCK_K", "COARSE_MAX_ROWS", "COARSE_BLOCK_N"]

BLOCK_M = 16  # rows of x per row block (kernel.BM)
# The kernel serves M <= MAX_ROWS (8 row blocks: 8 fp32 [64, 16] accumulators, 64
# registers a thread at 4 warps); larger M (prefill) goes to torch.
MAX_ROWS = 128
BLOCK_N = 64  # one warpgroup's wgmma M side (m64n16k16), 4 warps
# A streamed step: 64 of K, 4 steps in flight (40 KB of shared memory at one row
# block, so several programs share an SM and one's pipeline fill hides behind
# another's stream). 0f9fd66 (linear_sweep_h200.json, GLM-4.5-Air's dense gate_up
# [21888, 4096], M = 1): BN 64 / BK 64 / 4 stages 43.2 us (86% of 4.8 TB/s), BK 128
# / 6 stages 45.6, cuBLAS 47.4; the LM heads are the same regime (many waves).
BLOCK_K = 64
STREAM_STAGES = 4
SMEM_BYTES = 180 * 1024  # of the H200's 227 KiB per SM, what a stream program's stages may take
PRELOAD_BYTES = 64 * 1024
# fp32 weights (GLM-4.5's router) multiply as tf32x3, which keeps each operand's two
# tf32 halves in shared memory: ptxas for sm_90 at [64, 256] 176 KB and 235 registers,
# at [64, 128] 88 KB and 198 (no spills)
PRELOAD_BYTES_FP32 = 32 * 1024
PRELOAD_SLICES = (128, 256, 512)  # KS candidates; a slice is at least one BK step
MAX_SPLIT = 32  # partials the last program adds: 32 x [64, 16] fp32 = 128 KB at most, L2-resident
COST_ROWS = 8  # the decode batch whose partials the preload choice charges (issue 28: B <= 8)
SPLIT_MIN_STEPS = 8  # a streamed slice keeps at least 512 of K (f64ac5d: 4 steps of 128)
# Coarse calls (see the module docstring): above this many rows; a K step of at most
# COARSE_BLOCK_K (any divisor of KS keeps the sums); at most COARSE_MAX_ROWS rows a
# launch (4 row blocks: 2 x 4 fp32 [64, 16] tiles, the chains and the group sums, in
# registers), more rows in launches of that many; MAX_GROUPS groups at most. Coarse from the
# first row (0) on an H100 at 9d3dfae (sweeps/decode_linear_ab_h100.json, Qwen3-30B-A3B step):
# bf16 batch 1 793.0 against 780.5 us, NVFP4 experts 716.3 against 742.7, bf16 batch 8 1,875.6
# against 1,893.1: split by format, so 16 stays until an H200 says more.
COARSE_MIN_ROWS = 16
COARSE_BLOCK_K = 128
COARSE_MAX_ROWS = 64
MAX_GROUPS = 8
# Features per coarse program (4 warps per 64). At 64 rows x is as many bytes a step as a
# [64, k] weight tile, so 128 features (8 warps) would halve what each weight byte drags
# through L2; the sums do not see it (each feature is its own MMA row). 128 failed on the
# H200 at 75d2646 with a partial buffer sized for 64-feature blocks; fixed since and
# timed at 24301af (`linear_decode_sweep.py --shapes qwen3.qkv,qwen3.o,mixtral.o --ms
# 16,32,64`, sweeps/linear_decode_sweep_h200_24301af.json), 128 against 64 features, us:
# Qwen3's qkv 11.0 / 11.6 / 15.6 against 10.2 / 11.1 / 15.9 at M = 16 / 32 / 64, its o
# 9.8 / 11.6 / 15.2 against 9.0 / 10.3 / 10.9, Mixtral's o 14.7 / 16.1 / 20.4 against
# 13.3 / 14.5 / 20.4: never faster beyond noise, so 64 stays.
COARSE_BLOCK_N = 64
# `coarse_always` where the fine split's slices exceed one wave of preloads (2 x PRELOAD_BYTES
# an SM, two 64 KB programs), whatever the slice; False: only slices of more than 32 KB count
# (Qwen3-30B-A3B's qkv, 640 programs of 32 KB, then stays fine below COARSE_MIN_ROWS; no
# other preset's call changes, TP 2 shards included: GLM-4.5-Air's dense down at TP 2 is marked
# too, but gated calls stay fine, COARSE_GATED). The same bits either way. Alone its
# qkv is slower coarse (H100, M = 1: 11.9 against 10.5 us fine), but in the decode step
# faster: H100 A/B at 8f5ed95 (`flags_ab.py`, three rounds of `bench decode --presets
# qwen3-30b-a3b --batches 1,8,64`, sweeps/decode_coarse_small_slices_ab_h100.json), median us
# a step False / True: bf16 batch 1 777.8 / 763.8, batch 8 1,872 / 1,816, batch 64 4,055 /
# 4,062; NVFP4 experts 719.7 / 724.6, 1,117 / 1,085, 2,095 / 2,096 (batch 1 NVFP4 is the one
# row every run of which was slower). Again at 9d3dfae (sweeps/decode_linear_ab_h100.json),
# False: bf16 796.8 / 1,926.6 against 780.5 / 1,893.1 at batch 1 / 8, NVFP4 731.6 against 742.7.
COARSE_SMALL_SLICES = True
# Gated calls (silu(gate) * up computed as x loads) stay on the fine split: H200 at ff3643a,
# GLM-4.5-Air's shared down [4096, 1408] at M = 32 / 64, fine 15.5 / 24.7 us against coarse
# 20.2 / 29.9 (each program computes the activation of its whole K range; fewer programs
# take longer over it). Same bits either way.
COARSE_GATED = False


@dataclass(frozen=True)
class LinearTile:
    """The launch of one weight on one device.

    stream: the schedule (`kernel.py`): False = preload, True = stream.
    block_n: BN features per program; block_k: K of one streamed step.
    k_slice: KS, the K of one program (a multiple of block_k; >= K when unsplit).
    split: S = ceil(K / KS) programs per feature block; > 1 needs the call site's
        semaphores (`linear_sync`).
    num_warps: of every program (fixed per weight: the warps shape the MMA).
    stages: the stream schedule's pipeline depth; 0 = STREAM_STAGES, fewer where
        the row blocks' x tiles would pass SMEM_BYTES.
    group: preload only: slices per group of the two-level sum order (module
        docstring); a coarse call runs ceil(split / group) programs per feature block.
    coarse_always: preload only: coarse calls at every M, not only above COARSE_MIN_ROWS.
    """

    stream: bool
    block_n: int
    block_k: int
    k_slice: int
    split: int
    num_warps: int = 4
    stages: int = 0
    group: int = 1
    coarse_always: bool = False

    @property
    def groups(self) -> int:
        """Programs per feature block of a coarse call."""
        return triton.cdiv(self.split, self.group)

    def num_stages(self, row_blocks: int, elem: int) -> int:
        """Pipeline depth of a call with `row_blocks` row blocks: it only hides latency
        and never changes a sum, so it may follow M. Preload: x of the next row block."""
        if not self.stream:
            return 2
        return stream_stages(self.block_n, self.block_k, row_blocks, elem, self.stages or STREAM_STAGES)


def stream_stages(block_n: int, block_k: int, row_blocks: int, elem: int, cap: int = STREAM_STAGES) -> int:
    """Steps in flight of a stream program: at most `cap`, as many [block_n + rows, block_k]
    steps as SMEM_BYTES holds, at least 2."""
    step = (block_n + row_blocks * BLOCK_M) * block_k * elem
    return max(2, min(cap, SMEM_BYTES // step))


def _preload_cost(n: int, k: int, ks: int, elem: int, num_sms: int) -> int:
    """Bytes the busiest SM pulls with slices of KS: weights and, split, the fp32
    partials of COST_ROWS rows written and read back."""
    rows = min(BLOCK_N, n)
    split = triton.cdiv(k, ks)
    per_program = rows * ks * elem + (2 * rows * COST_ROWS * 4 if split > 1 else 0)
    return triton.cdiv(triton.cdiv(n, BLOCK_N) * split, num_sms) * per_program


def linear_tile(n: int, k: int, elem: int = 2, num_sms: int = 1) -> LinearTile:
    """The tile of an [N, K] weight of `elem`-byte elements on a device of `num_sms`
    SMs (1: the interpreter, which runs programs one after another, or a call site
    without semaphores: one program per feature block). Pure; never depends on M."""
    blocks = triton.cdiv(n, BLOCK_N)
    if blocks < num_sms:
        cap = PRELOAD_BYTES if elem <= 2 else PRELOAD_BYTES_FP32
        fits = [ks for ks in PRELOAD_SLICES if min(BLOCK_N, n) * ks * elem <= cap
                and triton.cdiv(k, ks) <= MAX_SPLIT]
        if fits:
            ks = min(fits, key=lambda s: (_preload_cost(n, k, s, elem, num_sms), -s))
            ks = max(16, min(ks, triton.next_power_of_2(k)))  # the MMA's K is at least 16
            split = triton.cdiv(k, ks)
            groups = max(1, min(split, MAX_GROUPS, triton.cdiv(num_sms, blocks)))
            waves = blocks * split * ks * elem * min(BLOCK_N, n) > 2 * PRELOAD_BYTES * num_sms
            if not COARSE_SMALL_SLICES:
                waves = waves and ks * elem * min(BLOCK_N, n) > PRELOAD_BYTES // 2
            return LinearTile(stream=False, block_n=BLOCK_N, block_k=min(BLOCK_K, ks), k_slice=ks,
                              split=split, group=triton.cdiv(split, groups), coarse_always=waves)
    bk = max(16, min(BLOCK_K, triton.next_power_of_2(k)))
    steps = triton.cdiv(k, bk)
    split = 1
    if 3 * blocks <= num_sms:
        split = max(1, min(num_sms // blocks, steps // SPLIT_MIN_STEPS))
    k_slice = triton.cdiv(steps, split) * bk
    return LinearTile(stream=True, block_n=BLOCK_N, block_k=bk, k_slice=k_slice, split=triton.cdiv(k, k_slice))
