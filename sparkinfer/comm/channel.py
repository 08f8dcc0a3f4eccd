"""A channel: one slab per rank holding the barrier flags, the epoch and two
staging slots, plus this rank's view of every peer's slab.

Slab layout (identical on every rank; offsets in bytes):

    0            header: int64 words [epoch, arrivals, abort, ...]
    FLAGS_OFF    flags[parity 2][phase 2][src W][block MAX_BLOCKS] int64,
                 written by rank `src` into this slab, polled only here
    stage_off    slot 0: lanes[W] of lane_bytes (lane r is written by rank r),
                 then one gather region of lane_bytes
    + slot_bytes slot 1: the same
    ll_off       LL region, 2 slots x lanes[W] of ll_lane_bytes: only the LL
                 transport writes here, and every word is zeroed by its reader
                 once consumed, so a word is either fresh or 0 (never stale data
                 or another op's raw bytes that could pass for a flag)

An operation at epoch e uses flag parity e % 2 and staging slot e % 2; both are
chosen on the device from the epoch word, never on the host (a host choice would
be frozen into a captured graph). The kernel's last block bumps the epoch, so
eager calls and graph replays continue one sequence.

A flag value packs the operation's fingerprint (high 32 bits) and its sequence
number e + 1 (low 32 bits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparkinfer.comm.memory import LocalSlab, PeerMapping

__all__ = ["ChannelLayout", "Channel", "MAX_BLOCKS", "ERR_WORDS", "LL_MAX_PAYLOAD"]

MAX_BLOCKS = 256  # the largest grid any comm kernel launches (flags are per block)
HEADER_BYTES = 512
FLAGS_OFF = HEADER_BYTES
NUM_PHASES = 4  # flag phases per op: a pipelined two-shot uses 2 x 2
ERR_WORDS = 8  # [code, rank, peer, op, epoch, observed, expected, origin]
LL_MAX_PAYLOAD = 1 << 20  # largest tensor the LL transport may carry (bytes)
_ALIGN = 4096


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class ChannelLayout:
    """Byte layout of one channel slab for `world_size` ranks and `capacity` bytes.

    capacity: the largest tensor (in bytes) one operation may stage.
    """

    world_size: int
    capacity: int

    @property
    def lane_bytes(self) -> int:
        return _round_up(max(self.capacity, 1), _ALIGN)

    @property
    def flags_bytes(self) -> int:
        return 2 * NUM_PHASES * self.world_size * MAX_BLOCKS * 8

    @property
    def stage_off(self) -> int:
        return _round_up(FLAGS_OFF + self.flags_bytes, _ALIGN)

    @property
    def slot_bytes(self) -> int:
        return (self.world_size + 1) * self.lane_bytes

    @property
    def ll_lane_bytes(self) -> int:
        """LL words of one rank: 8 bytes per 4 payload bytes, up to LL_MAX_PAYLOAD."""
        return _round_up(2 * max(min(self.capacity, LL_MAX_PAYLOAD), 4), _ALIGN)

    @property
    def ll_off(self) -> int:
        return self.stage_off + 2 * self.slot_bytes

    @property
    def ll_slot_bytes(self) -> int:
        return self.world_size * self.ll_lane_bytes

    @property
    def nbytes(self) -> int:
        return self.ll_off + 2 * self.ll_slot_bytes


@dataclass(eq=False)
class Channel:
    """One channel as this rank sees it.

    table: int64 [W + 1] on the kernels' device: the slab base address of every
    group rank as mapped in this process (own slab at index `rank`), then the
    address of the host-visible error record.
    errors: int64 [ERR_WORDS] host-visible (pinned on CUDA) error record.
    """

    channel_id: str
    rank: int
    layout: ChannelLayout
    slab: LocalSlab
    peers: dict[int, PeerMapping]
    table: Any
    errors: Any
    serial: int  # creation order inside the pool
    owner_stream: Any = None  # eager stream that owns this channel, if any
    graph_owned: bool = False
    broken: str | None = None  # set once a device-side error left the flags inconsistent
    closed: bool = False
    meta: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    def error_record(self) -> list[int]:
        """The device-side error record (reads host memory; no device sync)."""
        return [int(v) for v in self.errors.tolist()]
