"""Backends for lifecycle tests: an in-memory fake and a host backend that fails on demand."""

from __future__ import annotations

import itertools

import torch

from sparkinfer.comm.memory import HostSlabBackend, LocalSlab, PeerMapping
from sparkinfer.errors import PeerMemoryError


class FakeBackend:
    """Single-process backend: real host memory, bookkeeping of every call."""

    name = "fake"
    device_type = "cpu"

    def __init__(self, fail: dict | None = None):
        self.fail = dict(fail or {})  # op -> how many times to fail next
        self.live: dict[int, LocalSlab] = {}
        self.mapped: dict[int, PeerMapping] = {}
        self.calls: list[str] = []
        self._ids = itertools.count(1)

    def _maybe_fail(self, op):
        self.calls.append(op)
        if self.fail.get(op, 0) > 0:
            self.fail[op] -= 1
            raise PeerMemoryError(f"injected {op} failure")

    def allocate(self, nbytes):
        self._maybe_fail("allocate")
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        slab = LocalSlab(ptr=buf.data_ptr(), nbytes=nbytes, handle=str(next(self._ids)).encode(), keep=buf)
        self.live[id(slab)] = slab
        return slab

    def open(self, peer, handle, nbytes):
        self._maybe_fail("open")
        m = PeerMapping(peer=peer, ptr=0, nbytes=nbytes)
        self.mapped[id(m)] = m
        return m

    def seal(self, slab):
        return None

    def close(self, mapping):
        self._maybe_fail("close")
        self.mapped.pop(id(mapping), None)
        mapping.closed = True

    def free(self, slab):
        self._maybe_fail("free")
        self.live.pop(id(slab), None)
        slab.freed = True


class FaultyHostBackend(HostSlabBackend):
    """Shared-memory backend that fails the next `fail[op]` calls of op, and counts frees."""

    def __init__(self, fail: dict | None = None):
        self.fail = dict(fail or {})
        self.frees = 0
        self.closes = 0

    def _maybe_fail(self, op):
        if self.fail.get(op, 0) > 0:
            self.fail[op] -= 1
            raise PeerMemoryError(f"injected {op} failure")

    def allocate(self, nbytes):
        self._maybe_fail("allocate")
        return super().allocate(nbytes)

    def open(self, peer, handle, nbytes):
        self._maybe_fail("open")
        return super().open(peer, handle, nbytes)

    def close(self, mapping):
        self._maybe_fail("close")
        super().close(mapping)
        self.closes += 1

    def free(self, slab):
        self._maybe_fail("free")
        super().free(slab)
        self.frees += 1
