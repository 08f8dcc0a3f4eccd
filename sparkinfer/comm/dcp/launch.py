"""Host side of dcp_merge and all_gather_heads: validate, choose tiles, launch
(or compose all_gather + local merge through torch.distributed).

Symbols: W ranks, T tokens, H heads, D head dim, Hs heads per result (H / W
when scattering over heads, else H). Rows are (token, head) pairs of D elements.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkinfer.comm import nccl
from sparkinfer.comm.channel import MAX_BLOCKS
from sparkinfer.comm.dcp.kernel import all_gather_heads_kernel, dcp_merge_kernel
from sparkinfer.comm.dcp.reference import merge_partials
from sparkinfer.comm.dispatch import check_overlap, check_tensor, launch, use_kernel
from sparkinfer.comm.topology import TopologyCaps
from sparkinfer.errors import LayoutError, PlanError, ShapeError

__all__ = ["RowConfig", "row_config", "dcp_merge", "all_gather_heads"]

ALGORITHMS = ("auto", "kernel", "nccl")
# Rows per block: at least ~2 KiB of a rank's stage per block (the 2x H200
# all-reduce sweep, topology.PER_BLOCK_BYTES: 32 KiB on 16 blocks 5.2 us, on 1
# block 9.3 us), more once every SM has a block; tiles of at most 4096 elements.
# The interpreter takes fewer, wider tiles (it runs blocks one after another).
MIN_BLOCK_BYTES = 2 << 10
TILE_MAX = 4096
TILE_INTERP = 2048


@dataclass(frozen=True)
class RowConfig:
    """Launch shape of the row kernels.

    grid: blocks (<= num_sms, <= MAX_BLOCKS; co-resident); rows: R, rows per tile
    (a power of two); block_d: head-dim tile (next power of two of D); num_warps.
    """

    grid: int
    rows: int
    block_d: int
    num_warps: int


def row_config(caps: TopologyCaps, n_rows: int, head_dim: int, itemsize: int = 2) -> RowConfig:
    """Pure heuristic: R rows per tile so a block stages >= MIN_BLOCK_BYTES (or its
    1/num_sms share), one tile per block up to the SM count, 16-byte vectors."""
    block_d = 1 << max(head_dim - 1, 0).bit_length()
    if caps.interpret:
        rows = max(1, TILE_INTERP // block_d)
        return RowConfig(max(1, min(-(-n_rows // rows), 2)), rows, block_d, 1)
    g_max = min(caps.num_sms, MAX_BLOCKS)
    row_bytes = max(1, head_dim * itemsize)
    want = max(MIN_BLOCK_BYTES, n_rows * row_bytes // g_max) // row_bytes
    rows = min(1 << max(want.bit_length() - 1, 0), max(1, TILE_MAX // block_d))
    # one 16-byte vector per thread (ptxas -v, sm_90: R = 32, D = 128 bf16 spills at 8 warps, not at 16)
    warps = min(16, max(4, rows * block_d * itemsize // 512))
    return RowConfig(max(1, min(-(-n_rows // rows), g_max)), rows, block_d, warps)


def _check_dtype_device(name: str, t, dev, dtypes=("bfloat16", "float16", "float32")) -> None:
    """check_tensor without its contiguity rule (checked on an empty view of t)."""
    import torch

    check_tensor(name, t.as_strided((0,), (1,)) if isinstance(t, torch.Tensor) else t, dev, dtypes)


def _check_rows(name: str, t, dev, dim: int = 3) -> None:
    """A [T, H, D] tensor whose D axis is contiguous (token- or head-major both fine)."""
    _check_dtype_device(name, t, dev)
    if t.dim() != dim:
        raise ShapeError(f"{name} must be [T, H, D]; got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise LayoutError(
            f"{name} has strides {t.stride()}: the head dim D must be contiguous (stride 1); token-major [T, H, D] "
            "and head-major ([H, T, D].transpose(0, 1)) layouts are both read without copies"
        )


def _check_out(name: str, t, shape: tuple, dtype, dev) -> None:
    check_tensor(name, t, dev, (str(dtype).removeprefix("torch."),))
    if tuple(t.shape) != shape:
        raise ShapeError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def _check_algorithm(op: str, algorithm) -> None:
    if algorithm not in ALGORITHMS:
        raise PlanError(f"{op}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}; pass 'auto' to let the "
                        "communicator choose")


def _gather_nccl(ctx, t):
    """[W, *t.shape]: every rank's t through torch.distributed (allocates, copies).
    The caller ran nccl.handshake for its whole call."""
    import torch

    out = torch.empty((ctx.world_size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    nccl.all_gather(ctx, t.contiguous(), out, op=None)
    return out.view((ctx.world_size,) + tuple(t.shape))


def dcp_merge(ctx, out_partial, lse, *, scatter_heads: bool = False, lse_base: str = "e", return_lse: bool = False,
              out=None, lse_out=None, algorithm: str = "auto"):
    """Merge partial attention computed on W sequence shards of the KV cache.

    ctx: the calling Communicator's OpContext (comm.context).
    out_partial: [T, H, D] bf16/fp16/fp32, this rank's partial o (D contiguous;
    any T/H strides). lse: [T, H] fp32, any strides, natural log (lse_base "e")
    or log2 ("2"); -inf marks an empty shard, whose o may be NaN and is ignored.
    o = sum_r exp(lse_r - m) o_r / sum_r exp(lse_r - m), m = max_r lse_r, fp32
    in rank order (bitwise identical on every rank); rows with every shard empty
    give o = 0, lse = -inf; NaN or inf in a non-empty shard's o reaches the output
    even where its weight underflows to 0; a +inf lse on any rank makes that row's
    o NaN and its lse +inf, a NaN lse makes both NaN.

    scatter_heads: return only this rank's heads [rank * H / W, (rank + 1) * H / W)
    (H divisible by W), and receive only those from peers; else every head.
    Returns out [T, Hs, D] (o's dtype, contiguous), plus lse_out [T, Hs] fp32 if
    return_lse; out and lse_out share no memory with the inputs or each other
    (AliasingError). Allocates only outputs not given. No host sync. Capture-legal
    once the configuration ran eagerly. algorithm: "auto" (kernel within the
    staging capacity, else NCCL eagerly), "kernel", or "nccl" (all_gather +
    local merge; allocates).
    """
    import torch

    dev = ctx.device
    _check_rows("out_partial", out_partial, dev)
    T, H, D = out_partial.shape
    _check_dtype_device("lse", lse, dev, ("float32",))
    if tuple(lse.shape) != (T, H):
        raise ShapeError(f"lse must be [T, H] = {(T, H)} to match out_partial; got {tuple(lse.shape)}")
    if lse_base not in ("e", "2"):
        raise PlanError(f"lse_base must be 'e' (natural log) or '2' (log2), got {lse_base!r}")
    _check_algorithm("dcp_merge", algorithm)
    W = ctx.world_size
    if scatter_heads and H % W:
        raise ShapeError(f"scatter_heads splits H = {H} heads over {W} ranks; H must be a multiple of {W}")
    Hs = H // W if scatter_heads else H
    if out is None:
        out = torch.empty((T, Hs, D), dtype=out_partial.dtype, device=dev)
    _check_out("out", out, (T, Hs, D), out_partial.dtype, dev)
    if lse_out is None and return_lse:
        lse_out = torch.empty((T, Hs), dtype=torch.float32, device=dev)
    if lse_out is not None:
        _check_out("lse_out", lse_out, (T, Hs), torch.float32, dev)
    # blocks of every rank write rows that another block may still read (or stage to a peer)
    for name, t in (("out", out), ("lse_out", lse_out)):
        if t is not None:
            check_overlap(name, t, "out_partial", out_partial, in_place=False)
            check_overlap(name, t, "lse", lse, in_place=False)
    if lse_out is not None:
        check_overlap("lse_out", lse_out, "out", out, in_place=False)
    result = (out, lse_out) if return_lse else out
    n_rows = T * Hs
    if n_rows * D == 0:
        return result
    lse_off = -(-n_rows * D * out_partial.element_size() // 16) * 16
    if not use_kernel(ctx, "dcp_merge", lse_off + 4 * n_rows, algorithm):
        nccl.handshake(ctx, "dcp_merge", T, H, D, str(out_partial.dtype), bool(scatter_heads))
        o_all, lse_all = _gather_nccl(ctx, out_partial), _gather_nccl(ctx, lse)
        if scatter_heads:
            heads = slice(ctx.rank * Hs, (ctx.rank + 1) * Hs)
            o_all, lse_all = o_all[:, :, heads], lse_all[:, :, heads]
        o, l = merge_partials(o_all, lse_all, lse_base)
        out.copy_(o)
        if lse_out is not None:
            lse_out.copy_(l)
        return result
    cfg = row_config(ctx.caps, n_rows, D, out_partial.element_size())
    p_lse_out = lse_out if lse_out is not None else out  # never written when RETURN_LSE is False
    args = (out_partial, out_partial.stride(0), out_partial.stride(1), lse, lse.stride(0), lse.stride(1),
            out, out.stride(0), out.stride(1), p_lse_out, n_rows, Hs, D, lse_off)
    consts = dict(R=cfg.rows, BLOCK_D=cfg.block_d, SCATTER=bool(scatter_heads), BASE2=lse_base == "2",
                  RETURN_LSE=lse_out is not None)
    launch(ctx, "dcp_merge", dcp_merge_kernel, cfg=cfg, args=args, consts=consts,
           facts=(T, H, D, str(out_partial.dtype), bool(scatter_heads), cfg.grid))
    return result


def all_gather_heads(ctx, x, out=None, *, algorithm: str = "auto"):
    """out[:, r * Hs:(r + 1) * Hs] = rank r's x, bitwise.

    ctx: the calling Communicator's OpContext.
    x: [T, Hs, D] any dtype the comm ops take (D contiguous; any T/Hs strides).
    out: [T, W * Hs, D], x's dtype, contiguous, sharing no memory with x
    (AliasingError). Allocates out only if not given. algorithm: "auto",
    "kernel" or "nccl" (PlanError otherwise).
    No host sync. Capture-legal once the configuration ran eagerly.
    """
    import torch

    dev = ctx.device
    _check_rows("x", x, dev)
    T, Hs, D = x.shape
    W = ctx.world_size
    if out is None:
        out = torch.empty((T, W * Hs, D), dtype=x.dtype, device=dev)
    _check_out("out", out, (T, W * Hs, D), x.dtype, dev)
    check_overlap("out", out, "x", x, in_place=False)  # as all_gather: peers' heads land where x may be read
    _check_algorithm("all_gather_heads", algorithm)
    n_rows = T * Hs
    if n_rows * D == 0:
        return out
    if not use_kernel(ctx, "all_gather_heads", n_rows * D * x.element_size(), algorithm):
        nccl.handshake(ctx, "all_gather_heads", T, Hs, D, str(x.dtype))
        out.view(T, W, Hs, D).copy_(_gather_nccl(ctx, x).transpose(0, 1))
        return out
    cfg = row_config(ctx.caps, n_rows, D, x.element_size())
    args = (x, x.stride(0), x.stride(1), out, out.stride(0), out.stride(1), n_rows, Hs, D)
    launch(ctx, "all_gather_heads", all_gather_heads_kernel, cfg=cfg, args=args,
           consts=dict(R=cfg.rows, BLOCK_D=cfg.block_d), facts=(T, Hs, D, str(x.dtype), cfg.grid))
    return out
