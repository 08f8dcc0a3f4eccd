"""`linear(x, w, bias)`: y = x @ w.T (+ bias) for the few rows of a decode step.

cuBLAS serves a handful of rows with split-K kernels and a separate reduce, or
with tiles that leave SMs idle; this kernel streams each weight once with one
program per 64 output features and no second pass: 3-12% faster than cuBLAS on
the decode projections of Qwen3-30B-A3B and GLM-4.5-Air on an H200
(benchmarks/results/sweeps/linear_sweep_h200.json; `launch.py` has the numbers).
"""

from sparkinfer.linear.launch import LINEAR_MAX_ROWS, linear, linear_sync

__all__ = ["linear", "linear_sync", "LINEAR_MAX_ROWS"]
