"""Triton's interpreter (CPU ranks, CI) with dots that do not depend on the host's BLAS,
and without two costs of its own that bought nothing (`install` does both).

The interpreter runs `tl.dot` as `numpy.matmul` in the accumulator's dtype, so an fp32
dot is an OpenBLAS sgemm whose per-element summation follows the matmul's shape: on an
AMD EPYC host (OpenBLAS 0.3.29's Haswell kernels, numpy 2.2) a row's dot in a
[128, 64] x [64, 256] matmul had other fp32 bits than the same row's in a [64, 64] one,
so tiles of one kernel that agree bitwise on the GPU disagreed there
(`tests/linear/test_gemm.py::test_every_tile_gives_the_same_bits`), and a TP 3 model's
logits drifted past their tolerance against transformers; on the hosts before it the
same tests passed. `exact_dots` makes each fp32 dot float64 products summed in float64,
rounded once to fp32, then added to the accumulator: our kernels' interpreted operands
are bf16 or fp16 values upcast (products exact in float64, and sums of them too unless
their magnitudes span more than about 2^30), so the bits no longer follow the blocking.
"""

from __future__ import annotations

__all__ = ["install", "exact_dots", "cheaper_calls"]

_installed = False
_calls_installed = False
_replaced: dict[str, object] = {}  # the interpreter's own functions that cheaper_calls replaced


def install() -> None:
    """`exact_dots` and `cheaper_calls` (idempotent; no-ops unless TRITON_INTERPRET=1)."""
    exact_dots()
    cheaper_calls()


def exact_dots() -> None:
    """Install the exact fp32 dot into Triton's interpreter (idempotent; a no-op unless
    TRITON_INTERPRET=1). Other dtypes keep the interpreter's own dot."""
    global _installed
    from sparkinfer.envs import triton_interpret

    if _installed or not triton_interpret():
        return
    import numpy as np
    from triton.runtime import interpreter

    own = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype == b.data.dtype == d.data.dtype == np.float32:
            dot = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
            return interpreter.TensorHandle(dot + d.data, d.dtype.scalar)
        return own(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot
    _installed = True


def cheaper_calls() -> None:
    """Two of Triton 3.6's interpreter costs, same results. Every call of a jitted helper
    from inside a kernel re-patches `triton.language` by walking each package with
    `inspect.getmembers` (about 0.8 ms a call), and every dtype lookup builds a dict of
    17 dtypes: in a CPU rank's interpreted prefill of the tiny Qwen3 MoE (2 layers,
    cProfile) those were 25 of 94 s. The walk is done once per package here (its
    builtins are module and class attributes, fixed after import), each call patching
    the same names the walk would find: the ones whose current value is still a builtin.
    The dtype table is built once. Idempotent; a no-op unless TRITON_INTERPRET=1."""
    global _calls_installed
    from sparkinfer.envs import triton_interpret

    if _calls_installed or not triton_interpret():
        return
    import inspect

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    names: dict[object, list[str]] = {}  # package (a module or a class) -> its builtins' names

    def patch_builtin(pkg, builder, scope):
        if pkg not in names:
            names[pkg] = [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name in names[pkg]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    own_dtype = interpreter._get_np_dtype
    table = {t: own_dtype(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
                                       tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5,
                                       tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
    pointer = np.dtype(np.uint64)

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            return pointer if isinstance(tt_dtype.element_ty, tl.pointer_type) else table[tt_dtype.element_ty]
        return table[tt_dtype]

    _replaced.update(patch_builtin=interpreter._patch_builtin, get_np_dtype=own_dtype)
    interpreter._patch_builtin = patch_builtin
    interpreter._get_np_dtype = np_dtype
    _calls_installed = True
