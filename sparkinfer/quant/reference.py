"""Exact reference math for the FP4 (E2M1) and FP8 (E4M3) number formats of
NVFP4 and FP8 block scaling.

Pure torch, elementwise, no rounding shortcuts: every function here is the
definition the kernels and `nvfp4.py` are tested against.

E2M1 (4 bits: sign, 2 exponent bits, 1 mantissa bit, bias 1, no inf/nan):
codes 0..7 are the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0.5 is the one
subnormal); bit 3 is the sign. E4M3 (`torch.float8_e4m3fn`): largest finite
value 448, subnormals down to 2**-9.
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_MAX", "E4M3_MAX", "E2M1_VALUES", "round_to_e2m1_codes", "e2m1_codes_to_float",
           "round_to_e4m3", "e4m3_rne_reference"]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Magnitude of each E2M1 code 0..7; code | 8 is the negative value.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Round-to-nearest-even boundaries between consecutive magnitudes. A tie goes to
# the even code (mantissa bit 0): 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0,
# 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0. `strict` means the boundary itself rounds down.
_BOUNDS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False),
           (5.0, True))


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round `x` (any float dtype, any shape) to E2M1 codes, nearest-even, saturating at 6.

    Returns uint8 codes in 0..15 with x's shape. NaN rounds to code 0 (E2M1 has
    no NaN; callers reject NaN before quantizing). -0.0 and values that round to
    zero keep their sign bit only when negative and nonzero after rounding.
    Allocates; no host sync.
    """
    a = x.float().abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, strict in _BOUNDS:
        code += (a > bound if strict else a >= bound).to(torch.uint8)
    neg = (x < 0) & (code > 0)
    return code | (neg.to(torch.uint8) << 3)


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode uint8 E2M1 codes (0..15, any shape) to fp32. Allocates; no host sync."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                         device=codes.device)
    return table[codes.long()]


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 `x` to `torch.float8_e4m3fn`, nearest-even, saturating at 448.

    torch's own cast maps values above 448 to NaN, so the clamp comes first.
    Subnormals (below 2**-6) round to multiples of 2**-9. Allocates; no host sync.
    """
    return x.float().clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_rne_reference(x: torch.Tensor) -> torch.Tensor:
    """fp32 value of `x` (any sign) rounded to E4M3 by arithmetic alone: nearest
    even, saturating at +-448, subnormals in steps of 2**-9, sign kept (-0.0 for
    negatives that round to zero). The definition torch's float8_e4m3fn cast
    (behind `round_to_e4m3` and `sparkinfer.quant.fp8`) is tested against.

    A magnitude a in [2**e, 2**(e+1)) (e >= -6; below 2**-6, e = -6) has 3
    mantissa bits, so it rounds to a multiple of 2**(e-3); torch.round is
    half-to-even. Allocates; no host sync.
    """
    a = x.float().abs().clamp(max=E4M3_MAX)
    _, exp = torch.frexp(a)  # a = m * 2**exp, m in [0.5, 1)
    quantum = torch.ldexp(torch.ones_like(a), (exp - 1).clamp(min=-6) - 3)
    return torch.copysign(torch.round(a / quantum) * quantum, x.float())
