"""Launch configuration of `decode_attention`: a pure function of shapes.

Legend: B batch rows, Q queries per row, Hq query heads, KVH KV heads,
G = Hq / KVH, D head dim, L local cache positions per slot, NS KV splits,
N = B * Q * Hq output rows.

`attention_config(...)` picks the tile (rows = queries x heads of one KV head)
and the number of KV splits from shapes only: never from the context length,
which lives on the device (reading it would sync). How a row's keys are cut is
decided on the device from its context:

- batch_invariant (the default): a row of n keys has min(MAX_SPLITS,
  cdiv(n, SPLIT_KEYS)) splits of equal whole BLOCK_N steps, whatever B is; the
  NS programs of a (row, KV head) take contiguous runs of them, and the combine
  pass merges every split's partial in split order. B only changes which program
  computes a split, never its sum or the merge, so a row's output is the same
  bits beside any other rows (docs/design.md, batch invariance).
- otherwise: the row's keys are divided evenly over the NS programs, so the cut
  (and the rounding) follows B through NS = f(B * KVH).

Either way a cache far longer than the context costs empty splits (a few
instructions each), not idle work.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from sparkinfer.errors import PlanError, ShapeError

__all__ = ["AttentionConfig", "attention_config", "num_splits_heuristic", "H200_SMS", "MAX_SPLITS",
           "MAX_GROUP", "SPLIT_KEYS"]

H200_SMS = 132
# Splits stop at 64: the combine pass holds one row's [NS, D] fp32 partials in
# registers (64 x 128 fp32 = 64 registers a thread at 4 warps).
MAX_SPLITS = 64
# A split reads at least two BLOCK_N steps of the cache's L positions, so the
# loads of one step overlap the maths of the other. Not yet measured on the
# H200: `sparkinfer bench attention --sweep` times NS in 1..64 to set it.
MIN_SPLIT_KEYS = 128
# Batch-invariant splits hold about SPLIT_KEYS keys (a row of n keys: cdiv(n,
# 256) splits of equal whole BLOCK_N steps). At B = 1 that is the heuristic's own
# cut at the H200 decode shapes, so it costs nothing there: Qwen3-30B-A3B, L =
# 8192, 8192 keys: 32 splits of 256 keys (the heuristic: 33 programs of 256, one
# idle); the benchmark's 513 keys in a 576-position cache: 3 splits of 192 keys
# (heuristic: 4 programs, 3 of 192). Above B = 32 (KVH = 4) the heuristic stops
# splitting and this does not: a program walks its row's splits in one pipelined
# loop, storing one partial per split (G (D + 1) fp32 per KV head and split against
# 2 D bf16 per key: 2 G / 256 more bytes than the keys, 6% at G = 8, 9% at
# GLM-4.5-Air's 12), and the combine pass runs (16.2 us over 8 layers at B = 8,
# decode_profile_h200.json: 2 us a call). Storing inside the loop costs registers:
# ptxas (sm_90a, Qwen3 decode tile) 147 a thread against 96 when a program stored its one
# split after the loop, 76 KiB of shared memory against 70: two programs still fit an SM
# (tests/attention/test_compile_sm90.py). Not yet timed against the heuristic at
# B = 64: `sparkinfer bench decode --invariance both` and `bench attention` do.
SPLIT_KEYS = 256
# Up to 128 heads share a KV head (the tile then holds one query).
MAX_GROUP = 128
# Rows per program: 16 is the smallest tensor-core M (a decode tile of G < 16
# heads is padded to it). A row's queries x G heads up to MAX_BLOCK_M = 128 rows
# share one tile (decode and verify: then its keys can be split over programs);
# more (prefill) go in PREFILL_BLOCK_M = 64-row tiles, one warpgroup (fp32 acc
# [64, D] = 64 registers a thread at D = 128), unless G alone is more. One H200
# (benchmarks/sweeps/prefill_tiles_sweep.py at a7dbc59, sweeps/prefill_tiles_sweep_h200.json;
# Qwen3-30B-A3B heads, CUDA graphs of 20 calls), us per call at context 512: one chunk of
# 256 queries 11.0 in 64-row tiles of 4 warps against 18.0 in 128-row tiles of 8 (the
# earlier rule; 64 rows and 8 warps 15.5, 128 and 4 33.0), 4 chunks 29.9 against
# 32.9, 512 queries 16.3 against 18.2; the same bits (a row's keys are walked in the
# same BLOCK_N steps whatever its tile; a step past a row's last key adds exact
# zeros; 32-row tiles, slower in a probe, take mma.sync instead of wgmma and other bits).
MIN_BLOCK_M = 16
MAX_BLOCK_M = 128
PREFILL_BLOCK_M = 64
# Tiles of <= 16 rows (a decode query, or two verify queries, of one KV head's heads): warps and
# cp.async pipeline depth, module flags for `bench attention` (SPARKINFER_FLAGS); neither moves a
# row's bits with B. H100 at e1ff944 (sweeps/attention_variants_h100.json: Qwen3-30B-A3B and
# GLM-4.5-Air heads, B 1 / 8 / 64, contexts 512 and 4096, one run each), geometric mean of the us a
# call against these defaults: 8 warps 1.056 (every point but GLM B 64 C 4096 slower), 4 stages
# 1.012; SPLIT_KEYS 128 1.081 (B 1 C 512 faster, 5.9 against 7.3 us for Qwen3, all else slower).
DECODE_WARPS = 4
DECODE_STAGES = 3


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of one `decode_attention` call.

    block_m: rows of a program's tile (power of two >= 16): queries_per_block
        queries x the G heads of one KV head; rows past queries_per_block * G idle.
    queries_per_block: QB = block_m // G.
    q_blocks: ceil(Q / QB) query blocks per (batch row, KV head).
    block_n: cache positions per loop step. block_d: D rounded up to a power of two.
    num_splits: NS programs share one (row, KV head, query block)'s keys.
    split_keys: SK > 0: a row of n keys has min(MAX_SPLITS, cdiv(n, SK)) splits
        whatever NS is (batch-invariant); 0: one split per program.
    split_slots: partials kept per output row, the most splits a row can have
        (NS when split_keys is 0); 1 = no workspace and no combine pass.
    num_warps, num_stages: of the attention kernel (the combine uses 4 warps).
    grid: (B * KVH * q_blocks, NS) of the attention kernel.
    rows: N = B * Q * Hq output rows.
    workspace_numel: fp32 elements of the split workspace (split_slots * N * (D + 1)),
        0 when split_slots == 1.
    """

    block_m: int
    queries_per_block: int
    q_blocks: int
    block_n: int
    block_d: int
    num_splits: int
    split_keys: int
    split_slots: int
    num_warps: int
    num_stages: int
    grid: tuple[int, int]
    rows: int
    workspace_numel: int


