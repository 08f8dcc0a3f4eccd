"""SparkInfer: peer collectives and fused MoE for tensor-parallel inference on
boxes of several GPUs linked by peer-to-peer memory.

Nothing runs at import: no device probing, no compilation, no environment writes.
"""

from sparkinfer import errors

__all__ = ["errors", "__version__"]
__version__ = "0.1.0"
