"""Host side of all_reduce_add_rms_norm: validate, choose tiles, launch (or compose).

Symbols: T rows (tokens), H hidden size, W ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sparkinfer.comm.channel import MAX_BLOCKS
from sparkinfer.comm.fused_norm.kernel import all_reduce_add_rms_norm_kernel, all_reduce_add_rms_norm_ll_kernel
from sparkinfer.comm.fused_norm.reference import add_rms_norm
from sparkinfer.comm.launching import (
    OP_CODES,
    channel_args,
    check_capacity,
    check_errors,
    check_tensor,
    fingerprint,
    launch_kernel,
    ll_channel_args,
)
from sparkinfer.comm.topology import TopologyCaps, launch_config, select_algorithm
from sparkinfer.errors import CapacityError, DTypeError, LayoutError, ShapeError

__all__ = ["NormConfig", "norm_config", "all_reduce_add_rms_norm", "ALGORITHMS"]

OP = "all_reduce_add_rms_norm"
ALGORITHMS = ("auto", "fused", "fused_ll", "nccl")
# Widest hidden tile kept in registers. 8192 bf16 per row at 8 warps is 32
# elements (four 16-byte vectors) per thread; rows up to H = 8192 fit one tile.
# The interpreter uses 4096 so that CPU tests with H = 7168 take two tiles.
MAX_TILE_GPU = 8192
MAX_TILE_INTERP = 4096
# Smallest piece of a row one block pushes. The 2x H200 all-reduce sweep
# (topology.PER_BLOCK_BYTES: 32 KiB on 16 blocks 5.2 us, on 1 block 9.3 us)
# put ~2 KiB of stage per block; small T splits rows down to that. The
# interpreter splits rows above 4 KiB (one block keeps every piece of a row
# there: its blocks run one after another, so none may wait on a later one).
MIN_PIECE_BYTES_GPU = 2 << 10
MIN_PIECE_BYTES_INTERP = 4 << 10
PIECE_ALIGN = 64  # elements: piece starts stay 16-byte aligned


@dataclass(frozen=True)
class NormConfig:
    """Launch shape of the fused kernel (see kernel.py for pieces).

    grid: blocks (<= num_sms, <= MAX_BLOCKS: co-resident). block: elements per
    push tile. pieces: S, pieces per row; chunk: CH, elements per piece (a
    multiple of PIECE_ALIGN); per: pieces per block. block_h: row tile, block_c:
    piece tile (powers of two). one_pass: S = 1 and a row fits block_h.
    block_w: the LL kernel's tile in int32 words (a piece's words, at most 1024).
    """

    grid: int
    block: int
    pieces: int
    chunk: int
    per: int
    block_h: int
    block_c: int
    one_pass: bool
    num_warps: int
    block_w: int


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def norm_config(caps: TopologyCaps, rows: int, hidden: int, itemsize: int = 2) -> NormConfig:
    """Pure heuristic: split rows into pieces of >= MIN_PIECE_BYTES while there
    are fewer rows than blocks, then spread the pieces over <= num_sms blocks."""
    interp = caps.interpret
    g_max = 2 if interp else min(caps.num_sms, MAX_BLOCKS)
    s = max(1, hidden * itemsize // (MIN_PIECE_BYTES_INTERP if interp else MIN_PIECE_BYTES_GPU))
    if not interp:
        s = min(s, max(1, g_max // rows))
    chunk = -(-(-(-hidden // s)) // PIECE_ALIGN) * PIECE_ALIGN
    s = -(-hidden // chunk)
    if interp:  # whole rows per block
        per = s * -(-rows // min(rows, g_max))
    else:
        per = -(-rows * s // g_max)
    grid = -(-rows * s // per)
    block_h = min(_pow2(hidden), MAX_TILE_INTERP if interp else MAX_TILE_GPU)
    block_c = min(_pow2(chunk), block_h)
    one_pass = s == 1 and hidden <= block_h
    base = launch_config(caps, 0)
    # one 16-byte vector per thread on the main tile (4..16 warps): ptxas -v for sm_90,
    # bf16: a 1024-wide piece tile at 8 warps loads 8-byte vectors, an 8192-wide one spills
    warps = base.num_warps if interp else min(16, max(4, (block_h if one_pass else block_c) * itemsize // 512))
    block_w = min(_pow2(chunk * itemsize // 4), 1024)
    return NormConfig(grid, base.block, s, chunk, per, block_h, block_c, one_pass, warps, block_w)


def _check_like(name: str, t, x, device) -> None:
    check_tensor(name, t, device)
    if tuple(t.shape) != tuple(x.shape) or t.dtype != x.dtype:
        raise ShapeError(f"{name} must match x ({tuple(x.shape)}, {x.dtype}); got {tuple(t.shape)}, {t.dtype}")


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
    configuration ran eagerly. algorithm: "auto" (the fused kernel over the LL
    transport where all_reduce would pick LL, else the flag-based one, within the
    staging capacity; NCCL above it eagerly or without peer access), "fused",
    "fused_ll", or "nccl": all_reduce through torch.distributed + torch norm, which
    rounds the sum to x's dtype before the residual add and allocates.
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
    if H * x.element_size() % 16:
        raise ShapeError(f"hidden size {H} x {x.element_size()} B is not a multiple of 16 bytes; pad H to a multiple of "
                         f"{16 // x.element_size()} (rows are moved in 16-byte vectors)")
    T, nbytes = n // H, n * x.element_size()
    capturing = comm.streams.is_capturing()
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "nccl" or not comm.caps.peer_access or nbytes > comm.caps.capacity:
        if algorithm != "nccl" and comm.caps.peer_access and (capturing or algorithm != "auto"):
            raise CapacityError(
                f"{OP} of {nbytes} B exceeds the staging capacity {comm.caps.capacity} B "
                f"{'during graph capture' if capturing else f'with algorithm={algorithm}'}; "
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
    ll = algorithm == "fused_ll" or (algorithm == "auto" and select_algorithm(comm.caps, nbytes, x.dtype) == "ll")
    if ll and 2 * nbytes > ch.layout.ll_lane_bytes:
        if algorithm == "fused_ll":
            raise CapacityError(f"{OP} with algorithm='fused_ll' carries at most {ch.layout.ll_lane_bytes // 2} B on "
                                f"this channel, got {nbytes} B; use algorithm='auto' or 'fused'")
        ll = False
    cfg = norm_config(comm.caps, T, H, x.element_size())
    fp = fingerprint(OP, T, H, str(x.dtype), cfg.grid, cfg.pieces, cfg.per, ll)
    args = (x, residual, weight, out, residual_out, T, H, cfg.pieces, cfg.chunk, cfg.per, float(eps),
            table, rank, fp, comm.timeout_ns, stage_off, slot_bytes, lane_bytes)
    if ll:
        # 2x H200 LL sweep (topology.ll_launch_config): 512-word tiles at 4 warps won
        cfg = replace(cfg, num_warps=cfg.num_warps if comm.caps.interpret else 4)
        args += ll_channel_args(ch)[2:]
        kernel = all_reduce_add_rms_norm_ll_kernel
        half = x.element_size() == 2
        consts = dict(OP=OP_CODES[OP], W=comm.world_size, BLOCK_W=cfg.block_w, HALF=half, EPW=2 if half else 1,
                      INTERP=comm.caps.interpret)
    else:
        kernel = all_reduce_add_rms_norm_kernel
        consts = dict(OP=OP_CODES[OP], W=comm.world_size, BLOCK=cfg.block, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c,
                      ONE_PASS=cfg.one_pass, INTERP=comm.caps.interpret)
    launch_kernel(kernel, cfg, (OP,), capturing, args, consts)
    if comm.caps.interpret:
        check_errors(ch)  # interpreted kernels are synchronous: report at once
    return out, residual_out
