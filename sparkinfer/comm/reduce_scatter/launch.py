"""Host side of reduce-scatter."""

from __future__ import annotations

from sparkinfer.comm.all_reduce.kernel import twoshot_all_reduce_kernel
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

__all__ = ["reduce_scatter"]


def reduce_scatter(comm, x, out=None):
    """out = rank r's 1/W of sum over ranks of x, split along dim 0.

    x: [M, *] with M divisible by W. out: [M / W, *], same dtype.
    Allocates out only if not given. No host sync. Capture-legal after a warm-up.
    """
    import torch

    W = comm.world_size
    check_tensor("x", x, comm.device)
    if x.dim() == 0 or x.shape[0] % W:
        raise ShapeError(f"reduce_scatter splits dim 0 over {W} ranks; x has shape {tuple(x.shape)} "
                         f"(pad dim 0 to a multiple of {W})")
    oshape = (x.shape[0] // W,) + tuple(x.shape[1:])
    if out is None:
        out = torch.empty(oshape, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, comm.device)
        if tuple(out.shape) != oshape or out.dtype != x.dtype:
            raise ShapeError(f"out must be {oshape} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    n = x.numel()
    if n == 0:
        return out
    if wants_fallback(comm, n * x.element_size(), "reduce_scatter"):
        return comm.fallback_reduce_scatter(x, out)
    ch = comm.pool.channel()
    check_errors(ch)
    check_capacity(n * x.element_size(), ch, "reduce_scatter")
    table, rank, stage_off, slot_bytes, lane_bytes = channel_args(ch)
    chunk = n // W
    cfg = comm.config_for(chunk * x.element_size())
    op = "reduce_scatter"
    fp = fingerprint(op, n, str(x.dtype), cfg.grid, cfg.pipe)
    args = (x, out, n, chunk, table, rank, fp, comm.timeout_ns, stage_off, slot_bytes, lane_bytes)
    consts = dict(OP=OP_CODES[op], W=W, BLOCK=cfg.block, GATHER=False, PIPE=cfg.pipe, INTERP=comm.caps.interpret)
    key = (op, x.dtype, cfg, chunk % 16 == 0)
    launch_kernel(twoshot_all_reduce_kernel, cfg, key, comm.streams.is_capturing(), args, consts)
    if comm.caps.interpret:
        check_errors(ch)
    return out
