"""Every torch.library op of sparkinfer, so the collectives work inside torch.compile.

    torch.ops.sparkinfer.all_reduce(x, comm.id, "auto") -> out
    torch.ops.sparkinfer.reduce_scatter(x, comm.id) -> out
    torch.ops.sparkinfer.all_gather(x, comm.id) -> out
    torch.ops.sparkinfer.all_reduce_add_rms_norm(x, residual, weight, eps, comm.id, "auto") -> (out, residual_out)
    torch.ops.sparkinfer.all_reduce_add_rms_norm_(...)  # in place: x <- out, residual <- residual_out
    torch.ops.sparkinfer.dcp_merge(out_partial, lse, comm.id, scatter_heads, "e") -> (out, lse_out)
    torch.ops.sparkinfer.all_gather_heads(x, comm.id) -> out

Ops take no Python objects, so a communicator is named by the integer id that
`attach` gives it; the ops call the op functions with its OpContext.
Registration happens when the first Communicator attaches, never at import.
"""

# No `from __future__ import annotations`: torch.library reads the ops' annotations as types.
import itertools
import weakref

from sparkinfer.errors import LifecycleError

__all__ = ["attach", "detach", "context", "register_ops"]

_LIVE: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_DONE = False


def attach(comm) -> int:
    """Name `comm` (anything with a `context` attribute) by a new id, define the
    ops if this is the first, and return the id. Held weakly."""
    register_ops()
    comm_id = next(_IDS)
    _LIVE[comm_id] = comm
    return comm_id


def detach(comm_id: int) -> None:
    """Forget the id (the communicator closed); later ops naming it raise."""
    _LIVE.pop(comm_id, None)


def context(comm_id: int):
    """The OpContext of the live communicator with this id."""
    comm = _LIVE.get(comm_id)
    if comm is None:
        raise LifecycleError(f"no live Communicator with id {comm_id}; it was closed or garbage-collected")
    return comm.context


def register_ops() -> None:
    """Define the sparkinfer:: custom ops once per process (idempotent)."""
    global _DONE
    if _DONE:
        return
    _register_collectives()
    _register_fused_norm()
    _register_dcp()
    _DONE = True


def _register_collectives() -> None:
    import torch

    from sparkinfer.comm.all_gather.launch import all_gather as all_gather_op
    from sparkinfer.comm.all_reduce.launch import all_reduce as all_reduce_op
    from sparkinfer.comm.reduce_scatter.launch import reduce_scatter as reduce_scatter_op

    @torch.library.custom_op("sparkinfer::all_reduce", mutates_args=())
    def all_reduce(x: torch.Tensor, comm_id: int, algorithm: str) -> torch.Tensor:
        return all_reduce_op(context(comm_id), x, algorithm=algorithm)

    @all_reduce.register_fake
    def _(x, comm_id, algorithm):
        return torch.empty_like(x)

    @torch.library.custom_op("sparkinfer::reduce_scatter", mutates_args=())
    def reduce_scatter(x: torch.Tensor, comm_id: int) -> torch.Tensor:
        return reduce_scatter_op(context(comm_id), x)

    @reduce_scatter.register_fake
    def _(x, comm_id):
        w = context(comm_id).world_size
        return x.new_empty((x.shape[0] // w,) + tuple(x.shape[1:]))

    @torch.library.custom_op("sparkinfer::all_gather", mutates_args=())
    def all_gather(x: torch.Tensor, comm_id: int) -> torch.Tensor:
        return all_gather_op(context(comm_id), x)

    @all_gather.register_fake
    def _(x, comm_id):
        w = context(comm_id).world_size
        return x.new_empty((x.shape[0] * w,) + tuple(x.shape[1:]))


def _register_fused_norm() -> None:
    import torch

    from sparkinfer.comm.fused_norm.launch import all_reduce_add_rms_norm

    @torch.library.custom_op("sparkinfer::all_reduce_add_rms_norm", mutates_args=())
    def fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm_id: int,
              algorithm: str) -> tuple[torch.Tensor, torch.Tensor]:
        return all_reduce_add_rms_norm(context(comm_id), x, residual, weight, eps, algorithm=algorithm)

    @fused.register_fake
    def _(x, residual, weight, eps, comm_id, algorithm):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.custom_op("sparkinfer::all_reduce_add_rms_norm_", mutates_args=("x", "residual"))
    def fused_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm_id: int,
               algorithm: str) -> None:
        all_reduce_add_rms_norm(context(comm_id), x, residual, weight, eps, out=x, residual_out=residual,
                                algorithm=algorithm)

    @fused_.register_fake
    def _(x, residual, weight, eps, comm_id, algorithm):
        return None


def _register_dcp() -> None:
    import torch

    from sparkinfer.comm.dcp.launch import all_gather_heads as all_gather_heads_op
    from sparkinfer.comm.dcp.launch import dcp_merge as dcp_merge_op

    @torch.library.custom_op("sparkinfer::dcp_merge", mutates_args=())
    def dcp_merge(out_partial: torch.Tensor, lse: torch.Tensor, comm_id: int, scatter_heads: bool,
                  lse_base: str) -> tuple[torch.Tensor, torch.Tensor]:
        return dcp_merge_op(context(comm_id), out_partial, lse, scatter_heads=scatter_heads, lse_base=lse_base,
                            return_lse=True)

    @dcp_merge.register_fake
    def _(out_partial, lse, comm_id, scatter_heads, lse_base):
        T, H, D = out_partial.shape
        hs = H // context(comm_id).world_size if scatter_heads else H
        return out_partial.new_empty((T, hs, D)), lse.new_empty((T, hs))

    @torch.library.custom_op("sparkinfer::all_gather_heads", mutates_args=())
    def all_gather_heads(x: torch.Tensor, comm_id: int) -> torch.Tensor:
        return all_gather_heads_op(context(comm_id), x)

    @all_gather_heads.register_fake
    def _(x, comm_id):
        T, hs, D = x.shape
        return x.new_empty((T, context(comm_id).world_size * hs, D))
