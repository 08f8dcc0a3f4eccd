"""What every comm op does around its kernel, written once.

`use_kernel` is the one place an op chooses between its peer kernel and
torch.distributed. `launch` is the one launch sequence: resolve the channel,
raise any error a kernel recorded there, append the channel arguments and the
fingerprint, refuse to compile during capture, launch. `check_errors` turns a
device-side error record into a typed error.
"""

from __future__ import annotations

import zlib

from sparkinfer.comm.topology import nccl_serves
from sparkinfer.errors import (
    AliasingError,
    CapacityError,
    CaptureError,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    DeviceError,
    DTypeError,
    LayoutError,
)

__all__ = [
    "OP_CODES", "fingerprint", "check_errors", "check_tensor",
    "check_overlap", "use_kernel", "launch", "launch_kernel",
]

OP_CODES = {
    "all_reduce_oneshot": 1,
    "all_reduce_twoshot": 2,
    "reduce_scatter": 3,
    "all_gather": 4,
    "all_reduce_add_rms_norm": 5,
    "dcp_merge": 6,
    "all_gather_heads": 7,
    "all_reduce_ll": 8,
    "nccl_fallback": 9,
}
OP_NAMES = {v: k for k, v in OP_CODES.items()}
ERR_TIMEOUT, ERR_MISMATCH = 1, 2


def fingerprint(op: str, *facts) -> int:
    """31-bit tag of (op, sizes, dtype, grid...) carried in every flag."""
    return zlib.crc32(repr((op,) + facts).encode()) & 0x7FFFFFFF


_UNUSABLE = "close() the communicator on every rank and create a new one"


def check_errors(channel) -> None:
    """Raise the typed error recorded by a kernel on this channel, if any.

    Reads host-visible memory only; never syncs. Once a device-side error is
    seen the channel's flags are inconsistent (the communicator is poisoned):
    every later call raises a new error of the same type that says so, with the
    first error as its cause.

    No local of this frame refers to the error it raises: the error's traceback holds
    the frame, so such a local was a reference cycle that kept the communicator and
    its torch process group alive past destroy_process_group() until a cyclic GC
    destroyed the gloo group at an arbitrary point, at interpreter exit too, where its
    worker threads died in "terminate called without an active exception" (3 of 29
    runs; tests/faults/test_exit.py). `channel.broken` is a copy that is never raised."""
    first = channel.broken
    if first is not None:
        raise type(first)(
            f"this communicator is unusable since an earlier error on channel {channel.channel_id!r}; "
            f"{_UNUSABLE} (the earlier error: {first})",
            rank=first.rank, peer=first.peer, op=first.op, epoch=first.epoch,
        ) from first
    rec = channel.errors.numpy()  # host memory (pinned on CUDA): no device sync
    if int(rec[0]) != 0:
        channel.broken = _recorded_error(channel.channel_id, rec)
        raise _recorded_error(channel.channel_id, rec)


def _recorded_error(channel_id: str, rec) -> CollectiveError:
    """The typed error of error record `rec` (see protocol._report) on channel `channel_id`."""
    code, rank, peer, op, epoch, origin = (int(rec[i]) for i in (0, 1, 2, 3, 4, 7))
    if peer == rank:  # aborted by `origin`, which was waiting on this very rank
        peer = origin
    name = OP_NAMES.get(op, f"op#{op}")
    via = "" if origin == rank else f" (reported by rank {origin}, which aborted the group)"
    kw = dict(rank=rank, peer=peer, op=name, epoch=epoch)
    after = f"; this communicator is now unusable: {_UNUSABLE}"
    if code == ERR_TIMEOUT:
        return CollectiveTimeout(
            f"rank {rank}: {name} at sequence {epoch} on channel {channel_id!r} timed out waiting for "
            f"rank {peer}{via}; rank {peer} did not make the same call (is it alive? did it skip this "
            f"collective?){after}",
            **kw,
        )
    observed, expected = int(rec[5]), int(rec[6])
    flags = f" (flag {observed:#x}, expected {expected:#x})" if observed != expected else ""
    return CollectiveMismatch(
        f"rank {rank}: {name} at sequence {epoch} on channel {channel_id!r}: rank {peer} called a "
        f"different collective or size, dtype or algorithm{via}{flags}; every rank must issue the same "
        f"collectives in the same order with the same sizes, dtypes and algorithms{after}",
        **kw,
    )


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


