"""Expert weights in the layout the MoE kernels read (`prepare_weights`, once per model).

Legend: E experts, H hidden, I intermediate per rank, N1 = 2I (gated) or I,
BK the pack chunk (reduction elements per kernel step, `MoEPlan.chunk`).

Prepared layout:
- FC1 [E, N1, H], gate rows first then up rows, whatever the checkpoint order;
  FC2 [E, H, I]; both already sliced to this rank's share of I, and I is the
  plan's (`MoEPlan.intermediate`): a share that is not a multiple of 32 is
  followed by zero gate rows, zero up rows and zero FC2 columns up to it.
- bf16: contiguous bf16.
- nvfp4: words of 8 elements (`pack_words`): word n of a row holds elements
  8n..8n+7 with each E2M1 bit where the kernel's rotate-and-mask decode wants
  it (`kernels/common.py`, NVFP4_WORD_ASM); scale codes (`scale_codes`), one
  byte per 16 elements as in the stored E4M3, re-encoded so that one integer
  multiply-add makes the bf16 scale pair; global scales fp32 [E]. Words and
  scale codes are tiled (`tile_rows`): [E, N'/64, R/BK, 64, BK/2] and
  [E, N'/64, R/BK, 64, BK/16] bytes, N' = N rounded up to 64 rows (the padding
  is zero and never read), so the 64 rows' slices of one chunk, what one
  kernel step reads, are contiguous (`nvfp4_shapes`).
- fp8_block: the checkpoint layout itself: E4M3 [E, N, R] contiguous and fp32
  scales [E, N/128, R/128] (s1, s2; H and I are multiples of 128, `plan`),
  sliced on whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.errors import DTypeError, ShapeError
from sparkinfer.moe.kernels.common import NVFP4_TILE_ROWS, NVFP4_WORD_MASK3, NVFP4_WORD_ROT
from sparkinfer.quant.fp8 import FP8_BLOCK, FP8BlockTensor
from sparkinfer.quant.nvfp4 import NVFP4Tensor, unpack_codes

__all__ = ["MoEWeights", "prepare_weights", "pack_words", "scale_codes", "prepare_nvfp4",
           "tile_rows", "nvfp4_shapes"]


@dataclass(frozen=True)
class MoEWeights:
    """Prepared expert weights (see module docstring). s*/g* are None for bf16;
    g* are None for fp8_block."""

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


def _word_bits() -> torch.Tensor:
    """Word bit of (element 0..7, code bit 0..3): the inverse of NVFP4_WORD_ASM.

    Register j (bf16x2) holds element 2j in its low half and 2j+1 in its high
    half as sign<<15 | e1<<8 | e0<<7 | m<<6; register j < 3 is rotl(word,
    ROT[j]) & MASK, register 3 takes MASK3's bits from the word itself and the
    rest from rotl(word, ROT[3]).
    """
    out = torch.empty(8, 4, dtype=torch.int64)
    for j, rot in enumerate(NVFP4_WORD_ROT):
        for h in range(2):
            for bit, pos in enumerate((6, 7, 8, 15)):
                p = pos + 16 * h
                own = j == 3 and (NVFP4_WORD_MASK3 >> p) & 1
                out[2 * j + h, bit] = p if own else (p - rot) % 32
    assert sorted(out.flatten().tolist()) == list(range(32))  # a permutation of the word
    return out


_WORD_BITS = _word_bits()


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., R] (uint8 0..15, R % 8 == 0) -> prepared word bytes [..., R/2].

    Allocates; no host sync.
    """
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, 8)  # [..., R/8, 8]
    bit = (c[..., :, None] >> torch.arange(4, device=c.device)) & 1  # [..., R/8, 8, 4]
    words = (bit << _WORD_BITS.to(c.device)).sum(dim=(-2, -1))  # disjoint bits: sum == or
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.view(torch.uint8).reshape(*codes.shape[:-1], -1)


