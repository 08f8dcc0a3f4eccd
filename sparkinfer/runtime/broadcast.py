"""A shared-memory broadcast ring: one writer, N readers, processes of one host.

A serving engine's driver publishes a step plan to its N rank processes every engine step
through one ring; rank 0 returns the step's results through a second ring (1 writer, 1
reader). Records are raw bytes (the engine encodes numpy arrays into them), copied once into
the ring by the writer and once out by each reader, never pickled.

    ring = BroadcastRing.create(None, readers=2, slots=8, record_bytes=64 << 10)
    # ring.handle goes to the rank processes (pickled once, when they start); in rank r:
    reader = BroadcastRing.attach(handle, r)
    while (record := reader.read()) is not None:   # None: the writer closed the ring
        apply(record)
    reader.close()
    # in the driver:
    ring.wait_attached()      # every reader attached: the /dev/shm name is dropped
    ring.publish(plan)        # every step; ring.heartbeat() while there is nothing to publish
    ring.close()

Protocol (the layout is drawn in `ring_segment.py`). Every word has one writer, so nothing
needs an atomic read-modify-write. The writer fills slot s % slots with record s (payload,
then the slot's [seq = s + 1, nbytes]) once every reader's tail is at least s + 1 - slots
(each copied out the record the slot held), then stores head = s + 1. A reader waits for
head > tail, copies the record out, then stores tail + 1. So a record is read only after the
head covering it was stored and overwritten only after every tail passed it: a torn read is
impossible by construction, given the ordering below.

Memory ordering: what this relies on.
- Each word is one aligned 8-byte access: item access on a memoryview cast to "Q" is a
  fixed-size memcpy (CPython's pack_single / unpack_single) that compilers emit as one 64-bit
  load or store, single-copy atomic on x86-64 and aarch64, so no word is seen half-written.
- The C compiler keeps program order: the payload copy and the head store are separate calls
  from the interpreter loop into functions it cannot see through.
- x86-64 keeps it in hardware (TSO): stores become visible in program order, loads are not
  reordered with older loads, nor stores with older loads. So "payload, then head" (writer)
  and "head, then copy, then tail" (reader) suffice. glibc's memcpy ends its non-temporal path
  (copies of several MiB) with an sfence, and string stores are not reordered with later ones.
- aarch64 (and anything but x86) is weakly ordered: stores may become visible out of order and
  loads may be satisfied out of order, and CPython puts no barrier between two of our steps
  (3.11 keeps the GIL while it runs and counts references without atomics). There each side
  runs a full fence (`peers.memory_fence`: libatomic's seq_cst fence, one `dmb ish`) between
  steps: writer: read tails | fence | payload, [seq, nbytes] | fence | head; reader: read head |
  fence | copy | fence | tail. Without it the protocol would be wrong there, not just slower.

Waiting (`peers.Waiter`, with the measurements): 50 us of polls that yield the core, 50 us
naps until 2 ms, naps doubling to 1 ms, then 5 ms naps after an idle second. Every wait is
bounded and raises a typed error naming the peer: `RingTimeout` when a live peer did not move
within timeout_s (a reader `slots` records behind, a reader that never attached, a writer with
neither a record nor a heartbeat), `RingPeerGone` within 0.1 s of a peer's death (a zombie is
dead; a recycled pid is told apart by its start time) or when a reader closed its end while
records were left for it. A reader waits on an idle writer that calls heartbeat()
indefinitely, at ~1% of a core.

/dev/shm. The writer drops the name once every reader attached (wait_attached, publish or
close), and so do the last reader to attach and a reader that finds the writer dead: a crash
of either side after that leaves nothing. The one gap is a writer killed before every reader
attached whose readers never come (the launcher's business, as for `comm.memory`'s slabs).
"""

from __future__ import annotations

import os
import re
import time
import uuid

from sparkinfer.errors import (
    CapacityError,
    DTypeError,
    LayoutError,
    LifecycleError,
    RingPeerGone,
    RingTimeout,
    SetupError,
)
from sparkinfer.runtime import peers
from sparkinfer.runtime import ring_segment as seg
from sparkinfer.runtime.peers import LIVENESS_NS, Waiter, own_start, process_alive
from sparkinfer.runtime.ranks import MAX_WORLD_SIZE
from sparkinfer.runtime.ring_reader import RingReader
from sparkinfer.runtime.ring_segment import RingHandle

