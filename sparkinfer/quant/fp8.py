"""FP8 block scaling (W8A8): E4M3 values, one fp32 scale per 128 x 128 block of
a weight, one per 128-element group of an activation row.

Legend: N output rows, K reduction length (the last axis), B... leading batch
dims (for MoE weights: E experts), T tokens.

Stored weight format (the `weight` / `weight_scale_inv` pair of the DeepSeek-V3,
GLM-4.5-FP8 and Qwen3-FP8 checkpoints, `quantization_config` `quant_method:
"fp8"`, `weight_block_size: [128, 128]`):

- `weight`: float8_e4m3fn [B..., N, K];
- `scale`: fp32 [B..., ceil(N/128), ceil(K/128)]; value = fp8 * scale of its block
  (the checkpoints call it `weight_scale_inv`: the inverse of the quantizing scale).

Activations (`quantize_fp8_groups`): scale s = max(amax, ACT_AMIN) / 448 per
row and group of 128 along K, q = e4m3(x * (1 / s)), each operation correctly
rounded fp32 on every device: the MoE kernels compute exactly this
(`moe/kernels/fp8.py`), so the reference and the GPU agree bit for bit on the
quantized activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.errors import CheckpointError, DTypeError, ShapeError
from sparkinfer.quant.nvfp4 import matrices_per_chunk
from sparkinfer.quant.reference import E4M3_MAX

__all__ = ["FP8_BLOCK", "ACT_AMIN", "FP8BlockTensor", "quantize_fp8_block",
           "dequantize_fp8_block", "from_checkpoint", "quantize_fp8_groups",
           "dequantize_fp8_groups", "round_to_e4m3_signed"]

FP8_BLOCK = 128  # rows and columns of one weight scale block; elements of one activation group
# Smallest amax an activation group's scale is computed from: a group of zeros
# gets scale ACT_AMIN / 448 and quantizes to zeros instead of dividing by zero.
ACT_AMIN = 1e-12


def round_to_e4m3_signed(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` -> float8_e4m3fn, nearest even, saturating at +-448 (torch's cast
    maps values beyond 448 to NaN, so the clamp comes first). Allocates; no host sync."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


@dataclass(frozen=True)
class FP8BlockTensor:
    """A weight in the stored FP8 block format (see module docstring).

    weight: float8_e4m3fn [B..., N, K]; scale: fp32 [B..., ceil(N/128), ceil(K/128)].
    Construction checks dtypes and shapes (no host sync).
    """

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self):
        _check(self.weight, self.scale, "FP8BlockTensor")

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [B..., N, K]."""
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the E4M3 values and the block scales."""
        return self.weight.numel() + 4 * self.scale.numel()

    def to(self, device) -> FP8BlockTensor:
        """Both tensors on `device` (copies where they live elsewhere)."""
        return FP8BlockTensor(self.weight.to(device), self.scale.to(device))


def _check(weight, scale, where: str) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise DTypeError(f"{where}: weight dtype {weight.dtype}; expected torch.float8_e4m3fn "
                         "(E4M3 values; quantize with quantize_fp8_block)")
    if scale.dtype != torch.float32:
        raise DTypeError(f"{where}: scale dtype {scale.dtype}; expected torch.float32 (one "
                         "dequantizing scale per 128 x 128 block)")
    if weight.dim() < 2:
        raise ShapeError(f"{where}: weight shape {tuple(weight.shape)}; need [..., N, K]")
    n, k = weight.shape[-2:]
    want = (*weight.shape[:-2], _blocks(n), _blocks(k))
    if tuple(scale.shape) != want:
        raise ShapeError(f"{where}: scale shape {tuple(scale.shape)} does not match weight "
                         f"{tuple(weight.shape)}; expected {want} (one scale per {FP8_BLOCK} x "
                         f"{FP8_BLOCK} block of the N={n} x K={k} matrix, partial blocks "
                         "rounded up)")


def _expand(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Block scales [B..., nb, kb] -> per element [B..., n, k]."""
    s = scale.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)
    return s[..., :n, :k]


