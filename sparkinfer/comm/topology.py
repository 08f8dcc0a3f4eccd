"""Facts about a group (TopologyCaps) and the pure policy over them.

`select_algorithm` and `launch_config` are pure functions: no device probing,
testable without hardware. `detect_caps` gathers the facts once, at setup.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkinfer.comm.channel import MAX_BLOCKS

__all__ = ["TopologyCaps", "LaunchConfig", "select_algorithm", "launch_config", "ALGORITHMS"]

ALGORITHMS = ("oneshot", "twoshot", "nccl")

# Crossover from one-shot to two-shot, in bytes of the all-reduced tensor, per
# world size. Provisional (chosen before the first 2x H200 sweep): one-shot
# moves (W-1)*N bytes per rank over the links, two-shot 2*(W-1)/W*N, so
# two-shot wins once bandwidth rather than latency dominates. The sweep in
# benchmarks/bench_comm.py re-measures it; see README "Collectives".
ONESHOT_MAX_BYTES = {2: 256 << 10, 3: 128 << 10, 4: 128 << 10}
ONESHOT_MAX_BYTES_DEFAULT = 64 << 10


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
class LaunchConfig:
    """Grid and tile of one comm kernel launch.

    grid: blocks; never above num_sms (one block per SM is always co-resident,
    which the cross-rank waits require) nor MAX_BLOCKS (flags are per block).
    block: elements per tile iteration; num_warps: warps per block.
    """

    grid: int
    block: int
    num_warps: int


def select_algorithm(caps: TopologyCaps, nbytes: int, dtype=None) -> str:
    """Which all-reduce runs for a tensor of `nbytes`: "oneshot", "twoshot" or "nccl"."""
    if not caps.peer_access or caps.world_size == 1 or nbytes > caps.capacity:
        return "nccl"
    limit = ONESHOT_MAX_BYTES.get(caps.world_size, ONESHOT_MAX_BYTES_DEFAULT)
    return "oneshot" if nbytes <= limit else "twoshot"


def launch_config(caps: TopologyCaps, nbytes: int, per_block_bytes: int = 32 << 10) -> LaunchConfig:
    """Launch shape for a kernel whose busiest per-rank stage moves `nbytes`.

    Provisional sizing: one block per `per_block_bytes` of work, 8 warps with
    16-byte vectors (BLOCK = 8 warps * 32 threads * 8 halves = 2048 elements).
    The interpreter gets small tiles and at most 2 blocks (it runs blocks one
    after another)."""
    cap = min(caps.num_sms, MAX_BLOCKS)
    grid = max(1, min(cap, -(-nbytes // per_block_bytes)))
    if caps.interpret:
        return LaunchConfig(grid=min(grid, 2), block=256, num_warps=1)
    return LaunchConfig(grid=grid, block=2048, num_warps=8)
