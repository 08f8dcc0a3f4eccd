"""Host side of all-gather."""

from __future__ import annotations

from sparkinfer.comm.all_gather.kernel import all_gather_kernel
from sparkinfer.comm.launching import (
    OP_CODES,
    channel_args,
    check_capacity,
    check_errors,
    check_tensor,
    fingerprint,
    launch_kernel,
    wants_fallback,
)
from sparkinfer.errors import ShapeError

__all__ = ["all_gather"]


def all_gather(comm, x, out=None):
    """out = concat over ranks (in group-rank order) of x along dim 0.

    x: [M, *]; out: [W * M, *], same dtype (bitwise copies of every rank's x).
    Allocates out only if not given. No host sync. Capture-legal after a warm-up.
    """
    import torch

    W = comm.world_size
    check_tensor("x", x, comm.device, ("bfloat16", "float16", "float32", "int32", "int64", "uint8"))
    if x.dim() == 0:
        raise ShapeError("all_gather concatenates along dim 0; x is 0-dimensional (use x.reshape(1))")
    oshape = (W * x.shape[0],) + tuple(x.shape[1:])
    if out is None:
        out = torch.empty(oshape, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, comm.device, (str(x.dtype).removeprefix("torch."),))
        if tuple(out.shape) != oshape:
            raise ShapeError(f"out must have shape {oshape}, got {tuple(out.shape)}")
    m = x.numel()
    if m == 0:
        return out
    if wants_fallback(comm, W * m * x.element_size(), "all_gather"):
        return comm.fallback_all_gather(x, out)
    ch = comm.pool.channel()
    check_errors(ch)
    check_capacity(W * m * x.element_size(), ch, "all_gather")
    table, rank, stage_off, slot_bytes, lane_bytes = channel_args(ch)
    cfg = comm.config_for(m * x.element_size())
    op = "all_gather"
    fp = fingerprint(op, m, str(x.dtype), cfg.grid)
    args = (x, out, m, table, rank, fp, comm.timeout_ns, stage_off, slot_bytes, lane_bytes)
    consts = dict(OP=OP_CODES[op], W=W, BLOCK=cfg.block, INTERP=comm.caps.interpret)
    launch_kernel(all_gather_kernel, cfg, (op, x.dtype, cfg, m % 16 == 0), comm.streams.is_capturing(), args, consts)
    if comm.caps.interpret:
        check_errors(ch)
    return out
