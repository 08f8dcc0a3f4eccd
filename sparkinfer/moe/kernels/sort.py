"""Counting sort of routes by expert for the `grouped` family (stable, no atomics).

Legend: R = T*K routes (flattened top-k ids), E experts (EP: next power of 2),
CH routes per one-hot tile, SUB tiles per chunk (a chunk: CH * SUB routes, one
program), NCH chunks, BM rows per tile, P = max_tiles * BM sorted rows.

Three launches, all with static grids (sizes come from T, never from data):
1. `sort_count_kernel` (NCH programs): counts[c, e] = routes of chunk c on expert e;
   each program also fills its share of sorted_route with -1 (padding rows).
2. `sort_offsets_kernel` (1 program): each expert's segment starts at the sum of
   the earlier experts' counts rounded up to BM; base[c, e] = segment start +
   routes of expert e in chunks before c. tile_expert[m] = expert of tile m or -1.
3. `sort_scatter_kernel` (NCH programs): sorted_route[base[c, e] + rank] = route,
   rank = position among chunk c's routes on e. Routes keep their order inside
   an expert's segment, so the result does not depend on scheduling.
Ids outside [0, E) are dropped (the route contributes nothing).

Why chunks of SUB tiles, and the fill in the count kernel: the offsets kernel is
one program whose loops over chunks are latency-bound (a dependent load per CB
chunks). H200 at 36cdf87 (torch profiler, T 4096): DeepSeek-V3 shapes (E 256,
K 8: 1024 one-hot tiles of 32 routes) 117.5 us, Qwen3 (E 128: 512 tiles of 64)
42.7 us, beside FC1 602 / 411 us (benchmarks/results/sweeps/moe_kernel_profile_h200.json).
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
def sort_offsets_kernel(p_counts, p_base, p_tile_e, NCH, max_tiles,
                        E: tl.constexpr, EP: tl.constexpr, CB: tl.constexpr, BM: tl.constexpr,
                        TB: tl.constexpr):
    o_e = tl.arange(0, EP)
    o_c = tl.arange(0, CB)
    total = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(0, NCH, CB):
        m_c = (c0 + o_c) < NCH
        b_cnt = tl.load(p_counts + (c0 + o_c[:, None]) * EP + o_e[None, :], mask=m_c[:, None],
                        other=0)
        total += tl.sum(b_cnt, axis=0)
    padded = (total + BM - 1) // BM * BM
    start = tl.cumsum(padded, axis=0) - padded  # [EP] exclusive
    running = start
    for c0 in range(0, NCH, CB):
        m_c = (c0 + o_c) < NCH
        o_ce = (c0 + o_c[:, None]) * EP + o_e[None, :]
        b_cnt = tl.load(p_counts + o_ce, mask=m_c[:, None], other=0)
        tl.store(p_base + o_ce, tl.cumsum(b_cnt, axis=0) - b_cnt + running[None, :],
                 mask=m_c[:, None])
        running += tl.sum(b_cnt, axis=0)
    t_lo = start // BM
    t_hi = t_lo + padded // BM
    o_t = tl.arange(0, TB)
    for t0 in range(0, max_tiles, TB):
        o_tile = t0 + o_t
        inside = (o_tile[:, None] >= t_lo[None, :]) & (o_tile[:, None] < t_hi[None, :])
        tl.store(p_tile_e + o_tile, tl.max(tl.where(inside, o_e[None, :], -1), axis=1),
                 mask=o_tile < max_tiles)


@triton.jit
def sort_scatter_kernel(p_ids, p_base, p_sorted, R, SUB, E: tl.constexpr, EP: tl.constexpr,
                        CH: tl.constexpr):
    i_c = tl.program_id(0)
    b_base = tl.load(p_base + i_c * EP + tl.arange(0, EP))  # [EP]: next free row per expert
    for j in range(SUB):
        o_r, hit = _chunk_onehot(p_ids, i_c * SUB + j, R, E, EP, CH)
        b_hit = hit.to(tl.int32)
        rank = tl.sum(tl.where(hit, tl.cumsum(b_hit, axis=0), 0), axis=1) - 1  # [CH]
        pos = tl.sum(tl.where(hit, b_base[None, :], 0), axis=1) + rank
        tl.store(p_sorted + pos, o_r, mask=tl.sum(b_hit, axis=1) > 0)
        b_base += tl.sum(b_hit, axis=0)
