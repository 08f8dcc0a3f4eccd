"""`linear(x, w, bias)`: y = x @ w.T (+ bias) for the few rows of a decode step.

cuBLAS serves a handful of rows with split-K kernels and a separate reduce, or
with tiles that leave SMs idle (H200, 8-layer Qwen3-30B-A3B decode at batch 1,
benchmarks/results/decode_profile_h200.json: the o projection 7.2 + 1.7 us for
16.8 MB, the router 5.0 us for 0.5 MB); this kernel streams each weight once
with one program per block of output features and no second pass.
"""

from sparkinfer.linear.launch import LINEAR_MAX_ROWS, linear

__all__ = ["linear", "LINEAR_MAX_ROWS"]
