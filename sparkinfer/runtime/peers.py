"""Waiting for other processes of this host, and telling whether they still live.

- `Waiter`: spin briefly, then nap, first short, then longer: microseconds of latency
  while a loop is busy, ~1% of a core while it idles.
- `process_start(pid)` / `process_alive(pid, start)`: a process is named by its pid and its
  start time, so a recycled pid is not taken for the process that died; a zombie is dead.
- `memory_fence(machine)`: the full fence shared-memory protocols need on weakly ordered
  CPUs (None on x86, whose stores and loads keep program order).

Linux only: /proc, with the peers' entries visible (one user, or no `hidepid` mount option;
a hidden process reads as gone). Used by the broadcast ring (`runtime/broadcast.py`).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

from sparkinfer.errors import SetupError

__all__ = ["Waiter", "process_start", "process_alive", "own_start", "machine", "memory_fence",
           "LIVENESS_NS"]

# Spin, then nap. One poll (a memoryview word read, a clock read) costs ~0.13 us on this
# 2-core VM and os.sched_yield() ~0.7 us, while a nap costs 75-140 us however short it is
# asked to be (sleep(0), sleep(10 us), sleep(50 us): 75, 91, 138 us; the kernel's 50 us timer
# slack and the VM). So: poll for 50 us, about one nap's cost (the spin-then-block bound: at
# most twice the best choice on any wait), yielding the core between polls, so that a peer
# waiting for a CPU runs first. Then the shortest naps until the wait has lasted 2 ms: a rank
# waits out the driver's scheduling between two steps (hundreds of us) in those, so it wakes
# within one nap of its plan instead of within a doubled nap's. Then naps double to 1 ms, and
# after 1 s without progress (an idle server) are 5 ms: one idle waiter then used 0.7% of a
# core against 2.3% with 1 ms naps (/proc/thread-self/schedstat over 2 s; 10 ms measured no
# lower), and the first request after an idle second waits at most 5 ms longer.
# Measured, a ring round trip between two processes at load ~5 on the 2 shared cores, each
# side busy 300 us per step (a driver's scheduling, a rank's step): 46-130 us of overhead
# (median) with this scheme against 400-500 us with pure spinning then naps doubling from
# 50 us; back to back 13-16 us against 6.5-320 us.
SPIN_S = 50e-6
NAP_MIN_S = 50e-6
FLAT_S = 2e-3
NAP_MAX_S = 1e-3
DEEP_IDLE_S = 1.0
DEEP_NAP_S = 5e-3
# A waiter looks a peer up in /proc every 100 ms (one read costs 11-18 us here): a death is
# named within 0.1 s, for < 0.3% of the waiter's time with 16 peers.
LIVENESS_NS = 100_000_000


class Waiter:
    """One wait: `pause()` yields the core for spin_s (default SPIN_S), naps NAP_MIN_S until
    the wait has lasted FLAT_S past the spin, then naps doubling to NAP_MAX_S, and
    DEEP_NAP_S after DEEP_IDLE_S. A longer spin_s suits a wait whose end is due within it
    on a host with a core to spare (a serving loop waiting out a decode step: a nap wakes
    75-140 us late)."""

    __slots__ = ("start", "nap", "spin_s")

    def __init__(self, spin_s: float = SPIN_S):
        self.start, self.nap, self.spin_s = time.monotonic(), 0.0, spin_s

    def pause(self) -> bool:
        """Wait a little. False while spinning; True after a nap (time to look at the peers)."""
        waited = time.monotonic() - self.start
        if waited < self.spin_s:
            os.sched_yield()
            return False
        if waited < max(FLAT_S, self.spin_s + FLAT_S - SPIN_S):
            self.nap = NAP_MIN_S
        else:
            self.nap = DEEP_NAP_S if waited >= DEEP_IDLE_S else min(2 * self.nap, NAP_MAX_S)
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
