"""Peer memory: slabs that every rank of a group maps.

A slab is one allocation per rank, outside the torch caching allocator (so
expandable segments and recycled blocks cannot break its handle), zeroed before
its handle is published. Two backends:

- `HostSlabBackend`: POSIX shared memory files under /dev/shm, for CPU ranks.
- `CudaSlabBackend`: cudaMalloc + CUDA IPC handles (cuda-bindings), opened with
  peer access enabled and the local device current.

Backends are mechanism only: which slabs exist and who maps them is the pool's
business. Every method may raise PeerMemoryError; none of them talks to peers.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from sparkinfer.errors import PeerMemoryError

__all__ = ["LocalSlab", "PeerMapping", "HostSlabBackend", "CudaSlabBackend", "make_backend"]


@dataclass(eq=False)
class LocalSlab:
    """This rank's own allocation. `handle` is what peers need to map it."""

    ptr: int
    nbytes: int
    handle: bytes
    keep: Any = field(default=None, repr=False)
    freed: bool = False


@dataclass(eq=False)
class PeerMapping:
    """A peer's slab mapped into this process (`ptr` is valid here)."""

    peer: int
    ptr: int
    nbytes: int
    keep: Any = field(default=None, repr=False)
    closed: bool = False


class HostSlabBackend:
    """POSIX shared memory. The file name is the handle; it is unlinked as soon
    as every peer has mapped it, by its owner (`seal`) and by every peer
    (`drop_peer_name`), or once setup failed, so a crashed run leaves nothing
    behind unless a rank dies between creating its name and publishing it."""

    name = "host"
    device_type = "cpu"

    def allocate(self, nbytes: int) -> LocalSlab:
        name = f"sparkinfer-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path = f"/dev/shm/{name}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)  # a new file reads as zeros
                mm = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
        except OSError as e:
            raise PeerMemoryError(f"cannot create {nbytes} B of shared memory at {path}: {e}; "
                                  "free space in /dev/shm") from e
        base = _host_base(mm)
        return LocalSlab(ptr=base.data_ptr(), nbytes=nbytes, handle=name.encode(), keep=[mm, base, path])

    def open(self, peer: int, handle: bytes, nbytes: int) -> PeerMapping:
        path = f"/dev/shm/{handle.decode()}"
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
        except OSError as e:
            raise PeerMemoryError(f"cannot map rank {peer}'s slab {path}: {e}") from e
        base = _host_base(mm)
        return PeerMapping(peer=peer, ptr=base.data_ptr(), nbytes=nbytes, keep=[mm, base])

    def seal(self, slab: LocalSlab) -> None:
        """Every peer has mapped `slab`: drop its name."""
        path = slab.keep[2]
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            slab.keep[2] = None

    def drop_peer_name(self, handle: bytes) -> None:
        """Unlink a peer's slab name (`handle`) if it is still there. Called where
        every rank has mapped that slab or the setup failed on every rank: a peer
        killed before its own `seal` cannot drop the name itself (not even with
        SIGKILL does a mapped name go away). Only names this backend makes."""
        name = handle.decode()
        if re.fullmatch(r"sparkinfer-\d+-[0-9a-f]{12}", name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")

    def close(self, mapping: PeerMapping) -> None:
        _unmap(mapping.keep, f"rank {mapping.peer}'s slab")
        mapping.closed = True

    def free(self, slab: LocalSlab) -> None:
        self.seal(slab)
        _unmap(slab.keep, "this rank's slab")
        slab.freed = True


def _host_base(mm: mmap.mmap):
    import torch

    return torch.frombuffer(mm, dtype=torch.uint8)


def _unmap(keep: list, what: str) -> None:
    import torch

    mm, base = keep[0], keep[1]
    if base is not None:
        # torch.frombuffer views do not pin the mmap: refuse while any tensor
        # other than our base still points into it (unmapping would leave it dangling)
        users = torch._C._storage_Use_Count(base.untyped_storage()._cdata)
        if users > 2:  # our base + the temporary storage handle of this call
            raise PeerMemoryError(f"cannot unmap {what}: {users - 2} tensor view(s) of it are still alive; "
                                  "drop them and close again")
    keep[1] = None
    try:
        mm.close()
    except BufferError as e:
        keep[1] = base
        raise PeerMemoryError(f"cannot unmap {what}: a buffer export of it is still alive ({e}); "
                              "drop it and close again") from e


class CudaSlabBackend:
    """cudaMalloc'd device memory shared by CUDA IPC handles.

    Handles are opened with cudaIpcMemLazyEnablePeerAccess and the local device
    current (tensors handed across processes by torch.multiprocessing gave
    illegal-address errors in peer kernels on the 2x H200, so we open handles
    ourselves).
    """

    name = "cuda"
    device_type = "cuda"

    def __init__(self, device_index: int):
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:  # pragma: no cover - GPU machines only; cuda-python < 12.6 layout
            try:
                from cuda import cudart
            except ImportError as e:
                raise PeerMemoryError("the CUDA slab backend needs NVIDIA's cuda-bindings: "
                                      "pip install cuda-bindings") from e
        self._rt = cudart
        self.device_index = device_index

    def _check(self, result, what: str):
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            name = self._rt.cudaGetErrorName(err)[1]
            raise PeerMemoryError(f"{what} failed on cuda:{self.device_index}: {name!r}")
        if isinstance(result, tuple):
            return result[1] if len(result) == 2 else result[1:]
        return None

    def _current(self) -> None:
        self._check(self._rt.cudaSetDevice(self.device_index), "cudaSetDevice")

    def allocate(self, nbytes: int) -> LocalSlab:
        rt = self._rt
        self._current()
        ptr = int(self._check(rt.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))
        try:
            self._check(rt.cudaMemset(ptr, 0, nbytes), "cudaMemset")
            self._check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")  # zero before publishing
            handle = self._check(rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
        except PeerMemoryError:
            rt.cudaFree(ptr)
            raise
        return LocalSlab(ptr=ptr, nbytes=nbytes, handle=bytes(handle.reserved), keep=None)

    def open(self, peer: int, handle: bytes, nbytes: int) -> PeerMapping:
        rt = self._rt
        self._current()
        h = rt.cudaIpcMemHandle_t()
        h.reserved = handle
        ptr = self._check(
            rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess), f"cudaIpcOpenMemHandle(rank {peer})"
        )
        return PeerMapping(peer=peer, ptr=int(ptr), nbytes=nbytes)

    def seal(self, slab: LocalSlab) -> None:
        return None

    def drop_peer_name(self, handle: bytes) -> None:
        return None  # an IPC handle names nothing in a file system: the driver frees with the process

    def close(self, mapping: PeerMapping) -> None:
        self._current()
        self._check(self._rt.cudaIpcCloseMemHandle(mapping.ptr), f"cudaIpcCloseMemHandle(rank {mapping.peer})")
        mapping.closed = True

    def free(self, slab: LocalSlab) -> None:
        self._current()
        self._check(self._rt.cudaFree(slab.ptr), "cudaFree")
        slab.freed = True


def make_backend(device) -> HostSlabBackend | CudaSlabBackend:
    """The backend for tensors on `device` (a torch.device)."""
    if device.type == "cuda":
        return CudaSlabBackend(device.index if device.index is not None else 0)
    if device.type == "cpu":
        return HostSlabBackend()
    raise PeerMemoryError(f"no peer-memory backend for device {device}; use cuda or cpu")