def quantize_fp8_block(w: torch.Tensor) -> FP8BlockTensor:
    """Quantize `w` [B..., N, K] (bf16/fp16/fp32; any N, K) to FP8 blocks.

    Per 128 x 128 block (the last row/column blocks may be partial): scale =
    amax / 448 (1 for a block of zeros), values e4m3(w / scale) nearest even,
    so each block's largest magnitude lands on 448. Allocates; syncs only to
    reject NaN/inf; not capture-legal (use at load time).
    """
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"quantize_fp8_block: w dtype {w.dtype}; pass bf16, fp16 or fp32")
    if w.dim() < 2:
        raise ShapeError(f"quantize_fp8_block: w shape {tuple(w.shape)}; need [..., N, K]")
    per_chunk = matrices_per_chunk(w)  # a stack a few matrices at a time (nvfp4.QUANTIZE_CHUNK_BYTES)
    if per_chunk is None:
        return _quantize(w)
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    flat = w.reshape(-1, n, k)
    q = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(flat.shape[0], _blocks(n), _blocks(k), dtype=torch.float32, device=w.device)
    for a in range(0, flat.shape[0], per_chunk):
        t = _quantize(flat[a:a + per_chunk])
        q[a:a + per_chunk], scale[a:a + per_chunk] = t.weight, t.scale
    return FP8BlockTensor(q.reshape(w.shape), scale.reshape(*lead, _blocks(n), _blocks(k)))


def _quantize(w: torch.Tensor) -> FP8BlockTensor:
    x = w.float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("quantize_fp8_block: w holds NaN or inf; E4M3 weights cannot hold them")
    n, k = x.shape[-2:]
    nb, kb = _blocks(n), _blocks(k)
    pad = torch.nn.functional.pad(x, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    blk = pad.reshape(*x.shape[:-2], nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = blk.abs().amax(dim=(-3, -1))  # [B..., nb, kb]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = round_to_e4m3_signed(x / _expand(scale, n, k))
    return FP8BlockTensor(q, scale)


def dequantize_fp8_block(t: FP8BlockTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode `t` to a dense [B..., N, K] tensor of `dtype` (fp32 math, then cast).
    Allocates; no host sync."""
    n, k = t.weight.shape[-2:]
    return (t.weight.float() * _expand(t.scale.float(), n, k)).to(dtype)


def from_checkpoint(weight: torch.Tensor, scale_inv: torch.Tensor | None) -> FP8BlockTensor:
    """Wrap a checkpoint's FP8 `weight` and its `weight_scale_inv` after checking them.

    weight: float8_e4m3fn (or its uint8 bits) [B..., N, K]; scale_inv: fp32 (bf16
    is widened) [B..., ceil(N/128), ceil(K/128)]. Raises CheckpointError when
    scale_inv is None (an FP8 weight means nothing without its block scales),
    DTypeError / ShapeError naming the bad dtype or shape. Views only (a copy
    only to widen bf16 scales); no host sync.
    """
    if scale_inv is None:
        raise CheckpointError(f"fp8.from_checkpoint: weight {tuple(weight.shape)} has no "
                              "weight_scale_inv; FP8 block weights need their fp32 scale per "
                              "128 x 128 block (pass the checkpoint's `.weight_scale_inv`)")
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    if scale_inv.dtype == torch.bfloat16:
        scale_inv = scale_inv.float()
    _check(weight, scale_inv, "fp8.from_checkpoint")
    return FP8BlockTensor(weight, scale_inv)


def quantize_fp8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [..., K] (K % 128 == 0) -> (q float8_e4m3fn [..., K], s fp32
    [..., K/128]) with s = max(amax, ACT_AMIN) / 448 per 128-element group and
    q = e4m3(x * (1 / s)): what the MoE kernels compute in-kernel. Allocates; no host sync."""
    if x.shape[-1] % FP8_BLOCK:
        raise ShapeError(f"quantize_fp8_groups: x shape {tuple(x.shape)}; the last dim must "
                         f"be a multiple of {FP8_BLOCK}")
    g = x.float().reshape(*x.shape[:-1], -1, FP8_BLOCK)
    amax = g.abs().amax(-1).clamp(min=ACT_AMIN)
    # Both divisions tensor by tensor: torch on CUDA computes `t / 448.0` (a CPU
    # scalar divisor) as t * fl(1/448), off by one fp32 ulp for about half the
    # scales, and q then differs from the kernels' (div.rn) at rounding ties: on
    # an H200, 474 of 307200 E4M3 codes of x [300, 1024], which moved the fp8_block
    # layer's reference by 1.4e-2 (rel_norm) through FC2's E4M3 input.
    s = amax / torch.full_like(amax, E4M3_MAX)
    q = round_to_e4m3_signed(g * (torch.ones_like(s) / s)[..., None])
    return q.reshape(x.shape), s


def dequantize_fp8_groups(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_fp8_groups` up to rounding: fp32 [..., K]. Allocates."""
    g = q.float().reshape(*q.shape[:-1], -1, FP8_BLOCK) * s[..., None]
    return g.reshape(q.shape)
