"""Host side of all-reduce: validate, choose the algorithm, launch."""

from __future__ import annotations

from sparkinfer.comm.all_reduce.kernel import (
    oneshot_all_reduce_kernel,
    oneshot_ll_all_reduce_kernel,
    twoshot_all_reduce_kernel,
)
from sparkinfer.comm.launching import (
    OP_CODES,
    channel_args,
    check_capacity,
    check_errors,
    check_tensor,
    fingerprint,
    launch_kernel,
    ll_channel_args,
    wants_fallback,
)
from sparkinfer.comm.topology import ALGORITHMS, select_algorithm
from sparkinfer.errors import CapacityError, ShapeError

__all__ = ["all_reduce", "twoshot_chunk"]


def twoshot_chunk(n: int, world_size: int) -> int:
    """Elements each rank owns in a two-shot all-reduce (a multiple of 64 for 16-byte vectors)."""
    per_rank = -(-n // world_size)
    return -(-per_rank // 64) * 64


def all_reduce(comm, x, out=None, *, algorithm: str = "auto"):
    """out = sum of x over ranks, bitwise identical on every rank.

    x: [*] bf16/fp16/fp32, contiguous, on comm.device. out: like x (may be x).
    Allocates out only if not given. No host sync. Legal in CUDA graph capture
    (inside pool.capture) for configurations that ran once eagerly.
    """
    import torch

    check_tensor("x", x, comm.device)
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor("out", out, comm.device)
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ShapeError(f"out must match x: got {tuple(out.shape)}/{out.dtype} for x {tuple(x.shape)}/{x.dtype}")
    n, nbytes = x.numel(), x.numel() * x.element_size()
    if n == 0:
        return out
    capturing = comm.streams.is_capturing()
    if algorithm == "auto":
        fallback = wants_fallback(comm, nbytes, "all_reduce")
        algorithm = "nccl" if fallback else select_algorithm(comm.caps, nbytes, x.dtype)
    elif algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be 'auto' or one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "nccl":
        return comm.fallback_all_reduce(x, out)
    if algorithm == "ll" and nbytes % 4:
        algorithm = "oneshot"  # LL moves 4-byte words; odd 16-bit counts take the plain one-shot
    ch = comm.pool.channel()
    check_errors(ch)
    check_capacity(nbytes, ch, "all_reduce")
    table, rank, stage_off, slot_bytes, lane_bytes = channel_args(ch)
    W = comm.world_size
    if algorithm == "ll":
        if 2 * nbytes > ch.layout.ll_lane_bytes:
            raise CapacityError(
                f"all_reduce with algorithm='ll' carries at most {ch.layout.ll_lane_bytes // 2} B on this channel, "
                f"got {nbytes} B; use algorithm='auto' or 'oneshot'"
            )
        table, rank, stage_off, slot_bytes, lane_bytes = ll_channel_args(ch)
        nwords = nbytes // 4
        cfg = comm.ll_config_for(nbytes)
        op = "all_reduce_ll"
        fp = fingerprint(op, n, str(x.dtype), cfg.grid)
        args = (x, out, nwords, table, rank, fp, comm.timeout_ns, stage_off, slot_bytes, lane_bytes)
        kernel = oneshot_ll_all_reduce_kernel
        consts = dict(OP=OP_CODES[op], W=W, BLOCK=cfg.block, HALF=x.element_size() == 2, INTERP=comm.caps.interpret)
    elif algorithm == "oneshot":
        cfg = comm.config_for(nbytes)
        op = "all_reduce_oneshot"
        fp = fingerprint(op, n, str(x.dtype), cfg.grid, cfg.pipe)
        args = (x, out, n, table, rank, fp, comm.timeout_ns, stage_off, slot_bytes, lane_bytes)
        kernel = oneshot_all_reduce_kernel
        consts = dict(OP=OP_CODES[op], W=W, BLOCK=cfg.block, PIPE=cfg.pipe, INTERP=comm.caps.interpret)
    else:
        chunk = twoshot_chunk(n, W)
        cfg = comm.config_for(chunk * x.element_size())
        op = "all_reduce_twoshot"
        fp = fingerprint(op, n, str(x.dtype), cfg.grid, cfg.pipe)
        args = (x, out, n, chunk, table, rank, fp, comm.timeout_ns, stage_off, slot_bytes, lane_bytes)
        kernel = twoshot_all_reduce_kernel
        consts = dict(OP=OP_CODES[op], W=W, BLOCK=cfg.block, GATHER=True, PIPE=cfg.pipe, INTERP=comm.caps.interpret)
    key = (op, x.dtype, cfg, n % 16 == 0)
    launch_kernel(kernel, cfg, key, capturing, args, consts)
    if comm.caps.interpret:
        check_errors(ch)  # interpreted kernels are synchronous: report at once
    return out


