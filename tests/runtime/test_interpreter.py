"""The interpreter's replaced internals (`sparkinfer.runtime.interpreter.install`, run by
the tests' conftest as in CPU ranks): the same dtypes as Triton's own lookup, jitted
helpers called from a kernel give the same values with `triton.language`'s builtins
restored after the launch, block types and shapes read as Triton's own (names, counts,
errors), bf16 casts give the general converter's bits, and fp32 dots' bits follow the K order,
not the kernel's K step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as triton_interpreter

from sparkinfer.runtime import interpreter

DTYPES = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32,
          tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15]


def test_the_dtype_table_is_tritons():
    assert triton_interpreter._get_np_dtype is not interpreter._replaced["get_np_dtype"]  # installed
    own, ours = interpreter._replaced["get_np_dtype"], triton_interpreter._get_np_dtype
    kinds = DTYPES + [tl.pointer_type(tl.float32)] + [tl.block_type(t, [4]) for t in DTYPES]
    kinds.append(tl.block_type(tl.pointer_type(tl.bfloat16), [2, 8]))
    assert [ours(t) for t in kinds] == [own(t) for t in kinds]


@triton.jit
def _scaled_max(x, y, s):
    return tl.maximum(x, y) * s


@triton.jit
def _twice(x, y):
    return _scaled_max(x, y, 2.0) + tl.sum(x, axis=0)


@triton.jit
def _helpers_kernel(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x, y = tl.load(x_ptr + o), tl.load(y_ptr + o)
    tl.store(out_ptr + o, _twice(x, y))


def _builtins() -> dict:
    return {(pkg.__name__, name): getattr(pkg, name) for pkg in (tl, tl.math, tl.core.tensor)
            for name in dir(pkg) if tl.core.is_builtin(getattr(pkg, name))}


def test_helpers_called_from_a_kernel_give_their_values_and_leave_the_builtins():
    before = _builtins()
    assert len(before) > 100
    x, y = torch.randn(3 * 16), torch.randn(3 * 16)
    out = torch.full_like(x, float("nan"))
    _helpers_kernel[(3,)](x, y, out, BLOCK=16)
    want = torch.maximum(x, y) * 2 + x.view(3, 16).sum(1).repeat_interleave(16)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert _builtins() == before


def test_block_types_and_shapes_read_as_tritons():
    """Names, counts and shapes as Triton 3.6's own code makes them (printed by it unpatched)."""
    b = tl.block_type(tl.float32, [8, tl.constexpr(64)])
    assert b.name == "<['8', '64'], fp32>" and str(b) == b.name and b.numel == 512
    assert type(b.shape) is tl.core.tuple and list(b.shape) == [8, 64]
    assert b.shape.type.name == "[:constexpr_type[8],:constexpr_type[64]]"
    assert b == tl.block_type(tl.float32, (8, 64)) and b != tl.block_type(tl.float16, [8, 64])
    assert b.with_element_ty(tl.bfloat16).name == "<['8', '64'], bf16>"
    assert tl.core.tuple([1, 2]).type.name == "[:constexpr_type[1],:constexpr_type[2]]"
    assert tl.core.tuple([1, 2]).type == tl.core.tuple([tl.constexpr(1), 2]).type
    assert tl.core.tuple([3, 5]).type.name == "[:constexpr_type[3],:constexpr_type[5]]"  # any ints, not a shape
    with pytest.raises(ValueError, match="power of 2"):
        tl.block_type(tl.float32, [3])
    with pytest.raises(TypeError, match="0d block_type"):
        tl.block_type(tl.float32, [])
    tl.block_type(tl.float32, [2])  # a float shape must not pass as the int one seen before (equal keys)
    with pytest.raises(TypeError, match="must have type"):
        tl.block_type(tl.float32, [tl.constexpr(2.0)])


