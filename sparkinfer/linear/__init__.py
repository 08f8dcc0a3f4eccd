"""`linear(x, w, bias)`: y = x @ w.T (+ bias) for the rows of a decode step (M <= 128).

One Triton kernel whose sums per output element depend on the weight and the
device only, so a row's result is the same bits at any batch; decode
projections load each program's weight slice before waiting for the previous
kernel (programmatic dependent launch). `config.py` has the tile choice and the
measurements behind it, `kernel.py` the schedules, `reference.py` the fp32
reference. `gemm` is its prefill counterpart: many rows, tiles chosen by the output's size, a row's
result again the same bits at any M (`gemm.py`).
"""

from sparkinfer.linear.config import LinearTile, linear_tile
from sparkinfer.linear.gemm import GEMM_NARROW, GEMM_WIDE, gemm, gemm_tile
from sparkinfer.linear.launch import LINEAR_MAX_ROWS, LINEAR_PDL, linear, linear_sync

__all__ = ["linear", "linear_sync", "linear_tile", "LinearTile", "LINEAR_MAX_ROWS", "LINEAR_PDL", "gemm",
           "GEMM_WIDE", "GEMM_NARROW", "gemm_tile"]
