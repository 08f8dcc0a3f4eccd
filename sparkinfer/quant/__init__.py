"""Quantized weight formats. Nothing runs at import."""

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
           "pack_codes", "unpack_codes"]
