"""torch.library registrations, so the collectives work inside torch.compile.

    torch.ops.sparkinfer.all_reduce(x, comm.id, "auto")
    torch.ops.sparkinfer.reduce_scatter(x, comm.id)
    torch.ops.sparkinfer.all_gather(x, comm.id)
    torch.ops.sparkinfer.all_reduce_add_rms_norm(...), dcp_merge(...), all_gather_heads(...)

The communicator is named by its integer id (ops take no Python objects).
Registration happens on the first Communicator, never at import.
"""


__all__ = ["register_ops"]

_DONE = False


def register_ops() -> None:
    """Define the sparkinfer:: custom ops once per process (idempotent)."""
    global _DONE
    if _DONE:
        return
    import torch

    from sparkinfer.comm.communicator import get_communicator

    @torch.library.custom_op("sparkinfer::all_reduce", mutates_args=())
    def all_reduce(x: torch.Tensor, comm_id: int, algorithm: str) -> torch.Tensor:
        return get_communicator(comm_id).all_reduce(x, algorithm=algorithm)

    @all_reduce.register_fake
    def _(x, comm_id, algorithm):
        return torch.empty_like(x)

    @torch.library.custom_op("sparkinfer::reduce_scatter", mutates_args=())
    def reduce_scatter(x: torch.Tensor, comm_id: int) -> torch.Tensor:
        return get_communicator(comm_id).reduce_scatter(x)

    @reduce_scatter.register_fake
    def _(x, comm_id):
        w = get_communicator(comm_id).world_size
        return x.new_empty((x.shape[0] // w,) + tuple(x.shape[1:]))

    @torch.library.custom_op("sparkinfer::all_gather", mutates_args=())
    def all_gather(x: torch.Tensor, comm_id: int) -> torch.Tensor:
        return get_communicator(comm_id).all_gather(x)

    @all_gather.register_fake
    def _(x, comm_id):
        w = get_communicator(comm_id).world_size
        return x.new_empty((x.shape[0] * w,) + tuple(x.shape[1:]))

    from sparkinfer.comm.dcp.ops import register as register_dcp
    from sparkinfer.comm.fused_norm.ops import register as register_fused_norm

    register_fused_norm()  # sparkinfer::all_reduce_add_rms_norm(_)
    register_dcp()  # sparkinfer::dcp_merge, sparkinfer::all_gather_heads
    _DONE = True
