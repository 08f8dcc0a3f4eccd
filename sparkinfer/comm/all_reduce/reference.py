"""fp32 reference: the sum over ranks, accumulated in rank order."""

import torch


def all_reduce_reference(inputs: list) -> torch.Tensor:
    """inputs: every rank's x [N], in rank order -> sum in fp32, cast to x's dtype."""
    acc = torch.zeros(inputs[0].shape, dtype=torch.float32, device="cpu")  # on the CPU under any default device
    for x in inputs:
        acc += x.float().cpu()
    return acc.to(inputs[0].dtype)
