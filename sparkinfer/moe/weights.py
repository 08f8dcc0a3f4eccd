"""Expert weights in the layout the MoE kernels read (`prepare_weights`, once per model).

Legend: E experts, H hidden, I intermediate per rank, N1 = 2I (gated) or I,
BK the pack chunk (reduction elements per kernel step, `MoEPlan.chunk`).

Prepared layout:
- FC1 [E, N1, H], gate rows first then up rows, whatever the checkpoint order;
  FC2 [E, H, I]; both already sliced to this rank's share of I.
- bf16: contiguous bf16.
- nvfp4: packed bytes [E, N, R/2] where, inside each chunk of BK reduction
  elements, byte j holds element j (low nibble) and element j + BK/2 (high
  nibble); E4M3 block scales [E, N, R/16] as raw bytes, unchanged order;
  global scales fp32 [E]. The stored NVFP4 format pairs neighbours
  (2j, 2j+1); this chunk interleave lets the kernel decode each half-chunk
  as one contiguous run of K (see `kernels/common.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.errors import DTypeError, ShapeError
from sparkinfer.quant.nvfp4 import NVFP4Tensor, unpack_codes

__all__ = ["MoEWeights", "prepare_weights", "interleave_chunks"]


@dataclass(frozen=True)
class MoEWeights:
    """Prepared expert weights (see module docstring). s*/g* are None for bf16."""

    weight_format: str
    chunk: int
    w1: torch.Tensor
    w2: torch.Tensor
    s1: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    g1: torch.Tensor | None = None
    g2: torch.Tensor | None = None

    def expert_bytes(self) -> int:
        """Bytes one expert's FC1 + FC2 weights occupy (what a kernel reads per active expert)."""
        parts = [self.w1, self.w2] + [t for t in (self.s1, self.s2) if t is not None]
        return sum(t[0].numel() * t.element_size() for t in parts)


def interleave_chunks(packed: torch.Tensor, chunk: int) -> torch.Tensor:
    """Stored NVFP4 bytes [..., R/2] -> prepared bytes [..., R/2] (chunk interleave).

    Works one matrix at a time along the leading dim (bounded temporaries).
    Allocates; no host sync.
    """
    if packed.dim() > 2:
        out = torch.empty(packed.shape, dtype=torch.uint8, device=packed.device)
        for e in range(packed.shape[0]):
            out[e] = interleave_chunks(packed[e], chunk)
        return out
    codes = unpack_codes(packed)
    codes = codes.reshape(*codes.shape[:-1], -1, chunk)
    half = chunk // 2
    out = codes[..., :half] | (codes[..., half:] << 4)
    return out.reshape(*packed.shape).contiguous()


def _select(w, rows_fn, cols=None):
    """Apply a row selection (and an optional slice of the reduction axis) to a
    dense tensor or an NVFP4Tensor."""
    if isinstance(w, NVFP4Tensor):
        p, s = rows_fn(w.packed), rows_fn(w.scales)
        if cols is not None:
            lo, hi = cols
            p, s = p[..., lo // 2:hi // 2], s[..., lo // 16:hi // 16]
        return NVFP4Tensor(p, s, w.global_scale)
    w = rows_fn(w)
    return w if cols is None else w[..., cols[0]:cols[1]]


def _check(w, name, fmt, shape):
    if fmt == "nvfp4":
        if not isinstance(w, NVFP4Tensor):
            raise DTypeError(f"prepare_weights: {name} is {type(w).__name__}; weight_format "
                             "'nvfp4' takes NVFP4Tensor (quantize_nvfp4 or from_checkpoint)")
        got = w.shape
        if w.global_scale.shape != (shape[0],):
            raise ShapeError(f"prepare_weights: {name}.global_scale shape "
                             f"{tuple(w.global_scale.shape)}; need [E={shape[0]}]")
    else:
        if not isinstance(w, torch.Tensor) or w.dtype not in (torch.bfloat16, torch.float16,
                                                              torch.float32):
            raise DTypeError(f"prepare_weights: {name} must be a bf16/fp16/fp32 tensor for "
                             f"weight_format 'bf16', got {getattr(w, 'dtype', type(w))}")
        got = tuple(w.shape)
    if tuple(got) != tuple(shape):
        raise ShapeError(f"prepare_weights: {name} shape {tuple(got)}; expected {tuple(shape)}")


def prepare_weights(plan, w1, w2) -> MoEWeights:
    """Prepare expert weights for `plan` (a `MoEPlan`).

    w1: FC1 [E, N1_full, H], rows ordered by `spec.gate_up_order` (gated:
    N1_full = 2 * I * tp_size; relu2: I * tp_size). w2: FC2 [E, H, I * tp_size].
    A tensor whose I equals the per-rank I (tp_size 1, or already sharded) is
    used as is. bf16 format: bf16/fp16/fp32 tensors; nvfp4: `NVFP4Tensor`s.
    Allocates the prepared copies (the sources can be freed after); no host
    sync; not capture-legal. Call once per model.
    """
    caps, spec = plan.caps, plan.spec
    fmt = spec.weight_format
    e, h, i = caps.num_experts, caps.hidden, caps.intermediate
    full = i * caps.tp_size
    gated = spec.gated
    i_src = (w1.shape[-2] // (2 if gated else 1)) if hasattr(w1, "shape") else full
    if i_src not in (i, full):
        raise ShapeError(f"prepare_weights: w1 shape {tuple(w1.shape)}; its I must be the "
                         f"per-rank {i} or the full {full}")
    _check(w1, "w1", fmt, (e, (2 if gated else 1) * i_src, h))
    _check(w2, "w2", fmt, (e, h, i_src))
    lo = caps.tp_rank * i if i_src == full and caps.tp_size > 1 else 0

    def fc1_rows(t):
        if not gated:
            return t[:, lo:lo + i]
        if spec.gate_up_order == "interleaved":
            gate, up = t[:, 0::2], t[:, 1::2]
        else:
            gate, up = t[:, :i_src], t[:, i_src:]
            if spec.gate_up_order == "up_gate":
                gate, up = up, gate
        return torch.cat([gate[:, lo:lo + i], up[:, lo:lo + i]], dim=1)

    w1 = _select(w1, fc1_rows)
    w2 = _select(w2, lambda t: t, (lo, lo + i) if i_src != i else None)
    if fmt == "bf16":
        return MoEWeights(fmt, plan.chunk, w1.to(torch.bfloat16).contiguous(),
                          w2.to(torch.bfloat16).contiguous())
    return MoEWeights(fmt, plan.chunk, interleave_chunks(w1.packed, plan.chunk),
                      interleave_chunks(w2.packed, plan.chunk),
                      w1.scales.view(torch.uint8).contiguous(),
                      w2.scales.view(torch.uint8).contiguous(),
                      w1.global_scale.float().contiguous(), w2.global_scale.float().contiguous())
