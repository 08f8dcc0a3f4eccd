"""Reading NVFP4 linears of a ModelOpt checkpoint by slices, and joining gate and up.

Legend: N output rows, R reduction length, E experts; `_l` this rank's share.

A ModelOpt NVFP4 linear `<prefix>` stores `<prefix>.weight` uint8 [N, R/2] (two
E2M1 codes per byte, low nibble first), `<prefix>.weight_scale` float8_e4m3fn
[N, R/16], `<prefix>.weight_scale_2` fp32 scalar (the global scale) and
`<prefix>.input_scale` (activation scale; not used: activations stay bf16).
Rows slice freely; the reduction axis slices only at multiples of 16 (one
block scale covers 16 elements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.errors import CheckpointError, ShapeError
from sparkinfer.models.checkpoint import FLOAT_DTYPES, Checkpoint
from sparkinfer.models.fp8_io import is_fp8, read_dense_fp8
from sparkinfer.quant.nvfp4 import BLOCK, NVFP4Tensor, dequantize_nvfp4
from sparkinfer.quant.reference import round_to_e4m3

__all__ = ["is_nvfp4", "read_nvfp4", "read_dense", "join_gate_up", "FoldStats"]

_PACKED = (torch.uint8, torch.int8)
_SCALES = (torch.float8_e4m3fn, torch.uint8)


def is_nvfp4(ckpt: Checkpoint, prefix: str) -> bool:
    """True when `<prefix>.weight` is packed NVFP4 (uint8 beside a `weight_scale`)."""
    name = f"{prefix}.weight"
    return (ckpt.has(name) and ckpt.has(f"{prefix}.weight_scale")
            and ckpt.dtype(name) in _PACKED)


def read_nvfp4(ckpt: Checkpoint, prefix: str, shape: tuple[int, int], *, dim: int = 0,
               span: tuple[int, int] | None = None, device="cpu") -> NVFP4Tensor:
    """Read rows (dim 0) or reduction indices (dim 1, multiples of 16) [span) of the
    NVFP4 linear `prefix` whose logical shape is `shape` = (N, R).

    Returns an NVFP4Tensor: packed uint8 [N_l, R_l/2], scales float8_e4m3fn
    [N_l, R_l/16], global_scale fp32 0-dim. Allocates on `device`; no bf16 copy.
    """
    n, r = shape
    if r % BLOCK:
        raise CheckpointError(f"{prefix}: NVFP4 reduction length {r} is not a multiple of {BLOCK}")
    what = f"NVFP4 of a logical [{n}, {r}] weight"
    ckpt.expect(f"{prefix}.weight", (n, r // 2), _PACKED, what=what)
    ckpt.expect(f"{prefix}.weight_scale", (n, r // BLOCK), _SCALES, what=what)
    gname = f"{prefix}.weight_scale_2"
    if ckpt.shape(gname) not in ((), (1,)) or ckpt.dtype(gname) != torch.float32:
        raise CheckpointError(f"tensor {gname!r} in {ckpt.file_of(gname)} has shape "
                              f"{ckpt.shape(gname)} and dtype {ckpt.dtype(gname)}; expected one "
                              "fp32 global scale")
    if span is None or dim == 0:
        packed = ckpt.read(f"{prefix}.weight", dim=0, span=span, device=device)
        scales = ckpt.read(f"{prefix}.weight_scale", dim=0, span=span, device=device)
    else:
        a, b = span
        if a % BLOCK or b % BLOCK:
            raise ShapeError(f"{prefix}: slice [{a}, {b}) of the NVFP4 reduction axis does not "
                             f"start and end on a {BLOCK}-element block; a tensor-parallel shard "
                             f"of this axis must be a multiple of {BLOCK} (choose another world "
                             "size)")
        packed = ckpt.read(f"{prefix}.weight", dim=1, span=(a // 2, b // 2), device=device)
        scales = ckpt.read(f"{prefix}.weight_scale", dim=1, span=(a // BLOCK, b // BLOCK),
                           device=device)
    if packed.dtype == torch.int8:
        packed = packed.view(torch.uint8)
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    gs = ckpt.read(gname, device=device).reshape(())
    return NVFP4Tensor(packed, scales, gs)


def read_dense(ckpt: Checkpoint, prefix: str, shape: tuple[int, int], *, dim: int = 0,
               span: tuple[int, int] | None = None, device="cpu",
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Read the linear `prefix` ([N, R] = `shape`), rows (dim 0) or columns (dim 1)
    [span), as a dense `dtype` tensor: stored float weights are cast, NVFP4 ones
    (quantized non-expert linears of a ModelOpt checkpoint) and FP8 block ones
    (every linear of an FP8 checkpoint, `fp8_io`) are dequantized.
    Allocates on `device`.
    """
    if is_fp8(ckpt, prefix):
        return read_dense_fp8(ckpt, prefix, shape, dim=dim, span=span, device=device, dtype=dtype)
    if is_nvfp4(ckpt, prefix):
        if dim == 1 and span is not None and (span[0] % BLOCK or span[1] % BLOCK):
            lo, hi = span[0] // BLOCK * BLOCK, -(-span[1] // BLOCK) * BLOCK
            t = read_nvfp4(ckpt, prefix, shape, dim=1, span=(lo, hi), device=device)
            return dequantize_nvfp4(t, dtype)[:, span[0] - lo:span[1] - lo].contiguous()
        return dequantize_nvfp4(read_nvfp4(ckpt, prefix, shape, dim=dim, span=span,
                                           device=device), dtype)
    name = f"{prefix}.weight"
    ckpt.expect(name, shape, FLOAT_DTYPES, what=f"[{shape[0]}, {shape[1]}] from config.json")
    return ckpt.read(name, dim=dim, span=span, dtype=dtype, device=device)


