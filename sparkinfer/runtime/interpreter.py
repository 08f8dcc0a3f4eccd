"""Triton's interpreter (CPU ranks, CI) with dots that do not depend on the host's BLAS.

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

__all__ = ["exact_dots"]

_installed = False


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
