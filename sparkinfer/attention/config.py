"""Launch configuration of `decode_attention`: a pure function of shapes.

Legend: B batch rows, Q queries per row, Hq query heads, KVH KV heads,
G = Hq / KVH, D head dim, L local cache positions per slot, NS KV splits,
N = B * Q * Hq output rows.

`attention_config(...)` picks the tile (rows = queries x heads of one KV head)
and the number of KV splits from shapes only: never from the context length,
which lives on the device (reading it would sync). The kernel divides each
row's actual context evenly over the NS splits at run time, so a cache far
longer than the context costs empty splits (a few instructions each), not
idle work.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from sparkinfer.errors import PlanError, ShapeError

__all__ = ["AttentionConfig", "attention_config", "num_splits_heuristic", "H200_SMS", "MAX_SPLITS",
           "MAX_GROUP"]

H200_SMS = 132
# Splits stop at 64: the combine pass holds one row's [NS, D] fp32 partials in
# registers (64 x 128 fp32 = 64 registers a thread at 4 warps).
MAX_SPLITS = 64
# A split reads at least two BLOCK_N steps of the cache's L positions, so the
# loads of one step overlap the maths of the other. Not yet measured on the
# H200: `sparkinfer bench attention --sweep` times NS in 1..64 to set it.
MIN_SPLIT_KEYS = 128
# Up to 128 heads share a KV head (the tile then holds one query).
MAX_GROUP = 128
# Rows per program: 16 is the smallest tensor-core M (a decode tile of G < 16
# heads is padded to it); prefill tiles stop at 128 rows (8 warps, fp32 acc
# [128, D] = 64 registers a thread at D = 128).
MIN_BLOCK_M = 16
MAX_BLOCK_M = 128


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of one `decode_attention` call.

    block_m: rows of a program's tile (power of two >= 16): queries_per_block
        queries x the G heads of one KV head; rows past queries_per_block * G idle.
    queries_per_block: QB = block_m // G.
    q_blocks: ceil(Q / QB) query blocks per (batch row, KV head).
    block_n: cache positions per loop step. block_d: D rounded up to a power of two.
    num_splits: NS programs share one (row, KV head, query block)'s keys;
        1 = no workspace and no combine pass.
    num_warps, num_stages: of the attention kernel (the combine uses 4 warps).
    grid: (B * KVH * q_blocks, NS) of the attention kernel.
    rows: N = B * Q * Hq output rows.
    workspace_numel: fp32 elements of the split workspace (NS * N * (D + 1)),
        0 when num_splits == 1.
    """

    block_m: int
    queries_per_block: int
    q_blocks: int
    block_n: int
    block_d: int
    num_splits: int
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
    return max(lo, min(MAX_BLOCK_M, triton.next_power_of_2(q_len * group)))


def attention_config(*, batch: int, q_len: int, num_q_heads: int, num_kv_heads: int,
                     head_dim: int, cache_len: int, num_sms: int = H200_SMS,
                     num_splits: int | None = None) -> AttentionConfig:
    """The launch of one call with q [B, Q, Hq, D] over a cache [S, L, KVH, D]. Pure.

    num_splits: None picks `num_splits_heuristic`; an int in 1..MAX_SPLITS forces it.
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
    block_d = max(16, triton.next_power_of_2(head_dim))
    rows = batch * q_len * num_q_heads
    return AttentionConfig(
        block_m=block_m, queries_per_block=qb, q_blocks=q_blocks,
        # K + V of a step: 2 x 64 x 128 x 2 B = 32 KiB at D <= 128, 3 stages = 96 KiB
        # (two programs per SM fit the H200's 227 KiB); D 256 halves the step
        block_n=64 if block_d <= 128 else 32,
        block_d=block_d, num_splits=ns,
        num_warps=4 if block_m <= 16 else 8,
        num_stages=3,
        grid=(programs, ns), rows=rows,
        workspace_numel=ns * rows * (head_dim + 1) if ns > 1 else 0,
    )
