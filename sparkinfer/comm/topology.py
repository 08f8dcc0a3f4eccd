"""Facts about a group (TopologyCaps) and the pure policy over them.

`nccl_serves`, `select_algorithm` and `grid_config` are pure functions: no
device probing, testable without hardware. `communicator.detect_caps` gathers
the facts once, at setup.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sparkinfer.comm.channel import MAX_BLOCKS
from sparkinfer.errors import PlanError

__all__ = ["TopologyCaps", "GridConfig", "nccl_serves", "select_algorithm", "grid_config", "ll_grid_config",
           "check_grid_config", "ALGORITHMS", "COPY_AT_ONE_RANK"]

ALGORITHMS = ("ll", "oneshot", "twoshot", "nccl")
# Ops whose result on a group of one rank is x itself: torch.distributed serves
# them there (a copy, no flags, no kernel). The fused ops also compute (norm,
# merge), so their kernels run on one rank too.
COPY_AT_ONE_RANK = ("all_reduce", "reduce_scatter", "all_gather")

# Algorithm crossovers, bytes of the all-reduced tensor, per world size.
# 2x H200 NV18, bf16, per op in a CUDA graph, best launch shape of each
# (benchmarks/results/sweeps/comm_algorithms_2xh200.json, 2026-11-29): one-shot 12.6 us vs
# two-shot 14.9 us at 2 MiB; two-shot 33.3 us vs one-shot 36.3 us at 8 MiB.
# For 2 ranks both move N bytes per rank over the link, so one-shot keeps
# winning until its extra local pass shows. Other world sizes: provisional
# (one-shot moves (W-1)*N per rank, two-shot 2*(W-1)/W*N), not yet measured.
ONESHOT_MAX_BYTES = {2: 4 << 20, 3: 512 << 10, 4: 256 << 10}
ONESHOT_MAX_BYTES_DEFAULT = 128 << 10
# LL (flag in every 8-byte word) for latency-bound sizes; it stages twice the
# bytes. 2x H200 (benchmarks/results/sweeps/comm_ll_2xh200.json): LL 3.74 / 4.27 /
# 4.91 us vs one-shot 4.71 / 5.03 / 6.12 us at 2 / 32 / 128 KiB; tied at 512 KiB
# (7.43 vs 7.41). Other world sizes: provisional, same limit.
LL_MAX_BYTES = 256 << 10


@dataclass(frozen=True)
class TopologyCaps:
    """What a communicator can rely on.

    world_size: ranks in the group.
    peer_access: every rank can map every other rank's memory (else NCCL only).
    link: "nvlink", "pcie" or "host" (CPU ranks sharing memory).
    num_sms: multiprocessors per device (grid cap for co-residency); CPU ranks use 2.
    capacity: bytes one staged operation may carry.
    interpret: kernels run in the Triton interpreter.
    """

    world_size: int
    peer_access: bool
    link: str
    num_sms: int
    capacity: int
    interpret: bool = False


@dataclass(frozen=True)
class GridConfig:
    """Grid and tile of one comm kernel launch.

    grid: blocks; never above num_sms (one block per SM is always co-resident,
    which the cross-rank waits require) nor MAX_BLOCKS (flags are per block).
    block: elements per tile iteration; num_warps: warps per block.
    pipe: pieces each block's share is cut into, each with its own flag phase,
        so reducing one piece overlaps the transfer of the next (1 or 2).
    """

    grid: int
    block: int
    num_warps: int
    pipe: int = 1


def nccl_serves(caps: TopologyCaps, op: str, nbytes: int) -> bool:
    """Whether an algorithm="auto" call of `op` that stages `nbytes` per rank goes to
    torch.distributed (NCCL on GPUs): ranks that cannot map each other, more than
    the staging capacity, or one rank for an op in COPY_AT_ONE_RANK. Pure;
    `dispatch.use_kernel` adds what capture and a caller-named algorithm change."""
    return (not caps.peer_access or nbytes > caps.capacity
            or (caps.world_size == 1 and op in COPY_AT_ONE_RANK))


def select_algorithm(caps: TopologyCaps, nbytes: int, dtype=None) -> str:
    """Which all-reduce runs for a tensor of `nbytes`: "ll", "oneshot", "twoshot" or "nccl"."""
    if nccl_serves(caps, "all_reduce", nbytes):
        return "nccl"
    if nbytes <= min(LL_MAX_BYTES, caps.capacity) and nbytes % 4 == 0:
        return "ll"
    limit = ONESHOT_MAX_BYTES.get(caps.world_size, ONESHOT_MAX_BYTES_DEFAULT)
    return "oneshot" if nbytes <= limit else "twoshot"


# Launch shape, measured on 2x H200 (same sweep file): the best grids put about
# 2 KiB of a rank's stage on each block (32 KiB: 16 blocks, 5.2 us vs 9.3 us
# with 1 block; 128 KiB: 66 blocks, 5.5 us), capped at one block per SM;
# 4096-element tiles won from 512 KiB (6.9 vs 7.2 us), 8192 x 16 warps from
# 8 MiB (two-shot 33.3 vs 33.7 us; 32 MiB: 105 vs 110 us).
PER_BLOCK_BYTES = 2 << 10


@functools.lru_cache(maxsize=1024)
def ll_grid_config(caps: TopologyCaps, nbytes: int) -> GridConfig:
    """Launch shape of the LL one-shot for a tensor of `nbytes` (block in int32 words).

    2x H200 sweep r2: 512-word tiles with 4 warps and about 4 KiB of LL words per
    block won at 32 KiB (16-132 blocks, 4.3 us vs 4.6 us with 1024-word tiles)
    and 128 KiB (66 blocks, 4.9 us vs 5.3 us); 1024-word tiles at 512 KiB."""
    base = grid_config(caps, 2 * nbytes, 4 << 10)
    if caps.interpret:
        return base
    return GridConfig(grid=base.grid, block=512 if nbytes <= (128 << 10) else 1024, num_warps=4)


@functools.lru_cache(maxsize=1024)  # pure, and asked on every eager call
def grid_config(caps: TopologyCaps, nbytes: int, per_block_bytes: int = PER_BLOCK_BYTES) -> GridConfig:
    """Launch shape for a kernel whose busiest per-rank stage moves `nbytes`.

    The grid never exceeds the SM count (one block per SM is always co-resident,
    which cross-rank waits need) nor MAX_BLOCKS. The interpreter gets small tiles
    and at most 2 blocks (it runs blocks one after another)."""
    cap = min(caps.num_sms, MAX_BLOCKS)
    grid = max(1, min(cap, -(-nbytes // per_block_bytes)))
    if caps.interpret:
        return GridConfig(grid=min(grid, 2), block=256, num_warps=1)
    if nbytes >= 8 << 20:
        return GridConfig(grid=grid, block=8192, num_warps=16)
    if nbytes >= 512 << 10:
        return GridConfig(grid=grid, block=4096, num_warps=8)
    return GridConfig(grid=grid, block=2048, num_warps=8)


def check_grid_config(cfg: GridConfig, caps: TopologyCaps) -> None:
    """Raise PlanError unless `cfg` is a launch shape the comm kernels can run on
    `caps`: co-resident blocks (<= num_sms, <= MAX_BLOCKS; <= 2 in the
    interpreter), a power-of-two tile, 1 or 2 pipeline pieces."""
    most = 2 if caps.interpret else min(caps.num_sms, MAX_BLOCKS)
    if not isinstance(cfg, GridConfig):
        raise PlanError(f"config must be a topology.GridConfig (from grid_config), got {type(cfg).__name__}")
    if not (1 <= cfg.grid <= most and cfg.block >= 1 and cfg.block & (cfg.block - 1) == 0
            and cfg.num_warps in (1, 2, 4, 8, 16, 32) and cfg.pipe in (1, 2)):
        raise PlanError(f"config {cfg!r} is not a launch shape for {most} co-resident blocks (grid 1..{most}, "
                        "block a power of two, pipe 1 or 2); build it from topology.grid_config(caps, nbytes)")
