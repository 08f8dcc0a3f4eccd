"""Rank worlds: start N ranks (one process per GPU with NCCL, or CPU processes
with gloo and the Triton interpreter) and the group facade the pool uses."""

from sparkinfer.runtime.group import LocalGroup, PeerGroup, TorchGroup
from sparkinfer.runtime.launcher import World, launch
from sparkinfer.runtime.streams import CpuStreams, CudaStreams, StreamOracle

__all__ = [
    "World",
    "launch",
    "PeerGroup",
    "TorchGroup",
    "LocalGroup",
    "StreamOracle",
    "CudaStreams",
    "CpuStreams",
]
