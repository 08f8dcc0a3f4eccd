"""Reading FP8 block-scaled linears (DeepSeek-V3, GLM-4.5-FP8, Qwen3-FP8 checkpoints) by slices.

Legend: N output rows, R reduction length, E experts, I intermediate of one
expert, H hidden; `_l` this rank's share, [a, b) its slice of I.

An FP8 linear `<prefix>` stores `<prefix>.weight` float8_e4m3fn [N, R] and
`<prefix>.weight_scale_inv` fp32 [ceil(N/128), ceil(R/128)] (value = fp8 *
scale of its 128 x 128 block); config.json says so with `quantization_config`
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}. A slice of either axis keeps whole blocks:
it starts on a multiple of 128 and ends on one or at the end of the axis, so a
tensor-parallel shard of I must be a multiple of 128 per rank.

`ckpt` is a `sparkinfer.models.checkpoint.Checkpoint` (or anything with its
has / shape / dtype / expect / read / file_of).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparkinfer.errors import CheckpointError, ShapeError, UnsupportedModelError
from sparkinfer.quant.fp8 import FP8_BLOCK, FP8BlockTensor, dequantize_fp8_block

__all__ = ["fp8_quant_config", "is_fp8", "read_fp8", "read_dense_fp8", "read_experts_fp8",
           "stack_fp8", "FP8_DTYPES"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # uint8: E4M3 bits saved without the dtype


def fp8_quant_config(q: dict, where: str, key: str = "quantization_config") -> str:
    """'fp8_block' for a `quantization_config` with quant_method "fp8" that this
    library runs: E4M3 values, dynamic activation scales, 128 x 128 weight blocks.
    Raises UnsupportedModelError naming the key and value otherwise. Pure."""
    fmt = str(q.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise UnsupportedModelError(f"{where}: {key}.fmt={fmt!r} is not supported: FP8 "
                                    "checkpoints must store E4M3 weights")
    scheme = str(q.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise UnsupportedModelError(f"{where}: {key}.activation_scheme={scheme!r} is not "
                                    "supported: activations are quantized per token and 128 "
                                    "elements at run time ('dynamic')")
    block = q.get("weight_block_size")
    if block is None or [int(v) for v in block] != [FP8_BLOCK, FP8_BLOCK]:
        raise UnsupportedModelError(f"{where}: {key}.weight_block_size={block!r} is not "
                                    f"supported: only [{FP8_BLOCK}, {FP8_BLOCK}] blocks (per-tensor "
                                    "or per-channel FP8 is not implemented); use the bf16 "
                                    "checkpoint")
    return "fp8_block"


def is_fp8(ckpt, prefix: str) -> bool:
    """True when `<prefix>.weight` is E4M3 with a `weight_scale_inv` beside it."""
    name = f"{prefix}.weight"
    return (ckpt.has(name) and ckpt.has(f"{prefix}.weight_scale_inv")
            and ckpt.dtype(name) == torch.float8_e4m3fn)


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def _block_span(prefix: str, span: tuple[int, int], n: int, axis: str) -> tuple[int, int]:
    a, b = span
    if a % FP8_BLOCK or (b % FP8_BLOCK and b != n):
        raise ShapeError(f"{prefix}: slice [{a}, {b}) of the {axis} axis (length {n}) does not "
                         f"start and end on a {FP8_BLOCK}-element scale block; a tensor-parallel "
                         f"shard of it must be a multiple of {FP8_BLOCK} per rank (choose "
                         "another world size, or moe_format='bf16' / 'nvfp4')")
    return a // FP8_BLOCK, _blocks(b)


def read_fp8(ckpt, prefix: str, shape: tuple[int, int], *, dim: int = 0,
             span: tuple[int, int] | None = None, device="cpu") -> FP8BlockTensor:
    """Read rows (dim 0) or reduction indices (dim 1) [span) of the FP8 linear
    `prefix` of logical shape `shape` = (N, R), whole 128-blocks only.

    Returns an FP8BlockTensor (weight [N_l, R_l] e4m3, scale fp32 [ceil(N_l/128),
    ceil(R_l/128)]) as stored: no bf16 round trip. Raises CheckpointError when
    the scale is missing or mis-shaped, ShapeError when the slice cuts a block.
    Allocates on `device`.
    """
    n, r = shape
    sname = f"{prefix}.weight_scale_inv"
    what = f"FP8 of a logical [{n}, {r}] weight"
    ckpt.expect(f"{prefix}.weight", (n, r), FP8_DTYPES, what=what)
    if not ckpt.has(sname):
        raise CheckpointError(f"tensor {sname!r} is missing beside {prefix}.weight in "
                              f"{ckpt.file_of(f'{prefix}.weight')}; an FP8 weight needs its "
                              f"block scales ([{_blocks(n)}, {_blocks(r)}] fp32)")
    ckpt.expect(sname, (_blocks(n), _blocks(r)), (torch.float32, torch.bfloat16),
                what=f"one scale per {FP8_BLOCK} x {FP8_BLOCK} block of {what}")
    sspan = None if span is None else _block_span(prefix, span, (n, r)[dim],
                                                  ("output", "reduction")[dim])
    w = ckpt.read(f"{prefix}.weight", dim=dim, span=span, device=device)
    s = ckpt.read(sname, dim=dim, span=sspan, dtype=torch.float32, device=device)
    if w.dtype == torch.uint8:
        w = w.view(torch.float8_e4m3fn)
    return FP8BlockTensor(w, s)


def read_dense_fp8(ckpt, prefix: str, shape: tuple[int, int], *, dim: int = 0,
                   span: tuple[int, int] | None = None, device="cpu",
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The FP8 linear `prefix` ([N, R] = `shape`), rows (dim 0) or columns (dim 1)
    [span) of any alignment, dequantized to `dtype` (for the linears that run
    dense: attention, shared experts). Allocates on `device`."""
    if span is None:
        return dequantize_fp8_block(read_fp8(ckpt, prefix, shape, device=device), dtype)
    a, b = span
    lo, hi = a // FP8_BLOCK * FP8_BLOCK, min(_blocks(b) * FP8_BLOCK, shape[dim])
    t = dequantize_fp8_block(read_fp8(ckpt, prefix, shape, dim=dim, span=(lo, hi),
                                      device=device), dtype)
    return t.narrow(dim, a - lo, b - a).contiguous()


