"""The torch.distributed path of the comm ops (NCCL on GPUs, gloo on CPU ranks).

`dispatch.use_kernel` decides when an op comes here. These calls follow
torch.distributed's rules: they run on the current stream, and NCCL ones may
be captured in a CUDA graph; they never touch the peer channels.
"""

from __future__ import annotations

__all__ = ["all_reduce", "reduce_scatter", "all_gather"]


def all_reduce(ctx, x, out):
    """out = sum of x over ranks. x, out: same shape and dtype; out may be x."""
    import torch.distributed as dist

    group = ctx.torch_group()
    if out.data_ptr() != x.data_ptr():
        out.copy_(x)
    dist.all_reduce(out, group=group)
    return out


def reduce_scatter(ctx, x, out):
    """out = rank r's 1/W of the sum of x over ranks. x: [M, *]; out: [M / W, *]."""
    import torch.distributed as dist

    dist.reduce_scatter_tensor(out, x, group=ctx.torch_group())
    return out


def all_gather(ctx, x, out):
    """out = every rank's x concatenated along dim 0. x: [M, *] contiguous; out: [W * M, *]."""
    import torch.distributed as dist

    dist.all_gather_into_tensor(out, x, group=ctx.torch_group())
    return out