__all__ = ["BroadcastRing", "RingReader", "RingHandle", "MAX_SLOTS", "MAX_RECORD_BYTES"]

MAX_SLOTS = 1 << 16
MAX_RECORD_BYTES = 1 << 30
# While the writer publishes without waiting it looks at one reader's process every
# 1 s / readers (a /proc read, 11-18 us here): with 16 readers and a 0.5 ms step one publish in
# 125 pays it, below the p99, and a reader that dies while the ring has room is named within
# 1 s (within 0.1 s of the wait, once the ring is full and the writer waits).
_ROUND_NS = 1_000_000_000


def _as_bytes(data) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        raise DTypeError(f"publish takes bytes, a memoryview, a numpy array or a list of them, got "
                         f"{type(data).__name__}; encode it first (a torch tensor: tensor.numpy())") from None
    if not view.c_contiguous:
        raise LayoutError(f"publish needs C-contiguous buffers, got shape {view.shape} strides {view.strides}; "
                          "pass numpy.ascontiguousarray(x)")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class BroadcastRing(seg.Segment):
    """The writer's side; it owns the segment. Make one with `BroadcastRing.create` and use
    it from one thread."""

    @classmethod
    def create(cls, name: str | None = None, *, readers: int, slots: int, record_bytes: int,
               timeout_s: float | None = None) -> BroadcastRing:
        """A new ring in /dev/shm, this process its writer.

        name: the segment's name, or None for a fresh `sparkinfer-ring-<pid>-<hex>`.
        readers: 1..16 reader processes, attached as indices 0..readers-1.
        slots: records in flight (1..65536): the writer waits while the slowest reader is
            `slots` records behind.
        record_bytes: the largest record (1 B .. 1 GiB).
        timeout_s: how long a wait may last (the writer's on a slow reader, a reader's on a
            silent writer); None: SPARKINFER_TIMEOUT_S (default 10 s).
        Allocates slots * (record_bytes + 64) bytes, rounded up to 64 B. SetupError for a bad
        argument or a name in use, PeerMemoryError when /dev/shm cannot hold it."""
        readers = seg.positive_int("readers", readers, MAX_WORLD_SIZE, "one reader per rank process")
        slots = seg.positive_int("slots", slots, MAX_SLOTS, "records in flight; 4-16 covers a step loop")
        record_bytes = seg.positive_int("record_bytes", record_bytes, MAX_RECORD_BYTES, "the largest record")
        timeout = seg.timeout_s(timeout_s)
        if name is None:
            name = f"sparkinfer-ring-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        elif not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}", name):
            raise SetupError(f"ring name {name!r}: use letters, digits, '_', '.' and '-' (no '/'), or None for a "
                             "fresh name")
        fence, start = peers.memory_fence(peers.machine()), own_start()
        handle = RingHandle(name, readers, slots, record_bytes, timeout)
        ring = cls(seg.create_file(name, seg.segment_size(readers, slots, record_bytes)), handle, fence)
        q = ring._q
        for word, value in ((seg.H_VERSION, seg.VERSION), (seg.H_READERS, readers), (seg.H_SLOTS, slots),
                            (seg.H_RECORD, record_bytes), (seg.H_STRIDE, ring._stride), (seg.H_WPID, os.getpid()),
                            (seg.H_WSTART, start), (seg.BEAT, time.monotonic_ns())):
            q[word] = value
        if fence is not None:
            fence()
        q[seg.H_MAGIC] = seg.MAGIC  # last: a segment with the magic is complete
        return ring

    def __init__(self, mm, handle: RingHandle, fence):
        super().__init__(mm, handle, fence)
        self._head = 0  # records published
        self._free_until = handle.slots  # publishable before the tails must be read again
        self._next_check_ns = 0  # when publish looks at a reader's process next
        self._next_reader = 0  # and at whom
        self._unlinked = False

    @staticmethod
    def attach(handle: RingHandle, reader_index: int) -> RingReader:
        """In a reader process: map the ring `handle` names as reader `reader_index`
        (`RingReader.attach`)."""
        return RingReader.attach(handle, reader_index)

    @property
    def published(self) -> int:
        """Records published so far."""
        return self._head

    def publish(self, data, *, timeout_s: float | None = None) -> int:
        """Append one record; returns its sequence number (0, 1, ...).

        data: bytes, bytearray, memoryview or numpy array (any C-contiguous buffer), or a
            list or tuple of them, written back to back as one record; at most record_bytes.
        Copies data into the ring: it may be reused at once. Waits, spinning then napping,
        only while the slowest reader is `slots` records behind: RingTimeout naming it after
        timeout_s (default: the ring's), RingPeerGone within 0.1 s of its death. Refreshes the
        heartbeat, and looks at one reader's process every 1 s / readers (RingPeerGone for a
        dead one). DTypeError, LayoutError, CapacityError for bad data (nothing published)."""
        if self._closed:
            raise LifecycleError(f"publish on ring {self.name!r} after close(); create a new ring")
        views = [_as_bytes(p) for p in data] if isinstance(data, (list, tuple)) else [_as_bytes(data)]
        n = sum(v.nbytes for v in views)
        if n > self.record_bytes:
            raise CapacityError(f"a record of {n} B exceeds record_bytes={self.record_bytes} of ring {self.name!r}; "
                                "create the ring with a larger record_bytes")
        s, q, fence = self._head, self._q, self._fence
        if s >= self._free_until:
            self._wait_readers(s + 1 - self.slots, timeout_s, f"publish record {s}")
        if fence is not None:
            fence()  # the tails were read before the slot is overwritten
        base = self._slot(s)
        at = base + seg.LINE
        for v in views:
            self._buf[at:at + v.nbytes] = v
            at += v.nbytes
        q[(base >> 3) + 1] = n
        q[base >> 3] = s + 1
        if fence is not None:
            fence()  # the record is complete before the head covers it
        q[seg.HEAD] = s + 1
        now = time.monotonic_ns()
        q[seg.BEAT] = now
        self._head = s + 1
        if now >= self._next_check_ns:
            self._next_check_ns = now + _ROUND_NS // self.readers
            self._check_reader(self._next_reader)
            self._next_reader = (self._next_reader + 1) % self.readers
            if not self._unlinked and self._all_attached():
                self._drop_name()
        return s

    def heartbeat(self) -> None:
        """Tell the readers the writer is alive while it has nothing to publish (an idle server):
        call it at least every timeout_s / 2 between records. ~0.2 us."""
        if self._closed:
            raise LifecycleError(f"heartbeat on ring {self.name!r} after close()")
        self._q[seg.BEAT] = time.monotonic_ns()

    def flush(self, *, timeout_s: float | None = None) -> None:
        """Wait until every reader has read every record published so far; RingTimeout or
        RingPeerGone naming the slowest reader as in publish."""
        if self._closed:
            raise LifecycleError(f"flush on ring {self.name!r} after close()")
        self._wait_readers(self._head, timeout_s, f"flush record {self._head - 1}")

    def wait_attached(self, *, timeout_s: float | None = None) -> None:
        """Wait until every reader attached, then drop the /dev/shm name (no crash can leak it
        after that). RingTimeout listing the readers still missing after timeout_s (default:
        the ring's); RingPeerGone for a reader that attached and died."""
        if self._closed:
            raise LifecycleError(f"wait_attached on ring {self.name!r} after close()")
        timeout = seg.timeout_s(timeout_s) if timeout_s is not None else self.handle.timeout_s
        deadline, waiter, next_check = time.monotonic() + timeout, Waiter(), time.monotonic_ns() + LIVENESS_NS
        while True:
            missing = [i for i in range(self.readers) if self._q[self._rline(i) + seg.R_STATE] == seg.FREE]
            if not missing:
                self._drop_name()
                return
            if waiter.pause():
                next_check = self._tick(next_check)
                if time.monotonic() > deadline:
                    raise RingTimeout(f"ring {self.name!r}: reader(s) {missing} did not attach within {timeout:g} s; "
                                      "check that those processes started and call BroadcastRing.attach(handle, i)",
                                      reader=missing[0])

    def check_readers(self) -> None:
        """RingPeerGone naming the first reader whose process is gone (exited, killed, a
        zombie), or that closed its end with records left to read. Drops the /dev/shm name
        once every reader attached. ~15 us a reader (a /proc read)."""
        if self._closed:
            raise LifecycleError(f"check_readers on ring {self.name!r} after close()")
        for i in range(self.readers):
            self._check_reader(i)
        if not self._unlinked and self._all_attached():
            self._drop_name()

    def reader_pids(self) -> list[int | None]:
        """The process id each reader attached from (None for one not attached yet)."""
        if self._closed:
            raise LifecycleError(f"reader_pids on ring {self.name!r} after close()")
        out = []
        for i in range(self.readers):
            line = self._rline(i)
            out.append(int(self._q[line + seg.R_PID]) if self._q[line + seg.R_STATE] != seg.FREE else None)
        return out

    def close(self) -> None:
        """Mark the ring closed (readers read what is left, then None), drop the /dev/shm name
        and unmap. Idempotent; the readers keep their mappings."""
        if self._closed:
            return
        if self._fence is not None:
            self._fence()
        self._q[seg.HEAD] = self._head | seg.SHUT
        self._drop_name()
        self._unmap()

    def _check_reader(self, i: int) -> None:
        q, line = self._q, self._rline(i)
        state = q[line + seg.R_STATE]
        if state == seg.FREE:
            return
        if self._fence is not None:
            self._fence()  # the state was read before the pid it publishes
        tail, pid = q[line + seg.R_TAIL], q[line + seg.R_PID]
        if state == seg.CLOSED and tail < self._head:
            raise RingPeerGone(f"ring {self.name!r}: reader {i} (pid {pid}) closed its end after reading {tail} of "
                               f"{self._head} records; close the ring and restart its readers", reader=i, pid=pid)
        if state == seg.ATTACHED and not process_alive(pid, q[line + seg.R_START]):
            raise RingPeerGone(f"ring {self.name!r}: reader {i} (pid {pid}) is gone (exited or killed) after reading "
                               f"{tail} of {self._head} records; close the ring and restart its readers",
                               reader=i, pid=pid)

    def _tick(self, next_check: int) -> int:
        """After each nap of a wait: heartbeat (waiting on readers is no stall of the writer's:
        keep the others from blaming it), and look at every reader once `next_check` (ns) has
        come, which is 100 ms into the wait and every 100 ms after: a busy loop's waits are
        shorter and never pay the /proc reads. Returns the next `next_check`."""
        now = time.monotonic_ns()
        self._q[seg.BEAT] = now
        if now < next_check:
            return next_check
        self.check_readers()
        return now + LIVENESS_NS

    def _drop_name(self) -> None:
        if not self._unlinked:
            seg.unlink(self.name)
            self._unlinked = True

    def _wait_readers(self, target: int, timeout_s, doing: str) -> None:
        """Wait until every reader's tail is >= target."""
        timeout = seg.timeout_s(timeout_s) if timeout_s is not None else self.handle.timeout_s
        deadline, waiter, q = time.monotonic() + timeout, Waiter(), self._q
        next_check = time.monotonic_ns() + LIVENESS_NS
        while True:
            tails = [q[self._rline(i) + seg.R_TAIL] for i in range(self.readers)]
            tail = min(tails)
            if tail >= target:
                self._free_until = tail + self.slots
                return
            if not waiter.pause():
                continue
            next_check = self._tick(next_check)
            if time.monotonic() > deadline:
                i = tails.index(tail)
                line = self._rline(i)
                if q[line + seg.R_STATE] == seg.FREE:
                    raise RingTimeout(f"ring {self.name!r}: reader {i} never attached, and the writer needs it to "
                                      f"{doing}; waited {timeout:g} s (call ring.wait_attached() first)", reader=i)
                pid = q[line + seg.R_PID]
                raise RingTimeout(f"ring {self.name!r}: reader {i} (pid {pid}) is stalled at record {tail}: the writer "
                                  f"needs it past record {target - 1} to {doing} and waited {timeout:g} s. Look at "
                                  f"its stack (py-spy dump --pid {pid}), or raise timeout_s if its steps take that "
                                  "long", reader=i, pid=pid)
