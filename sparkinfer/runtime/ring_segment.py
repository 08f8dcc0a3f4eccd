"""The broadcast ring's shared segment: its layout, its handle, and the mapping both sides hold.

A file in /dev/shm of native u64 words in 64-byte lines, so that the writer's words and each
reader's words never share a cache line:

    line 0       magic, version, readers, slots, record_bytes, slot stride, writer pid, writer start
    line 1       head: records published (bit 63: the writer closed); heartbeat: CLOCK_MONOTONIC ns
    line 2 + i   reader i: tail (records it read), state (0 free, 1 attached, 2 closed), pid, start
    slot k       a line [seq, nbytes], then record_bytes rounded up to 64 B; record s is in slot s % slots

Every word has one writer (the head line and the slots: the ring's writer; line 2 + i:
reader i). Start times are /proc's (`peers.process_start`), so a recycled pid is not taken
for a dead peer. The protocol on top is in `runtime/broadcast.py`.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
import warnings
from dataclasses import dataclass

from sparkinfer import envs
from sparkinfer.errors import PeerMemoryError, SetupError
from sparkinfer.runtime.peers import process_alive

__all__ = ["RingHandle", "Segment", "create_file", "open_file", "unlink", "positive_int", "timeout_s"]

LINE = 64  # bytes; 8 words
MAGIC = int.from_bytes(b"SIBCAST1", "little")
VERSION = 1
H_MAGIC, H_VERSION, H_READERS, H_SLOTS, H_RECORD, H_STRIDE, H_WPID, H_WSTART = range(8)
HEAD, BEAT = 8, 9  # words of line 1
R_TAIL, R_STATE, R_PID, R_START = range(4)  # words of a reader's line
FREE, ATTACHED, CLOSED = 0, 1, 2  # reader states
SHUT = 1 << 63  # head bit: the writer closed the ring
COUNT = SHUT - 1  # head bits: records published


@dataclass(frozen=True)
class RingHandle:
    """What a reader process needs to attach: small and picklable.

    name: the segment's name in /dev/shm. readers, slots, record_bytes: the geometry.
    timeout_s: the writer's deadline, which its readers use by default."""

    name: str
    readers: int
    slots: int
    record_bytes: int
    timeout_s: float


def slot_stride(record_bytes: int) -> int:
    return LINE + -(-record_bytes // LINE) * LINE


def segment_size(readers: int, slots: int, record_bytes: int) -> int:
    return LINE * (2 + readers) + slots * slot_stride(record_bytes)


def positive_int(what: str, value, hi: int, hint: str) -> int:
    """`value` as an int in [1, hi]; SetupError quoting it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise SetupError(f"{what}={value!r}: must be an int in [1, {hi}]; {hint}")
    return value


def timeout_s(value) -> float:
    """`value` seconds, positive and finite; None: SPARKINFER_TIMEOUT_S (default 10)."""
    if value is None:
        return envs.default_timeout_s()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise SetupError(f"timeout_s={value!r}: must be a positive number of seconds, or None for "
                         "SPARKINFER_TIMEOUT_S (default 10)")
    return float(value)


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{name}")


def create_file(name: str, size: int) -> mmap.mmap:
    """A new, zeroed /dev/shm/<name> of `size` bytes, mapped."""
    path = f"/dev/shm/{name}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        raise SetupError(f"ring name {name!r}: {path} exists; pass another name, or None for a fresh one") from None
    except OSError as e:
        raise PeerMemoryError(f"cannot create {path}: {e}") from e
    try:
        # every page reserved now: a full /dev/shm fails here (ENOSPC), where a store into
        # an unbacked page of the mapping would kill the process with SIGBUS later
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError as e:
        unlink(name)
        raise PeerMemoryError(f"cannot allocate {size} B of shared memory at {path}: {e}; free space in /dev/shm, "
                              "or ask for fewer slots or smaller records") from e
    finally:
        os.close(fd)


def open_file(handle: RingHandle) -> mmap.mmap:
    """The segment `handle` names, mapped, after checking that it is that ring's."""
    path = f"/dev/shm/{handle.name}"
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise SetupError(f"ring {handle.name!r}: {path} is gone: the writer closed the ring, or every reader "
                         "attached already (the name is dropped then); attach each index once, before the "
                         "writer's wait_attached() returns") from None
    except OSError as e:
        raise PeerMemoryError(f"cannot open {path}: {e}") from e
    size = segment_size(handle.readers, handle.slots, handle.record_bytes)
    want = (MAGIC, VERSION, handle.readers, handle.slots, handle.record_bytes)
    try:
        found = os.fstat(fd).st_size
        head = struct.unpack("5Q", os.pread(fd, 40, 0)) if found == size else None
        if head != want:
            raise SetupError(f"ring {handle.name!r}: {path} holds {found} B and (magic, version, readers, slots, "
                             f"record_bytes) = {head}; the handle says {size} B and {want}. Pass the handle of "
                             "the ring that made it")
        return mmap.mmap(fd, size)
    except OSError as e:
        raise PeerMemoryError(f"cannot map {path}: {e}") from e
    finally:
        os.close(fd)


class Segment:
    """A mapping of a ring's segment: its words (`_q`), bytes (`_buf`) and geometry."""

    def __init__(self, mm: mmap.mmap, handle: RingHandle, fence):
        self._mm, self._buf = mm, memoryview(mm)
        self._q = self._buf.cast("Q")
        self.handle, self.name = handle, handle.name
        self.readers, self.slots, self.record_bytes = handle.readers, handle.slots, handle.record_bytes
        self._stride = slot_stride(handle.record_bytes)
        self._slot0 = LINE * (2 + handle.readers)
        self._fence = fence  # peers.memory_fence: None on x86
        self._closed = False

    @staticmethod
    def _rline(i: int) -> int:
        """Word index of reader i's line."""
        return (2 + i) * 8

    def _slot(self, seq: int) -> int:
        """Byte offset of the slot holding record `seq`."""
        return self._slot0 + (seq % self.slots) * self._stride

    def _all_attached(self) -> bool:
        return all(self._q[self._rline(i) + R_STATE] != FREE for i in range(self.readers))

    def _writer_alive(self) -> bool:
        return process_alive(self._q[H_WPID], self._q[H_WSTART])

    def _unmap(self) -> None:
        self._closed = True
        self._q.release()
        self._buf.release()
        self._mm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - both sides override it
        raise NotImplementedError

    def __del__(self):
        if getattr(self, "_closed", True) is False:
            warnings.warn(f"{type(self).__name__} of ring {self.name!r} dropped without close(): its peers will "
                          "time out instead of seeing it leave; call close()", ResourceWarning, stacklevel=2)