@triton.jit
def _shapes_kernel(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    tl.static_assert(x.shape[0] == R and x.shape[1] == C and x.numel == R * C)
    tl.store(out_ptr + tl.arange(0, R), tl.sum(x, 1) + x.shape[1] + x.numel)


def test_tensor_shapes_in_a_kernel():
    x = torch.randn(4, 8)
    out = torch.full((4,), float("nan"))
    _shapes_kernel[(1,)](x, out, R=4, C=8)
    torch.testing.assert_close(out, x.sum(1) + 8 + 32, rtol=1e-6, atol=1e-6)


def _bits(n: int, width: int, seed: int) -> np.ndarray:
    """n random bit patterns of `width` bits (every class: zeros, normals, subnormals, inf, NaN)."""
    rng = np.random.default_rng(seed)
    dtype = np.uint16 if width == 16 else np.uint32
    x = rng.integers(0, 1 << width, n, dtype=np.uint64).astype(dtype)
    x[:4] = [0, 1 << (width - 1), (0xFF << (width - 9)), 0x7FC0 << (width - 16)]  # +0, -0, inf, NaN
    return x


@pytest.mark.parametrize("up", [True, False], ids=["bf16-to-fp32", "fp32-to-bf16"])
def test_bf16_casts_give_the_converters_bits(up):
    own, ours = interpreter._replaced["convert_float"], triton_interpreter._convert_float
    assert ours is not own  # installed
    src, dst = (tl.bfloat16, tl.float32) if up else (tl.float32, tl.bfloat16)
    x = _bits(1 << 16, 16, 1) if up else _bits(1 << 16, 32, 2).view(np.float32)
    exponent, significand = (0x7F80, 0x7F) if up else (0x7F800000, 0x7FFFFF)
    raw = x.view(np.uint16 if up else np.uint32)
    subnormal = ((raw & exponent) == 0) & ((raw & significand) != 0)
    assert subnormal.any() and not subnormal.all()
    normal = x[~subnormal]
    # strided and without subnormals (the one-pass path), then with them (the converter's)
    for block in (normal[: normal.size // 2 * 2].reshape(-1, 2)[:, ::-1], x):
        got, want = ours(block, src, dst, None), own(block, src, dst, None)
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


@triton.jit
def _wrap_kernel(x_ptr, out_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(x_ptr + o)
    tl.store(out_ptr + o, x * x + x - 7)


def test_int32_arithmetic_wraps_unchecked_without_debug():
    """The overflow checks are not built (debug off, where Triton's interpreter built and
    discarded them): int32 products still wrap as they did, in two's complement."""
    options = triton_interpreter.interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow
    x = torch.tensor([3, 46341, -2**31 + 5, 2**31 - 1], dtype=torch.int32)
    out = torch.zeros_like(x)
    _wrap_kernel[(1,)](x, out, N=4)
    want = (x.long() * x.long() + x.long() - 7 + 2**31) % 2**32 - 2**31
    assert torch.equal(out.long(), want)


@triton.jit
def _dot_in_steps(p_a, p_b, p_out, K: tl.constexpr, BK: tl.constexpr):
    o_m, o_n = tl.arange(0, 16), tl.arange(0, 32)
    acc = tl.zeros([16, 32], dtype=tl.float32)
    for k in tl.static_range(0, K, BK):
        o_k = k + tl.arange(0, BK)
        a = tl.load(p_a + o_m[:, None] * K + o_k[None, :]).to(tl.float32)
        b = tl.load(p_b + o_k[:, None] * 32 + o_n[None, :]).to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(p_out + o_m[:, None] * 32 + o_n[None, :], acc)


def _grouped_reference(a, b):
    """fp32 accumulator, one float64 sum of DOT_GROUP products added at a time, in K order."""
    a64, b64, g = a.double(), b.double(), interpreter.DOT_GROUP
    acc = torch.zeros(a.shape[0], b.shape[1])
    for k in range(0, a.shape[1], g):
        acc += (a64[:, k:k + g] @ b64[k:k + g]).float()
    return acc


def test_fp32_dots_give_the_same_bits_at_any_k_step():
    """A K of 256 in steps of 32, 64 and 256 (bf16 operands upcast, as our kernels run
    them): the same bits, those of runs of DOT_GROUP added in K order. A dot rounded once
    per call gave steps of 64 and 128 other bits in one NVFP4 layer test's FC1 element."""
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-3, 3, 256).bfloat16()  # magnitudes far apart: sums that round
    a = (torch.randn(16, 256, generator=g).bfloat16() * scale)
    b = torch.randn(256, 32, generator=g).bfloat16()
    outs = []
    for bk in (interpreter.DOT_GROUP, 64, 256):
        out = torch.full((16, 32), float("nan"))
        _dot_in_steps[(1,)](a, b, out, K=256, BK=bk)
        outs.append(out)
    ref = _grouped_reference(a.float(), b.float())
    for out in outs:
        assert torch.equal(out, ref)
    once = (a.double() @ b.double()).float()
    assert not torch.equal(once, ref)  # the inputs are ones where the grouping shows


def test_grouped_dot_handles_batches_and_short_k():
    """Leading batch dims group like 2-D ones; a K that DOT_GROUP does not divide is one run."""
    g = np.random.default_rng(1)
    a, b = g.standard_normal((3, 8, 96)).astype(np.float32), g.standard_normal((3, 96, 8)).astype(np.float32)
    d = g.standard_normal((3, 8, 8)).astype(np.float32)
    out = interpreter.grouped_dot(a, b, d)
    run = interpreter.DOT_GROUP
    for i in range(3):
        want = d[i].copy()  # the accumulator first, then each run in K order
        for k in range(0, 96, run):
            want += (a[i, :, k:k + run].astype(np.float64) @ b[i, k:k + run].astype(np.float64)).astype(np.float32)
        assert np.array_equal(out[i], want)
    a, b, d = a[0, :, :8], b[0, :8], d[0]
    assert np.array_equal(interpreter.grouped_dot(a, b, d),
                          (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32) + d)
