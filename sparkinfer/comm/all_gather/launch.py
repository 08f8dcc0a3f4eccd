"""Host side of all-gather."""

from __future__ import annotations

from sparkinfer.comm import nccl
from sparkinfer.comm.all_gather.kernel import all_gather_kernel
from sparkinfer.comm.dispatch import check_overlap, check_tensor, launch, use_kernel
from sparkinfer.comm.topology import GridConfig, check_grid_config, grid_config
from sparkinfer.errors import ShapeError

__all__ = ["all_gather"]


def all_gather(ctx, x, out=None, *, config: GridConfig | None = None):
    """out = concat over ranks (in group-rank order) of x along dim 0.

    ctx: the calling Communicator's OpContext. x: [M, *]; out: [W * M, *], same
    dtype (bitwise copies of every rank's x). config: an explicit launch shape
    (as in all_reduce); None: topology.grid_config of x's bytes.
    Allocates out only if not given. No host sync. Capture-legal after a warm-up.
    """
    import torch

    W = ctx.world_size
    check_tensor("x", x, ctx.device, ("bfloat16", "float16", "float32", "int32", "int64", "uint8"))
    if x.dim() == 0:
        raise ShapeError("all_gather concatenates along dim 0; x is 0-dimensional (use x.reshape(1))")
    oshape = (W * x.shape[0],) + tuple(x.shape[1:])
    if out is None:
        out = torch.empty(oshape, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, ctx.device, (str(x.dtype).removeprefix("torch."),))
        if tuple(out.shape) != oshape:
            raise ShapeError(f"out must have shape {oshape}, got {tuple(out.shape)}")
        check_overlap("out", out, "x", x, in_place=False)
    m = x.numel()
    if m == 0:
        return out
    if config is not None:
        check_grid_config(config, ctx.caps)
    if not use_kernel(ctx, "all_gather", W * m * x.element_size(), "auto"):
        return nccl.all_gather(ctx, x, out)
    cfg = config or grid_config(ctx.caps, m * x.element_size())
    launch(ctx, "all_gather", all_gather_kernel, cfg=cfg, args=(x, out, m), consts=dict(BLOCK=cfg.block),
           facts=(m, str(x.dtype), cfg.grid))
    return out
