"""Typed exceptions. Every public rejection raises one of these with the bad
value quoted and what to do about it."""

from __future__ import annotations

__all__ = [
    "SparkInferError",
    "UnsupportedModelError",
    "CheckpointError",
    "ModelFetchError",
    "ShapeError",
    "DTypeError",
    "DeviceError",
    "LayoutError",
    "AliasingError",
    "CapacityError",
    "CaptureError",
    "LifecycleError",
    "StreamAffinityError",
    "PeerMemoryError",
    "SetupError",
    "TeardownError",
    "RankFailed",
    "CollectiveError",
    "CollectiveTimeout",
    "CollectiveMismatch",
    "PlanError",
    "EngineOverloaded",
    "EngineFailed",
    "RingError",
    "RingTimeout",
    "RingPeerGone",
]


class SparkInferError(Exception):
    """Base class of every error this library raises on purpose."""


class ShapeError(SparkInferError, ValueError):
    """A tensor has the wrong shape or a size that the op cannot divide."""


class DTypeError(SparkInferError, TypeError):
    """A tensor has a dtype the op does not support."""


class DeviceError(SparkInferError, ValueError):
    """A tensor lives on the wrong device for this communicator or plan."""


class LayoutError(SparkInferError, ValueError):
    """A tensor's strides are not a layout the kernel reads."""


class AliasingError(SparkInferError, ValueError):
    """An output partially overlaps an input (exact in-place aliasing, where an op
    allows it, is not an overlap)."""


class CapacityError(SparkInferError, ValueError):
    """A request exceeds a capacity fixed at setup (staging bytes, max tokens)."""


class CaptureError(SparkInferError, RuntimeError):
    """Something that would allocate, compile or sync was asked during CUDA graph capture."""


class LifecycleError(SparkInferError, RuntimeError):
    """An object was used outside its lifecycle (after close, before prepare, twice)."""


class StreamAffinityError(SparkInferError, RuntimeError):
    """A channel owned by one stream was used from another."""


class PeerMemoryError(SparkInferError, RuntimeError):
    """Allocating, exporting, importing or freeing peer memory failed."""


class SetupError(SparkInferError, RuntimeError):
    """A collective setup step failed on at least one rank (raised on every rank)."""


class TeardownError(SparkInferError, RuntimeError):
    """A phase of coordinated close failed on at least one rank; nothing a peer
    may still map was freed, and close() can be called again."""


class RankFailed(SparkInferError, RuntimeError):
    """A rank started by the launcher raised or died; carries its traceback.

    rank: the rank named as the cause. detail: its traceback (and the others'
    last lines). causes: ((one line, ranks), ...), each distinct error once with
    the ranks that raised it, the cause's first: what a command line prints."""

    def __init__(self, rank: int, detail: str, *, causes: tuple[tuple[str, tuple[int, ...]], ...] = ()):
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail
        self.causes = causes or ((detail.strip().splitlines()[-1] if detail.strip() else "failed", (rank,)),)


class CollectiveError(SparkInferError, RuntimeError):
    """Base of errors reported by the device-side protocol."""


class CollectiveTimeout(CollectiveError):
    """A device-side wait passed its deadline. `peer` is the rank waited on."""

    def __init__(self, message: str, *, rank: int, peer: int, op: str, epoch: int):
        super().__init__(message)
        self.rank, self.peer, self.op, self.epoch = rank, peer, op, epoch


class CollectiveMismatch(CollectiveError):
    """Ranks called different collectives (op, algorithm, size or dtype) at the same sequence number."""

    def __init__(self, message: str, *, rank: int, peer: int, op: str, epoch: int):
        super().__init__(message)
        self.rank, self.peer, self.op, self.epoch = rank, peer, op, epoch


class PlanError(SparkInferError, ValueError):
    """Capacities or a spec that no plan can serve."""


class UnsupportedModelError(SparkInferError, ValueError):
    """A checkpoint's architecture, or a config field whose value changes the
    maths, is not one this library implements; the message names it."""


class ModelFetchError(SparkInferError, RuntimeError):
    """A Hugging Face Hub model id could not be fetched (unknown, gated, private, or
    offline and not in the cache); the message says what to do."""


class CheckpointError(SparkInferError, ValueError):
    """A checkpoint tensor is missing, mis-shaped or of the wrong dtype, or a file is
    truncated; the message names the tensor and the file."""


class EngineOverloaded(SparkInferError, RuntimeError):
    """The engine's waiting queue is full: the request was not accepted. Retry after
    `retry_after_s` seconds (an HTTP front end answers 429 with Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineFailed(SparkInferError, RuntimeError):
    """The engine stopped (a rank died, stalled or raised): every in-flight request
    ended with an error and no new one is accepted. `rank` is the rank named as the
    cause, or None."""

    def __init__(self, message: str, *, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class RingError(SparkInferError, RuntimeError):
    """A peer of a shared-memory broadcast ring (`runtime/broadcast.py`) is gone or stalled.
    `reader` is the reader's index, or None when the peer named is the writer; `pid` is
    its process id (None for a reader that never attached)."""

    def __init__(self, message: str, *, reader: int | None = None, pid: int | None = None):
        super().__init__(message)
        self.reader, self.pid = reader, pid


class RingTimeout(RingError):
    """A live ring peer did not move within the deadline: a reader `slots` records behind the
    writer, a reader that never attached, or a writer with neither a record nor a heartbeat."""


class RingPeerGone(RingError):
    """A ring peer's process exited or was killed, or a reader closed its end while the
    writer still had records for it."""
