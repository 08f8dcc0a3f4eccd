"""What every comm op does around its kernel: validate, pick the channel,
fingerprint, launch, and turn a device-side error record into a typed error."""

from __future__ import annotations

import zlib

from sparkinfer.errors import (
    CapacityError,
    CaptureError,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    DeviceError,
    DTypeError,
    LayoutError,
)

__all__ = ["OP_CODES", "fingerprint", "check_errors", "check_tensor", "launch_kernel", "channel_args"]

OP_CODES = {
    "all_reduce_oneshot": 1,
    "all_reduce_twoshot": 2,
    "reduce_scatter": 3,
    "all_gather": 4,
    "all_reduce_add_rms_norm": 5,
    "dcp_merge": 6,
    "all_gather_heads": 7,
    "all_reduce_ll": 8,
}
OP_NAMES = {v: k for k, v in OP_CODES.items()}
ERR_TIMEOUT, ERR_MISMATCH = 1, 2


def fingerprint(op: str, *facts) -> int:
    """31-bit tag of (op, sizes, dtype, grid...) carried in every flag."""
    return zlib.crc32(repr((op,) + facts).encode()) & 0x7FFFFFFF


def check_errors(channel) -> None:
    """Raise the typed error recorded by a kernel on this channel, if any.

    Reads host-visible memory only; never syncs. Once a device-side error is
    seen the channel's flags are inconsistent, so every later call raises too."""
    if channel.broken is not None:
        raise channel.broken
    rec = channel.errors.numpy()  # host memory (pinned on CUDA): no device sync
    code = int(rec[0])
    if code == 0:
        return
    rank, peer, op, epoch, origin = (int(rec[i]) for i in (1, 2, 3, 4, 7))
    if peer == rank:  # aborted by `origin`, which was waiting on this very rank
        peer = origin
    name = OP_NAMES.get(op, f"op#{op}")
    via = "" if origin == rank else f" (reported by rank {origin}, which aborted the group)"
    kw = dict(rank=rank, peer=peer, op=name, epoch=epoch)
    if code == ERR_TIMEOUT:
        err: CollectiveError = CollectiveTimeout(
            f"rank {rank}: {name} at sequence {epoch} on channel {channel.channel_id!r} timed out waiting for "
            f"rank {peer}{via}; rank {peer} did not make the same call (is it alive? did it skip this collective?)",
            **kw,
        )
    else:
        err = CollectiveMismatch(
            f"rank {rank}: {name} at sequence {epoch} on channel {channel.channel_id!r}: rank {peer} called a "
            f"different collective or size{via} (flag {int(rec[5]):#x}, expected {int(rec[6]):#x}); every rank "
            "must issue the same collectives in the same order with the same sizes",
            **kw,
        )
    channel.broken = err
    raise err


_SUPPORTED = ("bfloat16", "float16", "float32")


def check_tensor(name: str, t, device, dtypes=_SUPPORTED) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if str(t.dtype).removeprefix("torch.") not in dtypes:
        raise DTypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(dtypes)} (cast it first)")
    if t.device != device:
        raise DeviceError(f"{name} is on {t.device}, this communicator's device is {device}; "
                          f"move it with .to({str(device)!r})")
    if not t.is_contiguous():
        raise LayoutError(f"{name} with shape {tuple(t.shape)} and strides {t.stride()} is not contiguous; "
                          "pass .contiguous()")


def check_capacity(nbytes: int, channel, what: str) -> None:
    if nbytes > channel.capacity:
        raise CapacityError(
            f"{what} stages {nbytes} B but the channel capacity is {channel.capacity} B; create the Communicator "
            "with a larger capacity_bytes, or call it outside graph capture so it can fall back to NCCL"
        )


def wants_fallback(comm, nbytes: int, what: str) -> bool:
    """True when this call goes to torch.distributed (NCCL on GPUs): no peer
    access, or more bytes than the staging capacity outside capture. Over
    capacity during capture raises CapacityError."""
    if not comm.caps.peer_access or comm.world_size == 1:
        return True
    if nbytes <= comm.caps.capacity:
        return False
    if comm.streams.is_capturing():
        raise CapacityError(
            f"{what} stages {nbytes} B but the staging capacity is {comm.caps.capacity} B, during graph capture; "
            "create the Communicator with a larger capacity_bytes (or capture NCCL yourself)"
        )
    return True


def channel_args(channel) -> tuple:
    """(table, rank) and the layout numbers every comm kernel takes."""
    lay = channel.layout
    return channel.table, channel.rank, lay.stage_off, lay.slot_bytes, lay.lane_bytes


def ll_channel_args(channel) -> tuple:
    """Like channel_args, with the LL region's offsets (see channel.py)."""
    lay = channel.layout
    return channel.table, channel.rank, lay.ll_off, lay.ll_slot_bytes, lay.ll_lane_bytes


_warmed: set = set()


def _spec(a):
    """What Triton 3.x specializes a launch on, for one argument: tensors by
    dtype and 16-byte alignment; ints by ==1, divisibility by 16 and i32/i64 range."""
    if hasattr(a, "data_ptr"):
        return (str(a.dtype), a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return ("i", a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31))
    return (type(a).__name__,)


def launch_kernel(kernel, cfg, key: tuple, capturing: bool, args: tuple, consts: dict) -> None:
    """Launch `kernel` on grid cfg.grid. During capture only specializations that
    already ran once in this process (and so are compiled) may launch: compiling
    inside a capture is refused with CaptureError instead. `key` names the op;
    the specialization is derived from the arguments the way Triton does."""
    spec = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), key[0], cfg,
            tuple(sorted(consts.items())), tuple(_spec(a) for a in args))
    if capturing and spec not in _warmed:
        raise CaptureError(
            f"{key[0]} with this dtype/size/alignment class has not run yet in this process, so it would compile "
            "during graph capture; run the same call once eagerly (a warm-up) before capturing"
        )
    kernel[(cfg.grid,)](*args, num_warps=cfg.num_warps, **consts)
    _warmed.add(spec)
