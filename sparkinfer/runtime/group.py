"""The group facade the pool and communicators use for host-side exchanges.

Only setup, verdicts and teardown talk over the group; the data path never does.
Results are always in group-rank order.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["PeerGroup", "TorchGroup", "LocalGroup"]


class PeerGroup(Protocol):
    rank: int  # this process's rank inside the group
    size: int

    def all_gather(self, obj: Any) -> list:
        """Every rank's `obj`, indexed by group rank. Collective."""

    def barrier(self) -> None:
        """Collective."""


class TorchGroup:
    """A torch.distributed process group (NCCL or gloo), group-rank ordered.

    `group=None` is the default world group. For NCCL groups the objects travel
    through the current CUDA device (torch's all_gather_object does this).
    """

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.global_ranks = [dist.get_global_rank(self.group, r) for r in range(self.size)]

    def all_gather(self, obj: Any) -> list:
        out: list = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        self.all_gather(None)


class LocalGroup:
    """A group of one rank: single-process tests and the state-machine test."""

    rank = 0
    size = 1
    global_ranks = [0]

    def all_gather(self, obj: Any) -> list:
        return [obj]

    def barrier(self) -> None:
        return None
