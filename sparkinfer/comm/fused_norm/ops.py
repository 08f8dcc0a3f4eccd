"""torch.library ops for the fused norm (so it works inside torch.compile).

    torch.ops.sparkinfer.all_reduce_add_rms_norm(x, residual, weight, eps, comm.id, "auto") -> (out, residual_out)
    torch.ops.sparkinfer.all_reduce_add_rms_norm_(x, residual, weight, eps, comm.id, "auto")
        # in place: x <- out, residual <- residual_out

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

    @torch.library.custom_op("sparkinfer::all_reduce_add_rms_norm", mutates_args=())
    def fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm_id: int,
              algorithm: str) -> tuple[torch.Tensor, torch.Tensor]:
        return get_communicator(comm_id).all_reduce_add_rms_norm(x, residual, weight, eps, algorithm=algorithm)

    @fused.register_fake
    def _(x, residual, weight, eps, comm_id, algorithm):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.custom_op("sparkinfer::all_reduce_add_rms_norm_", mutates_args=("x", "residual"))
    def fused_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm_id: int,
               algorithm: str) -> None:
        get_communicator(comm_id).all_reduce_add_rms_norm(x, residual, weight, eps, out=x, residual_out=residual,
                                                          algorithm=algorithm)

    @fused_.register_fake
    def _(x, residual, weight, eps, comm_id, algorithm):
        return None

    _DONE = True