def _span(t) -> tuple[int, int]:
    """[first, last) byte addresses of t's elements, any (non-negative) strides."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _runs(t):
    """(starts, ends): byte intervals covering t's elements, one per run of its
    stride-1 last dim (one per element if it has none)."""
    import torch

    shape, stride = list(t.shape), list(t.stride())
    run = 1
    if shape and stride[-1] == 1:
        run = shape.pop()
        stride.pop()
    # host arithmetic on addresses: on the CPU whatever the caller's default device (there,
    # on a GPU it synced per check; the meta device cannot compute it at all)
    off = torch.zeros((), dtype=torch.int64, device="cpu")
    for n, st in zip(shape, stride):
        off = off.unsqueeze(-1) + torch.arange(n, dtype=torch.int64, device="cpu") * st
    starts = t.data_ptr() + off.flatten() * t.element_size()
    return starts, starts + run * t.element_size()


def _share_bytes(a, b) -> bool:
    """Whether tensors a and b, whose spans intersect, share a byte: exact for strided
    views (a head-major view and a buffer in its gaps do not). Host work in the
    size of the tensors, only when the spans intersect and one is strided."""
    import torch

    sa, ea = _runs(a)
    sb, eb = _runs(b)
    order = torch.argsort(sa)
    sa, reach = sa[order], torch.cummax(ea[order], 0).values
    k = torch.searchsorted(sa, eb)  # a's intervals that start before each of b's ends
    return bool(((k > 0) & (reach[(k - 1).clamp(min=0)] > sb)).any())


def check_overlap(out_name: str, out, in_name: str, x, *, in_place: bool) -> None:
    """AliasingError if `out` shares memory with `x` other than exactly.

    in_place: whether out == x (same first byte, size and strides) is legal for
    the op; any other overlap would let one rank's kernel read what it already
    wrote. Tensors may be strided (dcp_merge's inputs): their elements, not their
    spans, are compared. Rank-local: the other ranks of the call wait out their deadline."""
    if out.numel() == 0 or x.numel() == 0:
        return
    (o0, o1), (x0, x1) = _span(out), _span(x)
    if o0 >= x1 or x0 >= o1:
        return
    if in_place and (o0, o1) == (x0, x1) and out.shape == x.shape and out.stride() == x.stride():
        return
    dense = out.is_contiguous() and x.is_contiguous()
    if not dense and not _share_bytes(out, x):
        return
    by = f"by {min(o1, x1) - max(o0, x0)} B" if dense else "in some elements"
    how = "in place (the same tensor) or " if in_place else ""
    raise AliasingError(
        f"{out_name} [{o0:#x}, {o1:#x}) overlaps {in_name} [{x0:#x}, {x1:#x}) {by}; pass {how}a separate buffer"
    )


def use_kernel(ctx, op: str, nbytes: int, algorithm: str) -> bool:
    """Whether this call of `op`, staging `nbytes` per rank, runs the peer kernel
    (True) or goes to torch.distributed (False, see comm/nccl.py).

    algorithm: "nccl", "auto", or a kernel algorithm the caller named (any other
    string). torch.distributed serves "nccl", every call on ranks that cannot map
    each other (the same API on any group), and "auto" where
    topology.nccl_serves says so. Above the staging capacity, a named kernel
    algorithm or any call during graph capture raises CapacityError instead of
    falling back. Reads host state only; the one place every comm op decides.
    """
    caps = ctx.caps
    if algorithm == "nccl" or not caps.peer_access:
        return False
    if nbytes > caps.capacity:
        capturing = ctx.capturing()
        if algorithm != "auto" or capturing:
            why, hint = ("during graph capture", "") if capturing else (
                f"algorithm={algorithm!r}", ", or pass algorithm='auto' to use NCCL above it")
            raise CapacityError(
                f"{op} stages {nbytes} B but the staging capacity is {caps.capacity} B ({why}); create the "
                f"Communicator with a larger capacity_bytes{hint}"
            )
    return algorithm != "auto" or not nccl_serves(caps, op, nbytes)


_REGIONS = ("stage", "ll", "both")


def launch(ctx, op: str, kernel, *, cfg, args: tuple, consts: dict, facts: tuple, region: str = "stage") -> None:
    """Launch `kernel` for `op` on the channel of the current stream or capture scope.

    args: the op's own arguments; the channel's follow them: (slab address table,
    rank, fingerprint, timeout_ns) and the staging region's (offset, slot bytes, lane
    bytes): region "stage" the flag-synchronized slots, "ll" the LL slots,
    "both" stage then LL. consts: the op's constexprs; OP, W and INTERPRET are
    added. facts: what the fingerprint covers besides the op name, every value
    that ranks must agree on (sizes, dtype, grid, tiles). cfg: the launch shape
    (cfg.grid blocks, cfg.num_warps). Raises the channel's recorded error first;
    interpreted kernels are synchronous, so their errors raise at once too.
    """
    assert region in _REGIONS, region
    ch = ctx.channel()
    check_errors(ch)
    lay = ch.layout
    stage = (lay.stage_off, lay.slot_bytes, lay.lane_bytes)
    ll = (lay.ll_off, lay.ll_slot_bytes, lay.ll_lane_bytes)
    offsets = {"stage": stage, "ll": ll, "both": stage + ll}[region]
    fp = fingerprint(op, *facts)
    args = (*args, ch.table, ch.rank, fp, ctx.timeout_ns, *offsets)
    consts = dict(consts, OP=OP_CODES[op], W=ctx.world_size, INTERPRET=ctx.caps.interpret)
    launch_kernel(kernel, cfg, op=op, capturing=ctx.capturing(), args=args, consts=consts)
    if ctx.caps.interpret:
        check_errors(ch)


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


def launch_kernel(kernel, cfg, *, op: str, capturing: bool, args: tuple, consts: dict) -> None:
    """Launch `kernel` on grid cfg.grid. During capture only specializations that
    already ran once in this process (and so are compiled) may launch: compiling
    inside a capture is refused with CaptureError instead. `op` names the op in
    that error; the specialization is derived from the arguments the way Triton does."""
    spec = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), op, cfg,
            tuple(sorted(consts.items())), tuple(_spec(a) for a in args))
    if capturing and spec not in _warmed:
        raise CaptureError(
            f"{op} with this dtype/size/alignment class has not run yet in this process, so it would compile "
            "during graph capture; run the same call once eagerly (a warm-up) before capturing"
        )
    kernel[(cfg.grid,)](*args, num_warps=cfg.num_warps, **consts)
    _warmed.add(spec)
