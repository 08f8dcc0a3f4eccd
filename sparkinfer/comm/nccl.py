"""The torch.distributed path of the comm ops (NCCL on GPUs, gloo on CPU ranks).

`dispatch.use_kernel` decides when an op comes here. These calls follow
torch.distributed's rules: they run on the current stream, and NCCL ones may
be captured in a CUDA graph. Eagerly, on ranks that share peer channels, each
call first runs a data-less handshake on the channel (`_handshake`), so ranks
that chose different paths raise instead of hanging.
"""

from __future__ import annotations

__all__ = ["all_reduce", "reduce_scatter", "all_gather"]


def _handshake(ctx, what: str, x) -> None:
    """Agree with every peer, on the peer channel, that this call leaves it for
    torch.distributed with this shape and dtype (protocol.handshake_kernel).

    Ranks whose sizes straddle the staging capacity (one in a kernel, one here)
    or that differ here get CollectiveMismatch on every rank within the deadline,
    never a hang in NCCL/gloo. One one-block launch: a few microseconds beside a
    transfer above the staging capacity. Skipped in capture (graphs replay what
    was checked eagerly) and where there is no peer channel."""
    if ctx.world_size == 1 or not ctx.caps.peer_access or ctx.capturing():
        return
    from sparkinfer.comm.dispatch import launch
    from sparkinfer.comm.protocol import handshake_kernel
    from sparkinfer.comm.topology import GridConfig

    launch(ctx, "nccl_fallback", handshake_kernel, cfg=GridConfig(grid=1, block=1, num_warps=1), args=(),
           consts={}, facts=(what, tuple(x.shape), str(x.dtype)))


def all_reduce(ctx, x, out):
    """out = sum of x over ranks. x, out: same shape and dtype; out may be x."""
    import torch.distributed as dist

    group = ctx.torch_group()
    _handshake(ctx, "all_reduce", x)
    if out.data_ptr() != x.data_ptr():
        out.copy_(x)
    dist.all_reduce(out, group=group)
    return out


def reduce_scatter(ctx, x, out):
    """out = rank r's 1/W of the sum of x over ranks. x: [M, *]; out: [M / W, *]."""
    import torch.distributed as dist

    group = ctx.torch_group()
    _handshake(ctx, "reduce_scatter", x)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def all_gather(ctx, x, out):
    """out = every rank's x concatenated along dim 0. x: [M, *] contiguous; out: [W * M, *]."""
    import torch.distributed as dist

    group = ctx.torch_group()
    _handshake(ctx, "all_gather", x)
    dist.all_gather_into_tensor(out, x, group=group)
    return out
