"""Counting sort of routes by expert for the `grouped` family (stable, no atomics).

Legend: R = T*K routes (flattened top-k ids), E experts (EP: next power of 2),
CH routes per one-hot tile, SUB tiles per chunk (a chunk: CH * SUB routes, one
program), NCH chunks, BM rows per tile, P = max_tiles * BM sorted rows.

Two launches, both with static grids (sizes come from T, never from data):
1. `sort_count_kernel` (NCH programs): counts[c, e] = routes of chunk c on expert e;
   each program also fills its share of sorted_route with -1 (padding rows).
2. `sort_scatter_kernel` (NCH programs): each program sums every chunk's counts (each
   expert's segment starts at the earlier experts' totals rounded up to BM; its chunk's
   routes start after the earlier chunks' routes on the same expert), writes its turn
   of tile_expert[m] (the expert of tile m, or -1), and then sorted_route[start +
   rank] = route, rank = position among its routes on e. Routes keep their order inside
   an expert's segment, so the result does not depend on scheduling.
Ids outside [0, E) are dropped (the route contributes nothing).

Why the offsets are not a launch of their own: they were one program (a prefix over
chunks has one answer) whose loops over chunks are latency-bound (a dependent load per
CB chunks): H200 at 36cdf87 (torch profiler, T 4096), DeepSeek-V3 shapes (E 256, K 8:
1024 one-hot tiles of 32 routes) 117.5 us, Qwen3 (E 128: 512 tiles of 64) 42.7 us,
beside FC1 602 / 411 us (benchmarks/results/sweeps/moe_kernel_profile_h200.json); and
in a Qwen3-30B-A3B decode step at batch 64, 6.3 us a layer (prefill_mixed_h200.json,
f23d3de). Every scatter program now reads all NCH x EP counts (128 x 256 int32 at T 4096 on
the DeepSeek-V3 shapes, from L2) instead: redundant loads, run in parallel, and one launch fewer a MoE layer.
Why chunks of SUB tiles, and the fill in the count kernel: fewer, longer programs keep
NCH (the counts each scatter program sums) near SORT_PROGRAMS (binding.py).
"""

import triton
import triton.language as tl


@triton.jit
def _chunk_onehot(p_ids, c, R, E: tl.constexpr, EP: tl.constexpr, CH: tl.constexpr):
    o_r = c * CH + tl.arange(0, CH)
    b_id = tl.load(p_ids + o_r, mask=o_r < R, other=-1)
    o_e = tl.arange(0, EP)
    hit = (b_id[:, None] == o_e[None, :]) & (o_e[None, :] < E)  # [CH, EP]
    return o_r, hit


@triton.jit
def sort_count_kernel(p_ids, p_counts, p_sorted, R, SUB, FILL_PER, P, E: tl.constexpr,
                      EP: tl.constexpr, CH: tl.constexpr, FILL: tl.constexpr):
    i_c = tl.program_id(0)
    b_cnt = tl.zeros([EP], dtype=tl.int32)
    for j in range(SUB):
        o_r, hit = _chunk_onehot(p_ids, i_c * SUB + j, R, E, EP, CH)
        b_cnt += tl.sum(hit.to(tl.int32), axis=0)
    tl.store(p_counts + i_c * EP + tl.arange(0, EP), b_cnt)
    o_f = tl.arange(0, FILL)
    lo = i_c * FILL_PER
    hi = tl.minimum(lo + FILL_PER, P)
    for p0 in range(lo, hi, FILL):
        tl.store(p_sorted + p0 + o_f, tl.full([FILL], -1, tl.int32), mask=(p0 + o_f) < hi)


@triton.jit
def sort_scatter_kernel(p_ids, p_counts, p_sorted, p_tile_e, R, SUB, NCH, max_tiles,
                        E: tl.constexpr, EP: tl.constexpr, CH: tl.constexpr, CB: tl.constexpr,
                        BM: tl.constexpr, TB: tl.constexpr):
    i_c = tl.program_id(0)
    o_e = tl.arange(0, EP)
    o_c = tl.arange(0, CB)
    # every expert's total and this chunk's routes before it: all chunks' counts, CB at a time
    total = tl.zeros([EP], dtype=tl.int32)
    before = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(0, NCH, CB):
        b_cnt = tl.load(p_counts + (c0 + o_c[:, None]) * EP + o_e[None, :],
                        mask=((c0 + o_c) < NCH)[:, None], other=0)
        total += tl.sum(b_cnt, axis=0)
        before += tl.sum(tl.where(((c0 + o_c) < i_c)[:, None], b_cnt, 0), axis=0)
    padded = (total + BM - 1) // BM * BM
    start = tl.cumsum(padded, axis=0) - padded  # [EP] exclusive: each expert's segment
    # tile_expert, TB tiles a step, the chunks' programs taking turns
    t_lo = start // BM
    t_hi = t_lo + padded // BM
    o_t = tl.arange(0, TB)
    for t0 in range(i_c * TB, max_tiles, NCH * TB):
        o_tile = t0 + o_t
        inside = (o_tile[:, None] >= t_lo[None, :]) & (o_tile[:, None] < t_hi[None, :])
        tl.store(p_tile_e + o_tile, tl.max(tl.where(inside, o_e[None, :], -1), axis=1),
                 mask=o_tile < max_tiles)
    b_base = start + before  # [EP]: next free row per expert
    for j in range(SUB):
        o_r, hit = _chunk_onehot(p_ids, i_c * SUB + j, R, E, EP, CH)
        b_hit = hit.to(tl.int32)
        rank = tl.sum(tl.where(hit, tl.cumsum(b_hit, axis=0), 0), axis=1) - 1  # [CH]
        pos = tl.sum(tl.where(hit, b_base[None, :], 0), axis=1) + rank
        tl.store(p_sorted + pos, o_r, mask=tl.sum(b_hit, axis=1) > 0)
        b_base += tl.sum(b_hit, axis=0)
