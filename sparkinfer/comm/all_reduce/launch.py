"""Host side of all-reduce: validate, choose the algorithm, launch."""

from __future__ import annotations

from sparkinfer.comm import nccl
from sparkinfer.comm.all_reduce.kernel import (
    oneshot_all_reduce_kernel,
    oneshot_ll_all_reduce_kernel,
    twoshot_all_reduce_kernel,
)
from sparkinfer.comm.dispatch import check_overlap, check_tensor, launch, use_kernel
from sparkinfer.comm.topology import (
    ALGORITHMS,
    GridConfig,
    check_grid_config,
    grid_config,
    ll_grid_config,
    select_algorithm,
)
from sparkinfer.errors import CapacityError, PlanError, ShapeError

__all__ = ["all_reduce", "twoshot_chunk"]


def twoshot_chunk(n: int, world_size: int) -> int:
    """Elements each rank owns in a two-shot all-reduce (a multiple of 64 for 16-byte vectors)."""
    per_rank = -(-n // world_size)
    return -(-per_rank // 64) * 64


def all_reduce(ctx, x, out=None, *, algorithm: str = "auto", config: GridConfig | None = None):
    """out = sum of x over ranks, bitwise identical on every rank.

    ctx: the calling Communicator's OpContext (comm.context). x: [*]
    bf16/fp16/fp32, contiguous, on ctx.device. out: like x (may be x; AliasingError if it
    overlaps x otherwise).
    algorithm: "auto" (topology.select_algorithm; NCCL above the staging
    capacity outside capture), "ll", "oneshot", "twoshot" or "nccl" (PlanError otherwise).
    config: the launch shape of the kernel that runs (benchmark sweeps, tests);
    None: topology.grid_config / ll_grid_config of the bytes it stages. Every
    rank must pass the same (it is part of the fingerprint); PlanError if it is
    not a shape check_grid_config accepts.
    Allocates out only if not given. No host sync. Legal in CUDA graph capture
    (inside pool.capture) for configurations that ran once eagerly.
    """
    import torch

    check_tensor("x", x, ctx.device)
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise PlanError(f"algorithm must be 'auto' or one of {ALGORITHMS}, got {algorithm!r}; pass 'auto' to let "
                        "the communicator choose")
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor("out", out, ctx.device)
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ShapeError(f"out must match x: got {tuple(out.shape)}/{out.dtype} for x {tuple(x.shape)}/{x.dtype}")
        check_overlap("out", out, "x", x, in_place=True)
    n, nbytes = x.numel(), x.numel() * x.element_size()
    if n == 0:
        return out
    if config is not None:
        check_grid_config(config, ctx.caps)
    if not use_kernel(ctx, "all_reduce", nbytes, algorithm):
        return nccl.all_reduce(ctx, x, out)
    if algorithm == "auto":
        algorithm = select_algorithm(ctx.caps, nbytes, x.dtype)
    if algorithm == "ll" and nbytes % 4:
        algorithm = "oneshot"  # LL moves 4-byte words; odd 16-bit counts take the plain one-shot
    W, dtype = ctx.world_size, str(x.dtype)
    if algorithm == "ll":
        if 2 * nbytes > ctx.layout.ll_lane_bytes:
            raise CapacityError(
                f"all_reduce with algorithm='ll' carries at most {ctx.layout.ll_lane_bytes // 2} B on this channel, "
                f"got {nbytes} B; use algorithm='auto' or 'oneshot'"
            )
        cfg = config or ll_grid_config(ctx.caps, nbytes)
        launch(ctx, "all_reduce_ll", oneshot_ll_all_reduce_kernel, cfg=cfg, args=(x, out, nbytes // 4),
               consts=dict(BLOCK=cfg.block, HALF=x.element_size() == 2), facts=(n, dtype, cfg.grid), region="ll")
    elif algorithm == "oneshot":
        cfg = config or grid_config(ctx.caps, nbytes)
        launch(ctx, "all_reduce_oneshot", oneshot_all_reduce_kernel, cfg=cfg, args=(x, out, n),
               consts=dict(BLOCK=cfg.block, PIPE=cfg.pipe), facts=(n, dtype, cfg.grid, cfg.pipe))
    else:
        chunk = twoshot_chunk(n, W)
        cfg = config or grid_config(ctx.caps, chunk * x.element_size())
        launch(ctx, "all_reduce_twoshot", twoshot_all_reduce_kernel, cfg=cfg, args=(x, out, n, chunk),
               consts=dict(BLOCK=cfg.block, GATHER=True, PIPE=cfg.pipe), facts=(n, dtype, cfg.grid, cfg.pipe))
    return out
