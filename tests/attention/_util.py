"""Inputs and checks shared by the attention tests.

Legend: B batch rows, Q queries per row, Hq query heads, KVH KV heads, D head
dim, S cache slots, L local positions per slot, W DCP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkinfer.attention import attention_reference

# One tolerance table. out: the kernel rounds P to bf16 before P @ V and casts the
# fp32 result to bf16 (the interpreter truncates both, so up to one bf16 ulp,
# 2^-7 relative, each), plus 2^-8 of sum |p v| / l absolute from P's rounding;
# lse: fp32 all the way (scores of bf16 inputs, exp2/log2 instead of exp/log).
TOL = {"out_atol": 1e-2, "out_rtol": 2 * 2 ** -7, "lse_atol": 1e-4, "lse_rtol": 1e-5}


@dataclass(frozen=True)
class Case:
    """One attention call: shapes, each row's slot and first query position."""

    B: int
    Q: int
    Hq: int
    KVH: int
    D: int
    S: int
    L: int
    slots: tuple
    q_pos: tuple
    num_splits: int | None = None
    batch_invariant: bool = True


def make_inputs(c: Case, seed: int, *, kv_stride: int = 1, kv_offset: int = 0, strided: bool = False,
                device="cpu"):
    """q [B, Q, Hq, D], k/v caches [S, L, KVH, D] (bf16), slots, q_pos (int32).

    Cache positions no query may attend (global position > the row's last query)
    are NaN: the kernel must never let them touch a result. `strided`: q is a
    head slice of a wider [B, Q, Hq + 2, D] buffer and k/v are halves of one
    [S, L, 2, KVH, D] buffer (the layouts a fused QKV projection and a joint KV
    cache give)."""
    g = torch.Generator(device=device).manual_seed(seed)
    qw = torch.randn(c.B, c.Q, c.Hq + (2 if strided else 0), c.D, generator=g, device=device).bfloat16()
    q = qw[:, :, : c.Hq]
    kv = torch.randn(c.S, c.L, 2, c.KVH, c.D, generator=g, device=device).bfloat16()
    key_pos = torch.arange(c.L, device=device) * kv_stride + kv_offset  # [L]
    for slot, p0 in zip(c.slots, c.q_pos):
        kv[slot, key_pos > p0 + c.Q - 1] = float("nan")
    k, v = (kv[:, :, 0], kv[:, :, 1]) if strided else (kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous())
    as_i32 = dict(dtype=torch.int32, device=device)
    return q, k, v, torch.tensor(c.slots, **as_i32), torch.tensor(c.q_pos, **as_i32)


def reference(q, k, v, slots, q_pos, **kw):
    """fp32 reference on the caches with their never-attended NaNs zeroed."""
    return attention_reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), slots, q_pos, **kw)


def poisoned(c: Case, device="cpu"):
    """Fresh out / lse filled with NaN."""
    return (torch.full((c.B, c.Q, c.Hq, c.D), float("nan"), dtype=torch.bfloat16, device=device),
            torch.full((c.B, c.Q, c.Hq), float("nan"), dtype=torch.float32, device=device))


def assert_matches(out, lse, ref_out, ref_lse):
    """Every element within TOL; -inf lse and zero out exactly where the reference has no key."""
    out, lse = out.float().cpu(), lse.cpu()
    ref_out, ref_lse = ref_out.float().cpu(), ref_lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any()
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    err = (out - ref_out).abs()
    bound = TOL["out_atol"] + TOL["out_rtol"] * ref_out.abs()
    assert (err <= bound).all(), f"out: max err {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"
    full = ~empty
    lerr = (lse[full] - ref_lse[full]).abs()
    assert (lerr <= TOL["lse_atol"] + TOL["lse_rtol"] * ref_lse[full].abs()).all(), f"lse: max err {lerr.max()}"
