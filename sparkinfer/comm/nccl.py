"""The torch.distributed path of the comm ops (NCCL on GPUs, gloo on CPU ranks).

`dispatch.use_kernel` decides when an op comes here. These calls follow
torch.distributed's rules: they run on the current stream, and NCCL ones may
be captured in a CUDA graph. Eagerly, on ranks that share peer channels, each
public call first runs one data-less handshake on the channel (`handshake`), so
ranks that chose different paths or ops raise instead of hanging.
"""

from __future__ import annotations

__all__ = ["handshake", "all_reduce", "reduce_scatter", "all_gather"]


def handshake(ctx, op: str, *facts) -> None:
    """Agree with every peer, on the peer channel, that this call of public op `op`
    leaves it for torch.distributed with these facts (shapes, dtypes, options:
    what the op's kernel fingerprints) (protocol.handshake_kernel).

    Ranks whose sizes straddle the staging capacity (one in a kernel, one here)
    or that differ here get CollectiveMismatch on every rank within the deadline,
    never a hang in NCCL/gloo. The public op is part of the fingerprint, not only
    the torch.distributed call underneath: with the call alone, all_gather_heads
    against dcp_merge of the same shape agreed on dcp_merge's first gather and
    only the dcp_merge rank timed out, and the fused norm against all_reduce
    both returned. One one-block launch: a few microseconds beside a transfer
    above the staging capacity. Skipped in capture (graphs replay what was
    checked eagerly) and where there is no peer channel."""
    if ctx.world_size == 1 or not ctx.caps.peer_access or ctx.capturing():
        return
    from sparkinfer.comm.dispatch import launch
    from sparkinfer.comm.protocol import handshake_kernel
    from sparkinfer.comm.topology import GridConfig

    launch(ctx, "nccl_fallback", handshake_kernel, cfg=GridConfig(grid=1, block=1, num_warps=1), args=(),
           consts={}, facts=(op, *facts))


def _agree(ctx, op, what: str, x) -> None:
    if op is not None:
        handshake(ctx, op, what, tuple(x.shape), str(x.dtype))


def all_reduce(ctx, x, out, *, op: str | None = "all_reduce"):
    """out = sum of x over ranks. x, out: same shape and dtype; out may be x.
    op: the public op of this call, for the handshake; None: the caller ran
    `handshake` for its whole call (so for every torch.distributed call in it)."""
    import torch.distributed as dist

    group = ctx.torch_group()
    _agree(ctx, op, "all_reduce", x)
    if out.data_ptr() != x.data_ptr():
        out.copy_(x)
    dist.all_reduce(out, group=group)
    return out


def reduce_scatter(ctx, x, out, *, op: str | None = "reduce_scatter"):
    """out = rank r's 1/W of the sum of x over ranks. x: [M, *]; out: [M / W, *]. op: as all_reduce's."""
    import torch.distributed as dist

    group = ctx.torch_group()
    _agree(ctx, op, "reduce_scatter", x)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def all_gather(ctx, x, out, *, op: str | None = "all_gather"):
    """out = every rank's x concatenated along dim 0. x: [M, *] contiguous; out: [W * M, *]. op: as all_reduce's."""
    import torch.distributed as dist

    group = ctx.torch_group()
    _agree(ctx, op, "all_gather", x)
    dist.all_gather_into_tensor(out, x, group=group)
    return out
