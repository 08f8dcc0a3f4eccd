"""fp32 reference of `linear`: the exact products summed in fp64, rounded once to x's dtype."""

import torch


def linear_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) in fp64, as fp32 [M, N] (the kernel's
    result before its one rounding to x's dtype, up to its fp32 summation)."""
    y = x.double() @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.float()
