"""torch.library ops for decode context parallelism (so they work inside torch.compile).

    torch.ops.sparkinfer.dcp_merge(out_partial, lse, comm.id, scatter_heads, "e") -> (out, lse_out)
    torch.ops.sparkinfer.all_gather_heads(x, comm.id) -> out

`register()` defines them once per process (never at import); it is meant to be
called from sparkinfer.comm.torch_ops.register_ops next to the other collectives.
"""

__all__ = ["register"]

_DONE = False


def register() -> None:
    """Define the ops (idempotent)."""
    global _DONE
    if _DONE:
        return
    import torch

    from sparkinfer.comm.communicator import get_communicator

    @torch.library.custom_op("sparkinfer::dcp_merge", mutates_args=())
    def dcp_merge(out_partial: torch.Tensor, lse: torch.Tensor, comm_id: int, scatter_heads: bool,
                  lse_base: str) -> tuple[torch.Tensor, torch.Tensor]:
        return get_communicator(comm_id).dcp_merge(out_partial, lse, scatter_heads=scatter_heads, lse_base=lse_base,
                                                   return_lse=True)

    @dcp_merge.register_fake
    def _(out_partial, lse, comm_id, scatter_heads, lse_base):
        T, H, D = out_partial.shape
        hs = H // get_communicator(comm_id).world_size if scatter_heads else H
        return out_partial.new_empty((T, hs, D)), lse.new_empty((T, hs))

    @torch.library.custom_op("sparkinfer::all_gather_heads", mutates_args=())
    def all_gather_heads(x: torch.Tensor, comm_id: int) -> torch.Tensor:
        return get_communicator(comm_id).all_gather_heads(x)

    @all_gather_heads.register_fake
    def _(x, comm_id):
        T, hs, D = x.shape
        return x.new_empty((T, get_communicator(comm_id).world_size * hs, D))

    _DONE = True
