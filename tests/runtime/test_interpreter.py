"""The interpreter's replaced internals (`sparkinfer.runtime.interpreter.cheaper_calls`,
installed by the tests' conftest as in CPU ranks): the same dtypes as Triton's own
lookup, and jitted helpers called from a kernel give the same values, with
`triton.language`'s builtins restored after the launch."""

from __future__ import annotations

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
