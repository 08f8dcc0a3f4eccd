"""RMSNorm on one rank: `add_rms_norm` (residual add + norm, one kernel) and `rms_norm`.

A tensor-parallel group of one needs no communicator: these kernels stand in
for `Communicator.all_reduce_add_rms_norm` with the same numerics (see
`reference.py`).
"""

from sparkinfer.norm.launch import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "rms_norm"]