def num_splits_heuristic(programs: int, cache_len: int, *, q_blocks: int = 1,
                         num_sms: int = H200_SMS) -> int:
    """KV splits for `programs` = B * KVH * q_blocks unsplit programs over a cache of
    `cache_len` positions per slot. Pure.

    Only decode and verify split (q_blocks == 1: one tile holds all of a row's
    queries). A prefill's parallelism comes from its query blocks, and a split
    would round-trip NS * B * Q * Hq * D fp32 partials through HBM (17 MB for a
    512-token Qwen3 prompt at NS 2) to save less compute than that costs.

    A decode program streams its keys with a 3-stage cp.async pipeline (about 96 KiB
    in flight at BLOCK_N 64, D 128), enough for one SM's share of HBM bandwidth, so
    the aim is one program on every SM: no split once programs >= num_sms, else
    NS = ceil(num_sms / programs) (the grid stays under 2 programs per SM, which
    share memory allows, so no wave tail), at most cache_len // MIN_SPLIT_KEYS
    and MAX_SPLITS. E.g. H200, B = 1, KVH = 4, L = 8192: NS = 33;
    B = 32, KVH = 4: NS = 2; B = 64, KVH = 4: 1.
    """
    if programs <= 0 or programs >= num_sms or q_blocks > 1:
        return 1
    cap = max(1, min(MAX_SPLITS, cache_len // MIN_SPLIT_KEYS))
    return max(1, min(cap, triton.cdiv(num_sms, programs)))


def _block_m(q_len: int, group: int) -> int:
    lo = max(MIN_BLOCK_M, triton.next_power_of_2(group))
    rows = triton.next_power_of_2(q_len * group)
    return max(lo, rows if rows <= MAX_BLOCK_M else PREFILL_BLOCK_M)


def attention_config(*, batch: int, q_len: int, num_q_heads: int, num_kv_heads: int,
                     head_dim: int, cache_len: int, num_sms: int = H200_SMS,
                     num_splits: int | None = None, batch_invariant: bool = True) -> AttentionConfig:
    """The launch of one call with q [B, Q, Hq, D] over a cache [S, L, KVH, D]. Pure.

    num_splits: None picks `num_splits_heuristic`; an int in 1..MAX_SPLITS forces it
    (batch_invariant: capped at the splits a row can have; it only moves work
    between programs, never a result bit).
    batch_invariant: split decode and verify rows by SPLIT_KEYS (module docstring),
    so a row's bits do not depend on B; False: divide each row over the programs.
    Query blocks of more than one (prefill) never split.
    Raises ShapeError (G > MAX_GROUP) and PlanError (forced splits out of range).
    """
    group = num_q_heads // num_kv_heads
    if group > MAX_GROUP:
        raise ShapeError(f"GQA group Hq / KVH = {num_q_heads} / {num_kv_heads} = {group} exceeds "
                         f"{MAX_GROUP} query heads per KV head; shard the query heads over ranks")
    block_m = _block_m(q_len, group)
    qb = block_m // group
    q_blocks = triton.cdiv(q_len, qb)
    programs = batch * num_kv_heads * q_blocks
    if num_splits is None:
        ns = num_splits_heuristic(programs, cache_len, q_blocks=q_blocks, num_sms=num_sms)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise PlanError(f"num_splits={num_splits!r}: pass an int in 1..{MAX_SPLITS}, or None for the "
                        "heuristic")
    else:
        ns = num_splits
    split_keys, slots = 0, ns
    if batch_invariant:
        slots = min(MAX_SPLITS, triton.cdiv(cache_len, SPLIT_KEYS)) if q_blocks == 1 else 1
        split_keys = SPLIT_KEYS if slots > 1 else 0
        if num_splits is None:  # as the heuristic, up to the splits a row can have
            ns = 1 if programs >= num_sms else triton.cdiv(num_sms, max(programs, 1))
        ns = max(1, min(ns, slots))
    block_d = max(16, triton.next_power_of_2(head_dim))
    rows = batch * q_len * num_q_heads
    return AttentionConfig(
        block_m=block_m, queries_per_block=qb, q_blocks=q_blocks,
        # K + V of a step: 2 x 64 x 128 x 2 B = 32 KiB at D <= 128, 3 stages = 96 KiB
        # (two programs per SM fit the H200's 227 KiB); D 256 halves the step
        block_n=64 if block_d <= 128 else 32,
        block_d=block_d, num_splits=ns, split_keys=split_keys, split_slots=slots,
        # one warpgroup for decode tiles and D <= 128 prefill tiles (above); verify
        # tiles of 32-64 rows keep 8 (not timed at 4)
        num_warps=DECODE_WARPS if block_m <= 16 else
        4 if q_blocks > 1 and block_m <= PREFILL_BLOCK_M and block_d <= 128 else 8,
        num_stages=DECODE_STAGES if block_m <= 16 else 3,
        grid=(programs, ns), rows=rows,
        workspace_numel=slots * rows * (head_dim + 1) if slots > 1 else 0,
    )
