"""Rank worlds: start N ranks (one process per GPU with NCCL, or CPU processes
with gloo and the Triton interpreter), the group facade the pool uses, and the
shared-memory broadcast ring a serving engine's driver talks to its ranks through."""

from sparkinfer.runtime.broadcast import BroadcastRing, RingHandle, RingReader
from sparkinfer.runtime.group import LocalGroup, PeerGroup, TorchGroup
from sparkinfer.runtime.ranks import World, run_ranks
from sparkinfer.runtime.streams import CpuStreams, CudaStreams, StreamOracle

__all__ = [
    "World",
    "run_ranks",
    "PeerGroup",
    "TorchGroup",
    "LocalGroup",
    "StreamOracle",
    "CudaStreams",
    "CpuStreams",
    "BroadcastRing",
    "RingReader",
    "RingHandle",
]