@dataclass(frozen=True)
class FoldStats:
    """E4M3 block scales changed by `join_gate_up`: how many, and the largest
    relative change of the value they scale (0 when every fold was exact)."""

    inexact: int = 0
    max_rel: float = 0.0

    def __add__(self, other: FoldStats) -> FoldStats:
        return FoldStats(self.inexact + other.inexact, max(self.max_rel, other.max_rel))


def join_gate_up(gate: NVFP4Tensor, up: NVFP4Tensor) -> tuple[NVFP4Tensor, FoldStats]:
    """Stack gate [E, I_l, R] and up [E, I_l, R] (global scales [E] each) into one
    NVFP4Tensor [E, 2 * I_l, R] with one global scale per expert.

    The kernels take one global scale per matrix. Where gate and up differ, the
    larger one becomes the matrix's and the ratio (< 1) is folded into the other
    side's E4M3 block scales, rounded to nearest; the stats say how many block
    scales could not hold it exactly (none when the global scales match, or when
    their ratio is a power of two that keeps every block scale representable).
    Allocates; one host sync (the stats).
    """
    g = torch.maximum(gate.global_scale, up.global_scale)  # [E]
    stats = FoldStats()

    def fold(t: NVFP4Tensor):
        ratio = (t.global_scale / g).reshape(-1, 1, 1)
        new = round_to_e4m3(t.scales.float() * ratio)
        was = t.scales.double() * t.global_scale.double().reshape(-1, 1, 1)
        now = new.double() * g.double().reshape(-1, 1, 1)
        bad = was != now
        rel = ((now - was).abs() / was.clamp_min(1e-300))[bad]
        return new, FoldStats(int(bad.sum()), float(rel.max()) if rel.numel() else 0.0)

    sg, stats_g = fold(gate)
    su, stats_u = fold(up)
    joined = NVFP4Tensor(torch.cat([gate.packed, up.packed], dim=-2),
                         torch.cat([sg, su], dim=-2), g.float())
    return joined, stats + stats_g + stats_u
