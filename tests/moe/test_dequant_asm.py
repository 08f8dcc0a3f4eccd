"""Bit-exact emulation of the PTX that decodes NVFP4 on the GPU (`NVFP4_WORD_ASM`),
fed by the prepared layout (`pack_words`, `scale_codes`).

The interpreter cannot run inline PTX, so this test executes the shipped asm
text with a tiny emulator of the instructions it uses (shf.l.wrap, and, lop3,
mul.rn.bf16x2, with subnormal bf16 inputs kept) over every code in every
position of a word and every E4M3 scale byte, and compares with the exact
NVFP4 values times 2**-8.
"""

import re

import pytest
import torch

from sparkinfer.moe.kernels.common import NVFP4_WORD_ASM
from sparkinfer.moe.weights import pack_words, scale_codes
from sparkinfer.quant.reference import e2m1_codes_to_float

M32 = 0xFFFFFFFF


def _lop3(a, b, c, lut):
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _bf16(bits):
    b = bits & 0xFFFF
    return torch.tensor([b - 0x10000 if b & 0x8000 else b], dtype=torch.int16).view(
        torch.bfloat16).double().item()


def _mul_bf16x2(a, b):
    out = 0
    for half in range(2):
        x = _bf16(a >> (16 * half)) * _bf16(b >> (16 * half))  # exact in fp64
        y = torch.tensor([x], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item()
        out |= (y & 0xFFFF) << (16 * half)
    return out


def run_asm(word, pair):
    """word: prepared 32-bit word; pair: the (S, S) bf16 scale pair. -> 8 decoded values."""
    regs = {f"${i}": 0 for i in range(6)}
    regs["$4"], regs["$5"] = word, pair

    def val(tok):
        return regs[tok] if tok in regs else int(tok, 0)

    for line in NVFP4_WORD_ASM.value.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], [val(a) for a in args[1:]]
        if op == "shf.l.wrap.b32":
            lo, hi, n = srcs
            r = (((hi << 32) | lo) << (n & 31)) >> 32
        elif op == "and.b32":
            r = srcs[0] & srcs[1]
        elif op == "lop3.b32":
            r = _lop3(*srcs)
        elif op == "mul.rn.bf16x2":
            r = _mul_bf16x2(*srcs)
        else:
            raise AssertionError(f"emulator lacks {op}")
        regs[d] = r & M32
    return [_bf16(regs[f"${j}"] >> (16 * h)) for j in range(4) for h in range(2)]


def _scale_pair(c):
    return (c * 0x00100010 + 0x76007600) & M32  # `scale_pair` in kernels/common.py


def _e4m3(byte):
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).double().item()


@pytest.mark.parametrize("shift", range(8), ids=lambda s: f"codes-rotated-{s}")
def test_asm_decodes_every_code_in_every_position(shift):
    codes = (torch.arange(16 * 8, dtype=torch.uint8) * 3 + shift) % 16  # each code in each slot
    scales = torch.tensor([0x38, 0x7E, 0x01, 0x35, 0x83, 0x07, 0x00, 0x44],
                          dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1, 448, 2**-9, ...
    for w in range(16):
        blk = codes[8 * w:8 * w + 8].repeat(2)  # one 16-element block
        sb = scales[w % 8:w % 8 + 1]
        c, blk2 = scale_codes(sb, blk)
        word = int(pack_words(blk2)[:4].view(torch.int32).item()) & M32
        got = run_asm(word, _scale_pair(int(c.item())))
        want = e2m1_codes_to_float(blk[:8]).double() * sb.double() * 2.0 ** -8
        assert got == want.tolist(), (w, blk[:8].tolist(), hex(sb.view(torch.uint8).item()))


def test_scale_codes_cover_every_e4m3_byte():
    """Every E4M3 byte: the decoded products of code 2 (1.0) and code 10 (-1.0)
    are +-scale * 2**-8, NaN for NaN scales."""
    blk = torch.tensor([2, 10] * 8, dtype=torch.uint8)
    for byte in range(256):
        s = torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn)
        c, blk2 = scale_codes(s, blk)
        word = int(pack_words(blk2)[:4].view(torch.int32).item()) & M32
        got = run_asm(word, _scale_pair(int(c.item())))[:2]
        want = [_e4m3(byte) * 2.0 ** -8, -_e4m3(byte) * 2.0 ** -8]
        if byte & 0x7F == 0x7F:
            assert all(x != x for x in got), byte
        else:
            assert got == want and [str(x)[0] for x in got] == [str(x)[0] for x in want], byte


def test_asm_uses_only_emulated_instructions():
    ops = {line.split()[0] for line in NVFP4_WORD_ASM.value.splitlines()
           if re.match(r"\s*[a-z]", line) and not line.strip().startswith(".reg")}
    assert ops <= {"shf.l.wrap.b32", "and.b32", "lop3.b32", "mul.rn.bf16x2"}
