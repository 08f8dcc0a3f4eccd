"""The group facade the pool and communicators use for host-side exchanges.

Only setup, verdicts and teardown talk over the group; the data path never does.
Results are always in group-rank order.

TorchGroup exchanges through the process group's key-value store, not a gloo
or NCCL collective, so that every exchange is bounded by `timeout_s` and a
stalled or dead rank is named: a gloo collective waits out the process group's
own timeout (30 min by default) and cannot say who is missing.
"""

from __future__ import annotations

import pickle
import time
import weakref
from typing import Any, Protocol

__all__ = ["PeerGroup", "TorchGroup", "LocalGroup", "ExchangeTimeout"]


class PeerGroup(Protocol):
    rank: int  # this process's rank inside the group
    size: int

    def all_gather(self, obj: Any) -> list:
        """Every rank's `obj`, indexed by group rank. Collective."""

    def barrier(self) -> None:
        """Collective."""


class ExchangeTimeout(RuntimeError):
    """A host exchange did not complete within the group's deadline: a rank
    stalled or died (`missing` names them). Every rank of the exchange raises it
    (a rank arriving late finds the exchange already given up). Callers wrap it in
    SetupError or TeardownError."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


_GAVE_UP = b"\x00sparkinfer-gave-up:"  # a missing rank's slot, taken by the rank that stopped waiting
_POLL_S = (0.001, 0.05)  # first and longest sleep between store polls: a FileStore check costs ~20 us
_SEQ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> exchanges so far


class TorchGroup:
    """A torch.distributed process group (NCCL or gloo), group-rank ordered.

    `group=None` is the default world group. timeout_s bounds each exchange
    (default SPARKINFER_TIMEOUT_S or 10); the Communicator sets its own deadline.

    Each exchange k writes this rank's pickled object under `sparkinfer/x<k>/<rank>`
    of the group's store and polls for its peers'. A rank that stops waiting
    claims every missing slot (compare_set, first writer wins) with a gave-up
    marker, so the late rank, and every rank reading the slot, sees the same
    outcome: ExchangeTimeout naming the missing ranks, on every rank. All ranks
    count exchanges alike (they are collective), so k agrees across ranks and
    across the TorchGroups of one process group.
    """

    def __init__(self, group=None, timeout_s: float | None = None):
        import torch.distributed as dist

        from sparkinfer import envs

        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.global_ranks = [dist.get_global_rank(self.group, r) for r in range(self.size)]
        self.timeout_s = timeout_s if timeout_s is not None else envs.default_timeout_s()
        try:
            from torch.distributed.distributed_c10d import _get_process_group_store

            self._store = _get_process_group_store(self.group)
        except (ImportError, KeyError):  # a torch without the store map: an unbounded collective
            self._store = None

    def all_gather(self, obj: Any) -> list:
        if self._store is None:
            out: list = [None] * self.size
            self._dist.all_gather_object(out, obj, group=self.group)
            return out
        seq = _SEQ.get(self.group, 0)
        _SEQ[self.group] = seq + 1
        keys = [f"sparkinfer/x{seq}/{r}" for r in range(self.size)]
        mine = pickle.dumps(obj)
        store = self._store
        if store.compare_set(keys[self.rank], "", mine) != mine:
            late = f"rank {self.rank} reached host exchange #{seq} after its peers gave up waiting for it"
            raise ExchangeTimeout(f"{late} ({self._gave_up_by(store.get(keys[self.rank]))}, deadline "
                                  f"{self.timeout_s:g} s); this rank stalled", [self.rank])
        deadline = time.monotonic() + self.timeout_s
        pause = _POLL_S[0]
        while not store.check(keys):
            if time.monotonic() > deadline:
                self._give_up(keys, seq)
                break
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])
        values = store.multi_get(keys)
        missing = [r for r, v in enumerate(values) if v.startswith(_GAVE_UP)]
        if missing:
            raise ExchangeTimeout(
                f"rank {self.rank}: rank(s) {missing} did not reach host exchange #{seq} within the "
                f"{self.timeout_s:g} s deadline ({self._gave_up_by(values[missing[0]])}); they stalled or died",
                missing)
        return [pickle.loads(v) for v in values]

    def _give_up(self, keys: list, seq: int) -> None:
        """Take every still-empty slot of exchange `seq` with the gave-up marker."""
        marker = _GAVE_UP + str(self.rank).encode()
        for key in keys:
            self._store.compare_set(key, "", marker)

    @staticmethod
    def _gave_up_by(value: bytes) -> str:
        return f"rank {value[len(_GAVE_UP):].decode()} gave up waiting"

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
