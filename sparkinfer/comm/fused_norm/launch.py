"""Host side of all_reduce_add_rms_norm: validate, choose tiles, launch (or compose).

Symbols: T rows (tokens), H hidden size, W ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkinfer.comm.channel import MAX_BLOCKS
from sparkinfer.comm.fused_norm.kernel import all_reduce_add_rms_norm_kernel
from sparkinfer.comm.fused_norm.reference import add_rms_norm
from sparkinfer.comm.launching import (
    OP_CODES,
    channel_args,
    check_capacity,
    check_errors,
    check_tensor,
    fingerprint,
    launch_kernel,
)
from sparkinfer.comm.topology import TopologyCaps, launch_config
from sparkinfer.errors import CapacityError, DTypeError, LayoutError, ShapeError

__all__ = ["NormConfig", "norm_config", "all_reduce_add_rms_norm", "ALGORITHMS"]

OP = "all_reduce_add_rms_norm"
ALGORITHMS = ("auto", "fused", "nccl")
# Widest hidden tile kept in registers. 8192 bf16 per row at 8 warps is 32
# elements (four 16-byte vectors) per thread; rows up to H = 8192 take the
# one-pass path. The interpreter uses 4096 so that CPU tests with H = 7168 run
# the two-pass path too.
MAX_TILE_GPU = 8192
MAX_TILE_INTERP = 4096


@dataclass(frozen=True)
class NormConfig:
    """Launch shape of the fused kernel.

    grid: blocks, each owning whole rows (<= T, <= num_sms, <= MAX_BLOCKS).
    block: elements per tile of the push phase (copy of the block's rows to peers).
    block_h: hidden-dim tile (a power of two); num_tiles: tiles per row (1 = one pass).
    num_warps: warps per block.
    """

    grid: int
    block: int
    block_h: int
    num_tiles: int
    num_warps: int


def norm_config(caps: TopologyCaps, rows: int, hidden: int) -> NormConfig:
    """Pure heuristic: one block per row up to the SM count (a row is 2..32 KB at
    decode hidden sizes, enough work for one block), hidden tile = next power of
    two of H up to the register cap."""
    base = launch_config(caps, 0)
    cap = min(caps.num_sms, MAX_BLOCKS, 2 if caps.interpret else MAX_BLOCKS)
    max_tile = MAX_TILE_INTERP if caps.interpret else MAX_TILE_GPU
    block_h = min(1 << max(hidden - 1, 0).bit_length(), max_tile)
    warps = base.num_warps if caps.interpret else (8 if block_h >= 4096 else 4)
    return NormConfig(max(1, min(rows, cap)), base.block, block_h, -(-hidden // block_h), warps)


def _check_like(name: str, t, x, device) -> None:
    check_tensor(name, t, device)
    if tuple(t.shape) != tuple(x.shape) or t.dtype != x.dtype:
        raise ShapeError(f"{name} must match x ({tuple(x.shape)}, {x.dtype}); got {tuple(t.shape)}, {t.dtype}")


def _spec(*vals) -> tuple:
    """What Triton specializes on (16-byte alignment, divisibility by 16, == 1):
    part of the warm-up key so capture never meets an uncompiled variant."""
    out = []
    for v in vals:
        if hasattr(v, "data_ptr"):
            out.append(v.data_ptr() % 16 == 0)
        else:
            out.append((v == 1, v % 16 == 0))
    return tuple(out)


def all_reduce_add_rms_norm(comm, x, residual, weight, eps: float = 1e-6, *, out=None, residual_out=None,
                            algorithm: str = "auto"):
    """residual_out = all_reduce(x) + residual;  out = rmsnorm(residual_out) * weight.

    x, residual: [*, H] bf16/fp16/fp32, contiguous, same dtype. weight: [H] (any of
    those dtypes). out, residual_out: like x; may be x / residual (in place), but
    not the same tensor as each other. Sum in fp32 in rank order, not rounded
    before the residual add; the norm reads the rounded residual_out. Bitwise
    identical on every rank (given identical residual and weight).

    Returns (out, residual_out). Allocates only the outputs not given. No host
    sync. Legal in CUDA graph capture (inside pool.capture) once the same
    configuration ran eagerly. algorithm: "auto" (the fused kernel within the
    staging capacity; NCCL above it eagerly or without peer access), "fused", or
    "nccl": all_reduce through torch.distributed + torch norm, which rounds the
    sum to x's dtype before the residual add and allocates.
    """
    import torch

    dev = comm.device
    check_tensor("x", x, dev)
    if x.dim() == 0:
        raise ShapeError("x must be [*, H] with a hidden dim; got a 0-dimensional tensor")
    _check_like("residual", residual, x, dev)
    check_tensor("weight", weight, dev)
    H = x.shape[-1]
    if tuple(weight.shape) != (H,):
        raise ShapeError(f"weight must have shape ({H},) to match x's hidden dim; got {tuple(weight.shape)}")
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(x) if residual_out is None else residual_out
    _check_like("out", out, x, dev)
    _check_like("residual_out", residual_out, x, dev)
    if out.numel() and out.data_ptr() == residual_out.data_ptr():
        raise LayoutError("out and residual_out are the same memory; pass distinct tensors (out=x, residual_out=residual is fine)")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise DTypeError(f"eps must be a non-negative Python float, got {eps!r}")
    n = x.numel()
    if n == 0:
        return out, residual_out
    T, nbytes = n // H, n * x.element_size()
    capturing = comm.streams.is_capturing()
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "nccl" or not comm.caps.peer_access or nbytes > comm.caps.capacity:
        if algorithm != "nccl" and comm.caps.peer_access and (capturing or algorithm == "fused"):
            raise CapacityError(
                f"{OP} of {nbytes} B exceeds the staging capacity {comm.caps.capacity} B "
                f"{'during graph capture' if capturing else 'with algorithm=fused'}; "
                "create the Communicator with a larger capacity_bytes"
            )
        o, r = add_rms_norm(comm.all_reduce(x, algorithm="nccl"), residual, weight, float(eps))
        residual_out.copy_(r)
        out.copy_(o)
        return out, residual_out
    ch = comm.pool.channel()
    check_errors(ch)
    check_capacity(nbytes, ch, OP)
    table, rank, stage_off, slot_bytes, lane_bytes = channel_args(ch)
    cfg = norm_config(comm.caps, T, H)
    fp = fingerprint(OP, T, H, str(x.dtype), cfg.grid)
    args = (x, residual, weight, out, residual_out, T, H, float(eps),
            table, rank, fp, comm.timeout_ns, stage_off, slot_bytes, lane_bytes)
    consts = dict(OP=OP_CODES[OP], W=comm.world_size, BLOCK=cfg.block, BLOCK_H=cfg.block_h,
                  NUM_TILES=cfg.num_tiles, INTERP=comm.caps.interpret)
    key = (OP, x.dtype, weight.dtype, cfg) + _spec(x, residual, weight, out, residual_out, T, H)
    launch_kernel(all_reduce_add_rms_norm_kernel, cfg, key, capturing, args, consts)
    if comm.caps.interpret:
        check_errors(ch)  # interpreted kernels are synchronous: report at once
    return out, residual_out
