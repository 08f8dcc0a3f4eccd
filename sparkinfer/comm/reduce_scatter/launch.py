"""Host side of reduce-scatter."""

from __future__ import annotations

from sparkinfer.comm import nccl
from sparkinfer.comm.all_reduce.kernel import twoshot_all_reduce_kernel
from sparkinfer.comm.dispatch import check_overlap, check_tensor, launch, use_kernel
from sparkinfer.comm.topology import GridConfig, check_grid_config, grid_config
from sparkinfer.errors import ShapeError

__all__ = ["reduce_scatter"]


def reduce_scatter(ctx, x, out=None, *, config: GridConfig | None = None):
    """out = rank r's 1/W of sum over ranks of x, split along dim 0.

    ctx: the calling Communicator's OpContext. x: [M, *] with M divisible by W.
    out: [M / W, *], same dtype. config: an explicit launch shape (as in
    all_reduce); None: topology.grid_config of a rank's share.
    Allocates out only if not given. No host sync. Capture-legal after a warm-up.
    """
    import torch

    W = ctx.world_size
    check_tensor("x", x, ctx.device)
    if x.dim() == 0 or x.shape[0] % W:
        raise ShapeError(f"reduce_scatter splits dim 0 over {W} ranks; x has shape {tuple(x.shape)} "
                         f"(pad dim 0 to a multiple of {W})")
    oshape = (x.shape[0] // W,) + tuple(x.shape[1:])
    if out is None:
        out = torch.empty(oshape, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, ctx.device)
        if tuple(out.shape) != oshape or out.dtype != x.dtype:
            raise ShapeError(f"out must be {oshape} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
        check_overlap("out", out, "x", x, in_place=False)
    n = x.numel()
    if n == 0:
        return out
    if config is not None:
        check_grid_config(config, ctx.caps)
    if not use_kernel(ctx, "reduce_scatter", n * x.element_size(), "auto"):
        return nccl.reduce_scatter(ctx, x, out)
    chunk = n // W
    cfg = config or grid_config(ctx.caps, chunk * x.element_size())
    launch(ctx, "reduce_scatter", twoshot_all_reduce_kernel, cfg=cfg, args=(x, out, n, chunk),
           consts=dict(BLOCK=cfg.block, GATHER=False, PIPE=cfg.pipe), facts=(n, str(x.dtype), cfg.grid, cfg.pipe))
    return out
