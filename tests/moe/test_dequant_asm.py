"""Bit-exact emulation of the PTX that decodes NVFP4 on the GPU (`E2M1_BF16_ASM`).

The interpreter cannot run inline PTX, so this test executes the shipped asm
text with a tiny emulator of the instructions it uses (mov, shl, shr, and,
prmt, lop3, mul.rn.bf16x2) over every byte value and a set of E4M3 scales, and
compares with the exact NVFP4 values.
"""

import re

import pytest
import torch

from sparkinfer.moe.kernels.common import E2M1_BF16_ASM
from sparkinfer.quant.reference import e2m1_codes_to_float

M32 = 0xFFFFFFFF


def _prmt(a, b, c):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = src[sel & 7]
        if sel & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a, b, c, lut):
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _bf16(bits):
    b = bits & 0xFFFF
    return torch.tensor([b - 0x10000 if b & 0x8000 else b], dtype=torch.int16).view(
        torch.bfloat16).float().item()


def _mul_bf16x2(a, b):
    out = 0
    for half in range(2):
        x = _bf16(a >> (16 * half)) * _bf16(b >> (16 * half))
        y = torch.tensor([x], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item()
        out |= (y & 0xFFFF) << (16 * half)
    return out


def run_asm(word, scale_lo_pairs, scale_hi_pairs):
    """word: 4 bytes; scale_*_pairs: per byte, the (s, s) bf16 pair register."""
    regs = {f"${i}": 0 for i in range(13)}
    regs["$4"] = word
    for i in range(4):
        regs[f"${5 + i}"] = scale_lo_pairs[i]
        regs[f"${9 + i}"] = scale_hi_pairs[i]

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in E2M1_BF16_ASM.value.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], [val(a) for a in args[1:]]
        if op == "mov.b32":
            r = srcs[0]
        elif op == "shl.b32":
            r = srcs[0] << srcs[1]
        elif op == "shr.b32":
            r = srcs[0] >> srcs[1]
        elif op == "and.b32":
            r = srcs[0] & srcs[1]
        elif op == "prmt.b32":
            r = _prmt(*srcs)
        elif op == "lop3.b32":
            r = _lop3(*srcs)
        elif op == "mul.rn.bf16x2":
            r = _mul_bf16x2(*srcs)
        else:
            raise AssertionError(f"emulator lacks {op}")
        regs[d] = r & M32
    regs = {k: v & M32 for k, v in regs.items()}
    lo = [_bf16(regs["$0"]), _bf16(regs["$0"] >> 16), _bf16(regs["$1"]), _bf16(regs["$1"] >> 16)]
    hi = [_bf16(regs["$2"]), _bf16(regs["$2"] >> 16), _bf16(regs["$3"]), _bf16(regs["$3"] >> 16)]
    return lo, hi


def _pair(x):
    b = torch.tensor([x], dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
    return b | (b << 16)


SCALES = [1.0, 448.0, 2.0 ** -9, 0.8125, 3 * 2.0 ** -8, 240.0]  # E4M3 values, subnormals too


@pytest.mark.parametrize("shift", range(3), ids=lambda s: f"scales-rotated-{s}")
def test_asm_decodes_every_byte_exactly(shift):
    codes = torch.arange(256)
    vlo, vhi = e2m1_codes_to_float(codes & 15), e2m1_codes_to_float(codes >> 4)
    for w in range(0, 256, 4):
        # a different scale for every value: catches any mix-up of elements
        s_lo = [SCALES[(w // 4 + i + shift) % len(SCALES)] for i in range(4)]
        s_hi = [SCALES[(w // 4 + 2 * i + shift + 1) % len(SCALES)] for i in range(4)]
        word = w | ((w + 1) << 8) | ((w + 2) << 16) | ((w + 3) << 24)
        lo, hi = run_asm(word, [_pair(s) for s in s_lo], [_pair(s) for s in s_hi])
        assert lo == [vlo[w + i].item() * s_lo[i] for i in range(4)], f"bytes {w}..{w + 3}"
        assert hi == [vhi[w + i].item() * s_hi[i] for i in range(4)], f"bytes {w}..{w + 3}"


def test_asm_uses_only_emulated_instructions():
    ops = {line.split()[0] for line in E2M1_BF16_ASM.value.splitlines()
           if re.match(r"\s*[a-z]", line) and not line.strip().startswith(".reg")}
    assert ops <= {"mov.b32", "shl.b32", "shr.b32", "and.b32", "prmt.b32", "lop3.b32",
                   "mul.rn.bf16x2"}
