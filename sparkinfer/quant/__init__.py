"""Quantized weight formats. Nothing runs at import.

`nvfp4`: E2M1 values with E4M3 scales per 16 and an fp32 scale per matrix.
`fp8`: E4M3 values with an fp32 scale per 128 x 128 block (FP8 checkpoints);
its `from_checkpoint` is `sparkinfer.quant.fp8.from_checkpoint`.
"""

from sparkinfer.quant.fp8 import (
                                  FP8_BLOCK,
                                  FP8BlockTensor,
                                  dequantize_fp8_block,
                                  dequantize_fp8_groups,
                                  quantize_fp8_block,
                                  quantize_fp8_groups,
)
from sparkinfer.quant.nvfp4 import (
                                  BLOCK,
                                  NVFP4Tensor,
                                  dequantize_nvfp4,
                                  from_checkpoint,
                                  pack_codes,
                                  quantize_nvfp4,
                                  unpack_codes,
)

__all__ = ["BLOCK", "NVFP4Tensor", "quantize_nvfp4", "dequantize_nvfp4", "from_checkpoint",
           "pack_codes", "unpack_codes", "FP8_BLOCK", "FP8BlockTensor", "quantize_fp8_block",
           "dequantize_fp8_block", "quantize_fp8_groups", "dequantize_fp8_groups"]
