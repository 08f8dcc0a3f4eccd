"""Stream identity and capture state, behind one small interface so the pool's
policy runs the same on GPUs and in CPU tests.

A stream key is any hashable: CUDA streams use (device index, cudaStream_t).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable
from typing import Protocol

__all__ = ["StreamOracle", "CudaStreams", "CpuStreams"]


class StreamOracle(Protocol):
    def current(self) -> Hashable:
        """Key of the stream the next launch goes to."""

    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph."""

    def synchronize(self) -> None:
        """Wait for all work on this rank's device."""


class CudaStreams:
    """The real thing: torch's current stream on `device`."""

    def __init__(self, device):
        import torch

        self._torch = torch
        self.device = torch.device(device)

    def current(self) -> Hashable:
        s = self._torch.cuda.current_stream(self.device)
        return (s.device_index, s.cuda_stream)

    def is_capturing(self) -> bool:
        return self._torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.device)


class CpuStreams:
    """Simulated streams for CPU ranks and tests.

    Kernels run synchronously on the CPU, so streams are only names; `use(key)`
    switches the current one and `capture(key)` marks it as capturing, which is
    all the pool needs to exercise its capture-scope rules.
    """

    def __init__(self, default: Hashable = "main"):
        self._local = threading.local()
        self._default = default
        self._capturing: set = set()

    def current(self) -> Hashable:
        return getattr(self._local, "key", self._default)

    def is_capturing(self) -> bool:
        return self.current() in self._capturing

    def synchronize(self) -> None:
        return None

    @contextlib.contextmanager
    def use(self, key: Hashable):
        prev = self.current()
        self._local.key = key
        try:
            yield key
        finally:
            self._local.key = prev

    @contextlib.contextmanager
    def capture(self, key: Hashable):
        """Make `key` current and capturing (what torch.cuda.graph does on a GPU)."""
        with self.use(key):
            self._capturing.add(key)
            try:
                yield key
            finally:
                self._capturing.discard(key)
