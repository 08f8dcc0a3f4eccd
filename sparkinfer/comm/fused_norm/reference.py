"""fp32 reference of all-reduce + residual + RMSNorm (pure torch).

Numerics the kernel matches: the all-reduce sum is accumulated in fp32 in rank
order and is not rounded before the residual is added; residual_out is that sum
plus the residual, rounded to the storage dtype; the norm reads the rounded
residual_out (the value the next layer sees), in fp32.
"""

import torch


def add_rms_norm(summed, residual, weight, eps: float):
    """(out, residual_out) from an already reduced `summed` [T, H] (any float dtype).

    residual: [T, H]; weight: [H]. Math in fp32, outputs in residual's dtype.
    Allocates both outputs; used by the NCCL fallback too.
    """
    res_out = (summed.float() + residual.float()).to(residual.dtype)
    r = res_out.float()
    rstd = torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (r * rstd * weight.float()).to(residual.dtype)
    return out, res_out


def all_reduce_add_rms_norm_reference(inputs: list, residual, weight, eps: float):
    """inputs: every rank's x [T, H] in rank order -> (out, residual_out) on the CPU
    (whatever the default device: the GPU fault tests call it inside `torch.device("cuda")`)."""
    acc = torch.zeros(inputs[0].shape, dtype=torch.float32, device="cpu")
    for x in inputs:
        acc += x.float().cpu()
    return add_rms_norm(acc, residual.cpu(), weight.cpu(), eps)