def scale_codes(scales: torch.Tensor, codes: torch.Tensor):
    """Stored E4M3 scales [..., R/16] and E2M1 codes [..., R] -> (prepared scale
    codes uint8 [..., R/16], codes to pack).

    Code c stands for 2**((c >> 3) - 9) * (1 + (c & 7) / 8) (the kernel makes the
    bf16 pair of that times 2**118 as c * 0x100010 + 0x76007600): every positive
    E4M3 value, subnormals included, has one; 159 is NaN. A negative scale
    flips its block's code signs instead, a zero scale zeroes its block's
    magnitudes (keeping their signs), so every product e2m1 * scale keeps its
    value and sign. Allocates; no host sync.
    """
    b = scales.view(torch.uint8).to(torch.int32)
    mag, neg = b & 0x7F, (b >> 7).bool()
    e, m = mag >> 3, mag & 7
    # subnormal m * 2**-9: exponent -9 + floor(log2 m), mantissa bits below the leading one
    lg = torch.where(m >= 4, 2, torch.where(m >= 2, 1, 0))
    sub = (lg << 3) | ((m << (3 - lg)) & 7)
    c = torch.where(e > 0, ((e + 2) << 3) | m, sub)
    c = torch.where(mag == 0x7F, (19 << 3) | 7, c)
    blk = codes.reshape(*codes.shape[:-1], -1, 16).to(torch.int32)
    blk = torch.where(neg[..., None], blk ^ 8, blk)
    blk = torch.where((mag == 0)[..., None], blk & 8, blk)
    return c.to(torch.uint8), blk.reshape(codes.shape).to(torch.uint8)


