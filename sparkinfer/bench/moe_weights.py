"""Random quantized expert weights for `sparkinfer bench moe`, built on the device
(no quantization pass over real-sized bf16 tensors).

Legend: E experts, N output rows, R reduction length. Imports torch and
sparkinfer.quant only when called (the benchmark sets TRITON_INTERPRET first).
"""

from __future__ import annotations

import math


def random_nvfp4(e: int, n: int, r: int, device):
    """NVFP4Tensor [E, N, R]: random E2M1 codes, E4M3 block scales in [0.5,
    1.875], global scale 1 / (3 sqrt(R)) (outputs of about unit size)."""
    import torch

    from sparkinfer.quant import NVFP4Tensor

    packed = torch.randint(0, 256, (e, n, r // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(0x30, 0x40, (e, n, r // 16), dtype=torch.uint8, device=device)
    gs = torch.full((e,), 1.0 / (3.0 * math.sqrt(r)), dtype=torch.float32, device=device)
    return NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), gs)


def random_fp8_block(e: int, n: int, r: int, device):
    """FP8BlockTensor [E, N, R]: E4M3 codes of magnitude 2**-3..2**3 (exponent
    fields 4..10, any mantissa and sign, no NaN) and block scales of (0.5..1.5)
    / (4 sqrt(R)); one uint8 temporary the size of the values."""
    import torch

    from sparkinfer.quant import FP8BlockTensor

    c = torch.randint(0, 112, (e, n, r), dtype=torch.uint8, device=device)
    c += 32 + (c >= 56).to(torch.uint8) * 72  # 0..55 -> 32..87, 56..111 -> 160..215 (sign bit)
    scale = (torch.rand(e, -(-n // 128), -(-r // 128), device=device) + 0.5) / (4 * math.sqrt(r))
    return FP8BlockTensor(c.view(torch.float8_e4m3fn), scale)
