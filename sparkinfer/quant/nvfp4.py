"""NVFP4: E2M1 values, two per byte, one E4M3 scale per 16 elements along the
reduction axis, one fp32 global scale per matrix.

Legend: N output rows, R reduction length (the last axis; R % 16 == 0),
B... leading batch dims (for MoE weights: E experts).

Stored format (the one checkpoints use, ModelOpt-style):

- `packed`: uint8 [B..., N, R/2]; byte j holds element 2j in its low nibble and
  element 2j+1 in its high nibble.
- `scales`: float8_e4m3fn [B..., N, R/16]; block scale of elements 16g..16g+15.
- `global_scale`: fp32 [B...]; one per matrix.

value = e2m1(code) * float(scale) * global_scale. Quantization picks
global_scale = amax / (6 * 448), so the largest block scale lands at 448.
Layouts that kernels prefer (nibble interleaves) are made by
`sparkinfer.moe.prepare_weights`; they never leak into this format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparkinfer.errors import DTypeError, ShapeError
from sparkinfer.quant.reference import E2M1_MAX, E4M3_MAX, e2m1_codes_to_float, round_to_e2m1_codes, round_to_e4m3

__all__ = ["BLOCK", "NVFP4Tensor", "quantize_nvfp4", "dequantize_nvfp4", "from_checkpoint",
           "pack_codes", "unpack_codes", "matrices_per_chunk", "QUANTIZE_CHUNK_BYTES"]

BLOCK = 16  # elements per E4M3 block scale
# Quantizers take a stack of matrices (MoE experts [E, N, R]) this many fp32 bytes at a time:
# their torch temporaries are about 4.3x the input's fp32 size (bench/decode_memory.py), so one
# GLM-4.5-Air layer's w1 (128 x 2,816 x 4,096) in one piece needed about 25 GB beside the model.
# Matrices are independent (one global scale each), so the chunks give the same bits.
QUANTIZE_CHUNK_BYTES = 1 << 28


@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor in the stored NVFP4 format (see module docstring).

    packed: uint8 [B..., N, R/2]; scales: float8_e4m3fn [B..., N, R/16];
    global_scale: fp32 [B...] (a 0-dim tensor for a single matrix).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [B..., N, R] of the unpacked tensor."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def nbytes(self) -> int:
        """Bytes of packed values and block scales (the global scales are negligible)."""
        return self.packed.numel() + self.scales.numel()


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [..., R] (R even, values 0..15) to bytes [..., R/2], low nibble first.

    Allocates; no host sync.
    """
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_codes`: bytes [..., R/2] -> codes [..., R]. Allocates; no host sync."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4Tensor:
    """Quantize `w` [B..., N, R] (bf16/fp16/fp32, R % 16 == 0) to NVFP4.

    global_scale: optional fp32 [B...] to use instead of amax / (6 * 448)
    (for example to match a checkpoint's). A matrix of zeros gets global scale 1.
    Block scales are rounded to E4M3 nearest-even (saturating at 448, subnormals
    kept); values are divided by the rounded block scale and rounded to E2M1
    nearest-even, saturating at 6. Allocates; syncs only to reject NaN/inf;
    not capture-legal (use at load time).
    """
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"quantize_nvfp4: w dtype {w.dtype}; pass bf16, fp16 or fp32")
    if w.dim() < 2 or w.shape[-1] % BLOCK != 0:
        raise ShapeError(f"quantize_nvfp4: w shape {tuple(w.shape)}; need [..., N, R] with "
                         f"R a multiple of {BLOCK}")
    if global_scale is not None and global_scale.shape != w.shape[:-2]:
        raise ShapeError(f"quantize_nvfp4: global_scale shape {tuple(global_scale.shape)}, "
                         f"expected {tuple(w.shape[:-2])} (one per matrix)")
    per_chunk = matrices_per_chunk(w)
    if per_chunk is None:
        return _quantize(w, global_scale)
    lead, (n, r) = w.shape[:-2], w.shape[-2:]
    flat, gs_flat = w.reshape(-1, n, r), None if global_scale is None else global_scale.reshape(-1)
    packed = torch.empty(flat.shape[0], n, r // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(flat.shape[0], n, r // BLOCK, dtype=torch.float8_e4m3fn, device=w.device)
    gs = torch.empty(flat.shape[0], dtype=torch.float32, device=w.device)
    for a in range(0, flat.shape[0], per_chunk):
        part = slice(a, a + per_chunk)
        t = _quantize(flat[part], None if gs_flat is None else gs_flat[part])
        packed[part], scales[part], gs[part] = t.packed, t.scales, t.global_scale
    return NVFP4Tensor(packed.reshape(*lead, n, r // 2), scales.reshape(*lead, n, r // BLOCK), gs.reshape(lead))


def matrices_per_chunk(w: torch.Tensor) -> int | None:
    """Matrices of a stack w [B..., N, R] a quantizer takes at a time (QUANTIZE_CHUNK_BYTES of
    fp32, at least one); None when w is one matrix or fits in one chunk. Pure."""
    per = w.shape[-2] * w.shape[-1] * 4
    if w.dim() < 3 or w.numel() * 4 <= QUANTIZE_CHUNK_BYTES:
        return None
    return max(1, QUANTIZE_CHUNK_BYTES // per)


def _quantize(w: torch.Tensor, global_scale: torch.Tensor | None) -> NVFP4Tensor:
    x = w.float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("quantize_nvfp4: w holds NaN or inf; NVFP4 cannot represent them")
    lead = x.shape[:-2]
    if global_scale is None:
        amax = x.abs().flatten(-2).amax(-1) if x.dim() > 2 else x.abs().amax()
        gs = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    else:
        gs = global_scale.float()
    gs_b = gs.reshape(*lead, 1, 1)
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)  # [B..., N, R/16, 16]
    bmax = blocks.abs().amax(-1)  # [B..., N, R/16]
    scales = round_to_e4m3(bmax / (E2M1_MAX * gs_b))
    denom = (scales.float() * gs_b).unsqueeze(-1)
    q = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, 1.0), 0.0)
    codes = round_to_e2m1_codes(q).reshape(x.shape)
    return NVFP4Tensor(pack_codes(codes), scales, gs.to(torch.float32))


def dequantize_nvfp4(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode `t` to a dense [B..., N, R] tensor of `dtype` (math in fp32, then cast).

    Allocates; no host sync.
    """
    vals = e2m1_codes_to_float(unpack_codes(t.packed))  # [B..., N, R]
    vals = vals.reshape(*vals.shape[:-1], -1, BLOCK) * t.scales.float().unsqueeze(-1)
    lead = t.packed.shape[:-2]
    vals = vals.flatten(-2) * t.global_scale.float().reshape(*lead, 1, 1)
    return vals.to(dtype)


def from_checkpoint(packed: torch.Tensor, scales: torch.Tensor,
                    global_scale: torch.Tensor) -> NVFP4Tensor:
    """Wrap tensors that are already NVFP4 (for example a ModelOpt checkpoint's
    `weight`, `weight_scale`, `weight_scale_2`) after checking them.

    packed: uint8 (or int8) [B..., N, R/2]; scales: float8_e4m3fn (or its uint8
    bits) [B..., N, R/16], linear row-major order (swizzled cutlass layouts are
    not accepted); global_scale: fp32 [B...] or one element per matrix.
    Views only; no copy unless a dtype reinterpretation needs one; no host sync.
    """
    if packed.dtype == torch.int8:
        packed = packed.view(torch.uint8)
    if packed.dtype != torch.uint8:
        raise DTypeError(f"from_checkpoint: packed dtype {packed.dtype}; expected uint8 "
                         "(two E2M1 codes per byte)")
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    if scales.dtype != torch.float8_e4m3fn:
        raise DTypeError(f"from_checkpoint: scales dtype {scales.dtype}; expected "
                         "torch.float8_e4m3fn (E4M3 block scales)")
    if global_scale.dtype != torch.float32:
        raise DTypeError(f"from_checkpoint: global_scale dtype {global_scale.dtype}; expected "
                         "torch.float32")
    if packed.dim() < 2:
        raise ShapeError(f"from_checkpoint: packed shape {tuple(packed.shape)}; need [..., N, R/2]")
    n, r = packed.shape[-2], packed.shape[-1] * 2
    want = (*packed.shape[:-1], r // BLOCK)
    if r % BLOCK != 0 or tuple(scales.shape) != want:
        raise ShapeError(f"from_checkpoint: scales shape {tuple(scales.shape)} does not match "
                         f"packed {tuple(packed.shape)}; expected {want} (one scale per "
                         f"{BLOCK} of the R={r} reduction elements of each of N={n} rows)")
    lead = tuple(packed.shape[:-2])
    if tuple(global_scale.shape) != lead:
        if global_scale.numel() == math.prod(lead):
            global_scale = global_scale.reshape(lead)
        else:
            raise ShapeError(f"from_checkpoint: global_scale shape {tuple(global_scale.shape)}; "
                             f"expected {lead} (one per matrix)")
    return NVFP4Tensor(packed, scales, global_scale)