def nvfp4_shapes(experts: int, rows: int, reduction: int, chunk: int):
    """Shapes of the prepared (words, scale codes) of an NVFP4 matrix [E, N, R]."""
    blocks = -(-rows // NVFP4_TILE_ROWS)
    lead = (experts, blocks, reduction // chunk, NVFP4_TILE_ROWS)
    return (*lead, chunk // 2), (*lead, chunk // 16)


def tile_rows(t: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """[N, B] bytes (B = R/2 words or R/16 scale codes) -> [N'/64, B/cb, 64, cb]
    with cb = chunk_bytes per row and chunk: rows padded with zeros to N', a
    multiple of NVFP4_TILE_ROWS. Allocates; no host sync."""
    n, b = t.shape
    rows = -(-n // NVFP4_TILE_ROWS) * NVFP4_TILE_ROWS
    if rows != n:
        t = torch.cat([t, t.new_zeros(rows - n, b)])
    t = t.reshape(rows // NVFP4_TILE_ROWS, NVFP4_TILE_ROWS, b // chunk_bytes, chunk_bytes)
    return t.permute(0, 2, 1, 3).contiguous()


def prepare_nvfp4(w: NVFP4Tensor, chunk: int):
    """NVFP4Tensor [E, N, R] -> (tiled word bytes, tiled scale codes) for steps
    of `chunk` reduction elements (`nvfp4_shapes`).

    One matrix at a time along E (bounded temporaries). Allocates; no host sync.
    """
    e, n, r = w.shape
    shape_p, shape_s = nvfp4_shapes(e, n, r, chunk)
    p = torch.empty(shape_p, dtype=torch.uint8, device=w.packed.device)
    s = torch.empty(shape_s, dtype=torch.uint8, device=w.scales.device)
    for i in range(e):
        c, codes = scale_codes(w.scales[i], unpack_codes(w.packed[i]))
        p[i] = tile_rows(pack_words(codes), chunk // 2)
        s[i] = tile_rows(c, chunk // 16)
    return p, s


def _select(w, rows_fn, cols=None):
    """Apply a row selection rows_fn(t, unit) (unit: rows per row of t) and an
    optional slice of the reduction axis to a dense tensor, an NVFP4Tensor or an
    FP8BlockTensor (whose scales select whole 128-row / 128-column blocks)."""
    if isinstance(w, NVFP4Tensor):
        p, s = rows_fn(w.packed, 1), rows_fn(w.scales, 1)
        if cols is not None:
            lo, hi = cols
            p, s = p[..., lo // 2:hi // 2], s[..., lo // 16:hi // 16]
        return NVFP4Tensor(p, s, w.global_scale)
    if isinstance(w, FP8BlockTensor):
        q, s = rows_fn(w.weight, 1), rows_fn(w.scale, FP8_BLOCK)
        if cols is not None:
            lo, hi = cols
            q, s = q[..., lo:hi], s[..., lo // FP8_BLOCK:hi // FP8_BLOCK]
        return FP8BlockTensor(q, s)
    w = rows_fn(w, 1)
    return w if cols is None else w[..., cols[0]:cols[1]]


def _pad_columns(w, pad: int):
    """w [E, H, I] (dense or NVFP4Tensor) with `pad` zero columns appended along I:
    zero values, and for NVFP4 zero codes under zero scales (value 0). An
    NVFP4Tensor's I is a multiple of its 16-element scale groups and so is pad
    (both multiples of 16: plan.PAD_MULTIPLE), so whole groups are appended."""
    if not pad:
        return w
    if isinstance(w, NVFP4Tensor):
        p, s = w.packed, w.scales
        return NVFP4Tensor(torch.cat([p, p.new_zeros(*p.shape[:-1], pad // 2)], dim=-1),
                           torch.cat([s, s.new_zeros(*s.shape[:-1], pad // 16)], dim=-1), w.global_scale)
    return torch.cat([w, w.new_zeros(*w.shape[:-1], pad)], dim=-1)


_TYPES = {"nvfp4": (NVFP4Tensor, "quantize_nvfp4 or quant.from_checkpoint"),
          "fp8_block": (FP8BlockTensor, "quantize_fp8_block or quant.fp8.from_checkpoint; an "
                        "E4M3 tensor alone lacks its weight_scale_inv")}


def _check(w, name, fmt, shape):
    if fmt in _TYPES:
        cls, how = _TYPES[fmt]
        if not isinstance(w, cls):
            raise DTypeError(f"prepare_weights: {name} is {type(w).__name__}; weight_format "
                             f"{fmt!r} takes {cls.__name__} ({how})")
        got = w.shape
        if fmt == "nvfp4" and w.global_scale.shape != (shape[0],):
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
    used as is. bf16 format: bf16/fp16/fp32 tensors; nvfp4: `NVFP4Tensor`s;
    fp8_block: `FP8BlockTensor`s (a rank's rows and columns are whole 128
    blocks: `plan` checks I, so the slice never splits a scale block).
    Where plan.intermediate exceeds I, zero gate rows, up rows and FC2 columns
    fill the difference (they add exactly nothing: plan.py). Allocates the
    prepared copies (the sources can be freed after); no host sync; not
    capture-legal. Call once per model.
    """
    caps, spec = plan.caps, plan.spec
    fmt = spec.weight_format
    e, h, i = caps.num_experts, caps.hidden, caps.intermediate
    pad = plan.intermediate - i  # zero rows / columns the kernels' chunk needs (plan.py)
    full = i * caps.tp_size
    gated = spec.gated
    i_src = (w1.shape[-2] // (2 if gated else 1)) if hasattr(w1, "shape") else full
    if i_src not in (i, full):
        raise ShapeError(f"prepare_weights: w1 shape {tuple(w1.shape)}; its I must be the "
                         f"per-rank {i} or the full {full}")
    _check(w1, "w1", fmt, (e, (2 if gated else 1) * i_src, h))
    _check(w2, "w2", fmt, (e, h, i_src))
    lo = caps.tp_rank * i if i_src == full and caps.tp_size > 1 else 0

    def fc1_rows(t, u):  # u: source rows per row of t (128 for FP8 block scales)
        if not gated:
            rows = t[:, lo // u:(lo + i) // u]
            return torch.cat([rows, rows.new_zeros(rows.shape[0], pad // u, *rows.shape[2:])], dim=1)
        if spec.gate_up_order == "interleaved":  # never with u > 1 (MoESpec rejects it)
            gate, up = t[:, 0::2], t[:, 1::2]
        else:
            gate, up = t[:, :i_src // u], t[:, i_src // u:]
            if spec.gate_up_order == "up_gate":
                gate, up = up, gate
        zeros = t.new_zeros(t.shape[0], pad // u, *t.shape[2:])  # u > 1 (FP8) never pads
        return torch.cat([gate[:, lo // u:(lo + i) // u], zeros, up[:, lo // u:(lo + i) // u], zeros],
                         dim=1)

    w1 = _select(w1, fc1_rows)
    w2 = _pad_columns(_select(w2, lambda t, u: t, (lo, lo + i) if i_src != i else None), pad)
    if fmt == "bf16":
        return MoEWeights(fmt, plan.chunk, w1.to(torch.bfloat16).contiguous(),
                          w2.to(torch.bfloat16).contiguous())
    if fmt == "fp8_block":
        return MoEWeights(fmt, plan.chunk, w1.weight.contiguous(), w2.weight.contiguous(),
                          w1.scale.float().contiguous(), w2.scale.float().contiguous())
    (p1, c1), (p2, c2) = prepare_nvfp4(w1, plan.chunk), prepare_nvfp4(w2, plan.chunk)
    return MoEWeights(fmt, plan.chunk, p1, p2, c1, c2, w1.global_scale.float().contiguous(),
                      w2.global_scale.float().contiguous())
