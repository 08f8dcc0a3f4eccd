"""Waiting for other processes of this host, and telling whether they still live.

- `Waiter`: spin briefly, then nap with a growing period: microseconds of latency while
  a loop is busy, ~1% of a core while it idles.
- `process_start(pid)` / `process_alive(pid, start)`: a process is named by its pid and its
  start time, so a recycled pid is not taken for the process that died; a zombie is dead.
- `memory_fence(machine)`: the full fence shared-memory protocols need on weakly ordered
  CPUs (None on x86, whose stores and loads keep program order).

Linux only (/proc). Used by the broadcast ring (`runtime/broadcast.py`).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

from sparkinfer.errors import SetupError

__all__ = ["Waiter", "process_start", "process_alive", "own_start", "machine", "memory_fence",
           "LIVENESS_NS"]

# Spin, then nap. One poll (a memoryview word read and a clock read) costs ~0.13 us on this
# 2-core VM, one nap ~75-90 us however short it is asked to be (time.sleep(0) and sleep(10 us)
# measured 75 and 91 us: timer slack and the VM). Spinning about as long as one nap (50 us,
# ~400 polls) gives a busy loop microsecond latency and costs at most twice the best choice on
# any wait (the spin-then-block bound). Naps then double from 50 us to 1 ms, so a record that
# arrives during a nap is late by at most the time already waited. After 1 s without progress
# (an idle server) naps are 5 ms: one idle waiter then used 0.7% of a core here against 2.3%
# with 1 ms naps (/proc/thread-self/schedstat over 2 s; 10 ms naps measured no lower), and the
# first request after an idle second waits at most 5 ms longer.
SPIN_S = 50e-6
NAP_MIN_S = 50e-6
NAP_MAX_S = 1e-3
DEEP_IDLE_S = 1.0
DEEP_NAP_S = 5e-3
# A waiter looks a peer up in /proc every 100 ms (one read costs 11-18 us here): a death is
# named within 0.1 s, for < 0.3% of the waiter's time with 16 peers.
LIVENESS_NS = 100_000_000


class Waiter:
    """One wait: `pause()` spins for SPIN_S, then naps doubling from NAP_MIN_S to NAP_MAX_S,
    then DEEP_NAP_S once the wait has lasted DEEP_IDLE_S."""

    __slots__ = ("start", "nap")

    def __init__(self):
        self.start, self.nap = time.monotonic(), 0.0

    def pause(self) -> bool:
        """Wait a little. False while spinning; True after a nap (time to look at the peers)."""
        waited = time.monotonic() - self.start
        if waited < SPIN_S:
            return False
        self.nap = DEEP_NAP_S if waited >= DEEP_IDLE_S else min(max(2 * self.nap, NAP_MIN_S), NAP_MAX_S)
        time.sleep(self.nap)
        return True


def process_start(pid: int) -> int | None:
    """Process `pid`'s start time (clock ticks after boot, /proc/<pid>/stat field 22), or None
    when it is gone or a zombie (dead, only not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb", buffering=0) as f:
            fields = f.read().rpartition(b")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def process_alive(pid: int, start: int) -> bool:
    """Whether the process that had `pid` and `start` (process_start) still runs."""
    return pid > 0 and process_start(pid) == start


def own_start() -> int:
    """This process's start time; SetupError where /proc cannot tell it."""
    start = process_start(os.getpid())
    if start is None:
        raise SetupError("peers are told dead or alive by /proc/<pid>/stat, and /proc/self/stat is not readable "
                         "here; mount /proc (Linux)")
    return start


def machine() -> str:
    """The CPU architecture, as platform.machine() names it (a function, so tests can pose as aarch64)."""
    return platform.machine()


def memory_fence(arch: str) -> Callable[[], None] | None:
    """A full (seq_cst) fence for `arch`: None on x86 (TSO keeps program order), else
    libatomic's atomic_thread_fence (aarch64: one `dmb ish`), which costs one ctypes call
    (~0.3 us). SetupError naming the package when libatomic.so.1 does not load."""
    if arch.lower() in ("x86_64", "amd64", "i386", "i686"):
        return None
    import ctypes
    import functools

    try:
        lib = ctypes.CDLL("libatomic.so.1")
    except OSError as e:
        raise SetupError(f"shared-memory rings need a memory fence on {arch!r}, from libatomic.so.1, which did "
                         f"not load ({e}); install it (apt install libatomic1, dnf install libatomic)") from e
    fence = lib.atomic_thread_fence
    fence.argtypes, fence.restype = [ctypes.c_int], None
    return functools.partial(fence, 5)  # __ATOMIC_SEQ_CST
