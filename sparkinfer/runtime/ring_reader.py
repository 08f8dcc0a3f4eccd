"""The reader's side of a broadcast ring (`runtime/broadcast.py` has the protocol and the
ordering argument; `ring_segment.py` the layout). Get one with `BroadcastRing.attach`."""

from __future__ import annotations

import os
import time

from sparkinfer.errors import LifecycleError, RingPeerGone, RingTimeout, SetupError
from sparkinfer.runtime import peers
from sparkinfer.runtime import ring_segment as seg
from sparkinfer.runtime.peers import LIVENESS_NS, Waiter, own_start

__all__ = ["RingReader"]


class RingReader(seg.Segment):
    """Reader `index` of a ring: `read()` returns every record once, in order. Use it from
    one thread."""

    @classmethod
    def attach(cls, handle: seg.RingHandle, reader_index: int) -> RingReader:
        """Map the ring `handle` names and register this process as reader `reader_index`
        (its pid and start time, so the writer can tell when it dies). The last reader to
        attach drops the /dev/shm name. SetupError for a bad handle or index, LifecycleError
        for an index already attached."""
        if not isinstance(handle, seg.RingHandle):
            raise SetupError(f"attach takes the writer's ring.handle (a RingHandle), got {type(handle).__name__}")
        if isinstance(reader_index, bool) or not isinstance(reader_index, int) or \
                not 0 <= reader_index < handle.readers:
            raise SetupError(f"reader_index={reader_index!r}: ring {handle.name!r} has {handle.readers} reader(s), "
                             f"indices 0..{handle.readers - 1}")
        fence, start = peers.memory_fence(peers.machine()), own_start()
        reader = cls(seg.open_file(handle), handle, fence, reader_index)
        q, line = reader._q, reader._line
        state = q[line + seg.R_STATE]
        if state != seg.FREE:
            pid = q[line + seg.R_PID]
            reader._unmap()
            raise LifecycleError(f"ring {handle.name!r}: reader {reader_index} was already "
                                 f"{'attached' if state == seg.ATTACHED else 'closed'} by pid {pid}; attach each "
                                 "index once, in one process")
        q[line + seg.R_PID], q[line + seg.R_START] = os.getpid(), start
        if fence is not None:
            fence()  # pid and start time before the state that publishes them
        q[line + seg.R_STATE] = seg.ATTACHED
        if reader._all_attached():
            seg.unlink(handle.name)  # the writer may be gone already: the last reader drops the name
        return reader

    def __init__(self, mm, handle: seg.RingHandle, fence, index: int):
        super().__init__(mm, handle, fence)
        self.index = index
        self._line = self._rline(index)
        self._tail = self._q[self._line + seg.R_TAIL]  # records read

    def read(self, timeout_s: float | None = None, *, spin_s: float | None = None) -> bytes | None:
        """The next record, as a copy (its slot is free again when this returns), or None once
        the writer closed the ring and every record was read (None again on later calls).

        Waits, spinning then napping, as long as the writer is alive and has published or
        heartbeat within timeout_s (default: the writer's, from the handle): an idle writer is
        waited on indefinitely. RingPeerGone naming the writer within 0.1 s of its death (once
        no record is left); RingTimeout naming it when it is alive but silent for timeout_s.
        spin_s: how long to poll before the first nap (default `peers.SPIN_S`)."""
        if self._closed:
            raise LifecycleError(f"read on reader {self.index} of ring {self.name!r} after close()")
        q, t = self._q, self._tail
        w = q[seg.HEAD]
        if (w & seg.COUNT) <= t:
            if not w & seg.SHUT:
                w = self._wait(t, timeout_s, spin_s)
            if (w & seg.COUNT) <= t:
                return None
        if self._fence is not None:
            self._fence()  # the head was read before the record it covers
        base = self._slot(t)
        n = q[(base >> 3) + 1]
        assert q[base >> 3] == t + 1 and n <= self.record_bytes, (q[base >> 3], t, n)
        out = bytes(self._buf[base + seg.LINE:base + seg.LINE + n])
        if self._fence is not None:
            self._fence()  # the copy is complete before the slot is given back
        q[self._line + seg.R_TAIL] = t + 1
        self._tail = t + 1
        return out

    def close(self) -> None:
        """Detach and unmap; idempotent. Closing before the writer closed makes the writer raise
        RingPeerGone naming this reader once it has records this reader did not read."""
        if self._closed:
            return
        if self._fence is not None:
            self._fence()
        self._q[self._line + seg.R_STATE] = seg.CLOSED
        self._unmap()

    def _wait(self, t: int, timeout_s, spin_s) -> int:
        """The head word once it passed t or the writer closed."""
        timeout = seg.timeout_s(timeout_s) if timeout_s is not None else self.handle.timeout_s
        # the writer's process is looked up after 100 ms of waiting, not at once: a busy step
        # loop's waits are shorter and never pay the /proc read
        waiter = Waiter() if spin_s is None else Waiter(spin_s)
        q, next_check = self._q, time.monotonic_ns() + LIVENESS_NS
        while True:
            w = q[seg.HEAD]
            if (w & seg.COUNT) > t or w & seg.SHUT:
                return w
            if not waiter.pause():
                continue
            now = time.monotonic_ns()
            silent_s = (now - q[seg.BEAT]) / 1e9
            if now < next_check and silent_s <= timeout:
                continue
            next_check = now + LIVENESS_NS
            gone = not self._writer_alive()
            w = q[seg.HEAD]  # what the writer published before it died or fell silent is still read
            if (w & seg.COUNT) > t or w & seg.SHUT:
                return w
            pid = q[seg.H_WPID]
            if gone:
                seg.unlink(self.name)  # the writer cannot drop the name any more
                raise RingPeerGone(f"ring {self.name!r}: the writer (pid {pid}) is gone (exited or killed) after "
                                   f"publishing {t} records; reader {self.index} stops: restart the engine", pid=pid)
            if silent_s > timeout:
                raise RingTimeout(f"ring {self.name!r}: the writer (pid {pid}) is alive but published nothing and "
                                  f"sent no heartbeat for {silent_s:.1f} s (timeout_s={timeout:g}): it is stalled "
                                  f"(py-spy dump --pid {pid}), or idle without calling heartbeat()", pid=pid)
