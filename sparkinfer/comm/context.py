"""OpContext: all that a comm op may use of the Communicator that calls it.

The op functions (`comm/<op>/launch.py`) take an OpContext, never the
Communicator: they read facts, resolve the channel of the current stream or
capture scope, ask whether the stream is capturing, and reach torch.distributed
for the NCCL path, and nothing else. The Communicator builds one at setup
(`comm.context`); benchmarks and tests call an op function with it directly
to pass an explicit launch shape (`config=`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparkinfer.comm.channel import Channel, ChannelLayout
from sparkinfer.comm.topology import TopologyCaps
from sparkinfer.errors import LifecycleError

__all__ = ["OpContext"]


@dataclass(frozen=True)
class OpContext:
    """The narrow interface between a communicator and its ops.

    caps: facts about the group (world size, peer access, SMs, capacity).
    layout: the slab layout every channel of the pool shares (staging and LL lanes).
    device: this rank's torch.device; every tensor argument must live there.
    rank: this rank in the group.
    timeout_ns: deadline of every device-side wait.
    channel: () -> Channel, the channel of the current stream or capture scope
        (ChannelPool.channel: may create an alias inside a capture scope).
    capturing: () -> bool, whether the current stream is capturing a CUDA graph.
    nccl_group: the torch.distributed group of the NCCL path, or None (a
        PeerGroup built without torch.distributed: no NCCL path).
    """

    caps: TopologyCaps
    layout: ChannelLayout
    device: Any
    rank: int
    timeout_ns: int
    channel: Callable[[], Channel]
    capturing: Callable[[], bool]
    nccl_group: Any = None

    @property
    def world_size(self) -> int:
        return self.caps.world_size

    def torch_group(self):
        """The torch.distributed group, or LifecycleError when there is none."""
        if self.nccl_group is None:
            raise LifecycleError("this communicator was built on a PeerGroup without torch.distributed; no NCCL path "
                                 "(pass a torch.distributed group, or stay within the staging capacity)")
        return self.nccl_group