def stack_fp8(parts: list[FP8BlockTensor]) -> FP8BlockTensor:
    """[E] per-expert FP8BlockTensors of one shape -> one with a leading E axis."""
    return FP8BlockTensor(torch.stack([p.weight for p in parts]),
                          torch.stack([p.scale for p in parts]))


def read_experts_fp8(ckpt, names: Callable[[int], tuple[str, str, str]], dims: tuple,
                     span: tuple[int, int], device="cpu") -> tuple[FP8BlockTensor, FP8BlockTensor]:
    """This rank's slice [a, b) of I of E routed experts stored as FP8 linears.

    names(x) -> (gate, up, down) prefixes of expert x; dims = (E, H, I).
    Returns w1 [E, 2 * I_l, H] (the gate rows [a, b), then the up rows; I_l a
    multiple of 128, so gate and up never share a scale block) and w2 [E, H,
    I_l], as stored. Allocates on `device`; reads only this rank's rows/columns.
    """
    e, h, i = dims
    a, b = span
    if (b - a) % FP8_BLOCK or h % FP8_BLOCK:
        raise ShapeError(f"FP8 experts need hidden ({h}) and the per-rank moe_intermediate_size "
                         f"({b - a} of {i}) to be multiples of {FP8_BLOCK} (the scale blocks); "
                         "choose another world size or moe_format='bf16'")
    w1, w2 = [], []
    for x in range(e):
        gate, up, down = names(x)
        g = read_fp8(ckpt, gate, (i, h), dim=0, span=span, device=device)
        u = read_fp8(ckpt, up, (i, h), dim=0, span=span, device=device)
        w1.append(FP8BlockTensor(torch.cat([g.weight, u.weight]), torch.cat([g.scale, u.scale])))
        w2.append(read_fp8(ckpt, down, (h, i), dim=1, span=span, device=device))
    return stack_fp8(w1), stack_fp8(w2)
