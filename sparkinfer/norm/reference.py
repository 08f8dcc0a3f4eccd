"""fp32 reference of residual add + RMSNorm, the numerics `launch.py` matches.

residual_out = round(x + residual) in the storage dtype; the norm reads the
rounded residual_out in fp32 (the value the next layer sees); out is rounded
once. The same numerics as `sparkinfer.comm.fused_norm.reference.add_rms_norm`
with one rank.
"""

import torch


def add_rms_norm_reference(x, residual, weight, eps: float):
    """x, residual: [T, H]; weight: [H] -> (out, residual_out), residual's dtype.
    residual None: plain RMSNorm of x (residual_out is x)."""
    res = x if residual is None else (x.float() + residual.float()).to(residual.dtype)
    r = res.float()
    out = r * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return out.to(res.dtype), res
