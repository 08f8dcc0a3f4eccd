"""Host side of the one-rank RMSNorm kernels: check, allocate unless given, launch."""

from __future__ import annotations

import torch
import triton

from sparkinfer.envs import triton_interpret
from sparkinfer.errors import DTypeError, LayoutError, ShapeError
from sparkinfer.norm.kernel import add_rms_norm_kernel

__all__ = ["add_rms_norm", "check_rows", "rms_norm", "row_launch"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_rows(name: str, t: torch.Tensor, h: int) -> None:
    """Refuse a [T, H] operand that is not [T, h], 16/32-bit float, last dim contiguous."""
    if t.dim() != 2 or t.shape[1] != h:
        raise ShapeError(f"{name} must be [T, H={h}]; got {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise DTypeError(f"{name} dtype {t.dtype}; use bf16, fp16 or fp32")
    if t.stride(1) != 1:
        raise LayoutError(f"{name} must have a contiguous last dim; strides {t.stride()}")


# add_rms_norm launched with programmatic dependent launch (kernel.py, WAIT): behind a
# projection (`linear` lets its successor launch at entry) its programs could be
# resident when the projection ends (compiled for sm_90 on the CPU:
# tests/models/test_compile_sm90.py).
# On since an H100 A/B (moe/routing/launch.py has its numbers).
NORM_WAIT = True


def row_launch(h: int, device) -> dict:
    """Launch options of a one-program-a-row norm kernel over rows of h elements: the whole row
    in one block (BLOCK_H), 512 elements a warp up to 16, PDL (its successor may launch at
    entry) on a GPU."""
    block = triton.next_power_of_2(h)
    return dict(BLOCK_H=block, PDL=torch.device(device).type == "cuda", num_warps=min(16, max(1, block // 512)))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, *, out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None):
    """(out, residual_out) = (rmsnorm(x + residual) * weight, x + residual).

    x, residual: [T, H] (rows may be strided, last dim contiguous); weight: [H].
    residual None: plain RMSNorm, residual_out is x. residual_out may alias
    residual (in place). Allocates outputs not given; no host sync;
    capture-legal with outputs given (and without: the caching allocator
    serves captures).
    """
    h = weight.shape[-1]
    check_rows("x", x, h)
    if weight.shape != (h,):
        raise ShapeError(f"weight must be [H]; got {tuple(weight.shape)}")
    if residual is not None:
        check_rows("residual", residual, h)
        if residual.shape != x.shape or residual.device != x.device:
            raise ShapeError(f"residual {tuple(residual.shape)} on {residual.device} must match x "
                             f"{tuple(x.shape)} on {x.device}")
        if residual_out is None:
            residual_out = torch.empty_like(residual)
        check_rows("residual_out", residual_out, h)
    dtype = residual.dtype if residual is not None else x.dtype
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    check_rows("out", out, h)
    t = x.shape[0]
    if t:
        wait = NORM_WAIT and x.device.type != "cpu" and not triton_interpret()
        res = residual if residual is not None else x
        res_out = residual_out if residual is not None else out
        add_rms_norm_kernel[(t,)](x, res, weight, out, res_out, h, x.stride(0), res.stride(0),
                                  out.stride(0), res_out.stride(0), float(eps),
                                  HAS_RES=residual is not None, WAIT=wait, **row_launch(h, x.device),
                                  **(dict(launch_pdl=True) if wait else {}))
    return out, (residual_out if residual is not None else x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None):
    """rmsnorm(x) * weight, x: [T, H]; see add_rms_norm."""
    return add_rms_norm(x, None, weight, eps, out=out)[0]
