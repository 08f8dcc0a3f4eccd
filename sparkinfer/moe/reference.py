"""Pure-torch fp32 reference of the MoE layer, for every `MoESpec`.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate, N1 = 2I or I.
"""

from __future__ import annotations

import dataclasses

import torch

from sparkinfer.moe.spec import MoESpec
from sparkinfer.quant.fp8 import (
    FP8_BLOCK,
    FP8BlockTensor,
    dequantize_fp8_block,
    dequantize_fp8_groups,
    quantize_fp8_groups,
    round_to_e4m3_signed,
)
from sparkinfer.quant.nvfp4 import NVFP4Tensor, dequantize_nvfp4

__all__ = ["moe_reference", "activation_reference", "split_gate_up", "Tolerance", "TOLERANCES",
           "tolerance_for", "Comparison", "compare_to_reference", "Ties", "TIE_FC1", "TIE_TOKENS"]


def activation_reference(g: torch.Tensor, u: torch.Tensor | None, spec: MoESpec) -> torch.Tensor:
    """fp32 activation of pre-activations g (and u when gated), any shape."""
    if spec.activation == "silu":
        return torch.nn.functional.silu(g) * u
    if spec.activation == "relu2":
        return torch.relu(g).square()
    gc = g.clamp(max=spec.swiglu_limit)
    uc = u.clamp(-spec.swiglu_limit, spec.swiglu_limit)
    return gc * torch.sigmoid(spec.swiglu_alpha * gc) * (uc + 1.0)


def split_gate_up(h1: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """FC1 output [..., 2I] in spec.gate_up_order -> (gate [..., I], up [..., I])."""
    if spec.gate_up_order == "interleaved":
        return h1[..., 0::2], h1[..., 1::2]
    a, b = h1.chunk(2, dim=-1)
    return (a, b) if spec.gate_up_order == "gate_up" else (b, a)


def _expert(w, e: int) -> torch.Tensor:
    """fp32 weights of expert e (dequantizes only that expert: real model sizes fit)."""
    if isinstance(w, NVFP4Tensor):
        return dequantize_nvfp4(NVFP4Tensor(w.packed[e], w.scales[e], w.global_scale[e]))
    if isinstance(w, FP8BlockTensor):
        return dequantize_fp8_block(FP8BlockTensor(w.weight[e], w.scale[e]))
    return w[e].float()


def _fp8_round_trip(a: torch.Tensor) -> torch.Tensor:
    """a [..., K] through E4M3 per 128-element group and back (fp32), as the
    fp8_block kernels quantize their activations."""
    return dequantize_fp8_groups(*quantize_fp8_groups(a))


# FC2's input of an fp8_block layer goes through E4M3, and the kernel's FC1 (Hopper's
# e4m3 wgmma: ~14-bit accumulation of a 128-long K block) differs from the exact sum
# by 1.3-1.7e-4 of its norm (H200 at e2d9eba), so where the reference's activation sits
# that close to a rounding midpoint the kernel may take the other code: 1.1-1.5% of
# the codes, a whole E4M3 step (6-12%) each. The reference bounds each activation over
# FC1 outputs off by TIE_FC1 of their row's RMS (~6x that error) and the E4M3 scale off
# by TIE_FC1 relative, and marks the codes whose bounds round differently; from each of
# the TIE_TOKENS worst tokens `compare_to_reference` takes the part of its error those
# flips can explain (`Ties.explain`).
TIE_FC1 = 5e-4
TIE_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class Ties:
    """The FC2-input codes of an fp8 reference that a kernel may round the other way
    (`_fp8_round_trip_ties`): entry n is token[n]'s route to expert[n], input column col[n], whose
    other code would add delta[n] * w2[expert[n]][:, col[n]] to the token's output
    (delta: the other code's value less the reference's, the router weight applied
    after FC2 folded in). w2: the layer's FC2 weights as `moe_reference` took them."""

    token: torch.Tensor
    expert: torch.Tensor
    col: torch.Tensor
    delta: torch.Tensor
    w2: object

    def __len__(self) -> int:
        return self.token.numel()

    @staticmethod
    def cat(parts: list[Ties], w2) -> Ties:
        empty = torch.zeros(0, dtype=torch.long)
        if not parts:
            return Ties(empty, empty, empty, torch.zeros(0), w2)
        return Ties(*(torch.cat([getattr(t, f) for t in parts]) for f in ("token", "expert", "col", "delta")), w2)

    def select(self, keep: torch.Tensor) -> Ties:
        """The ties of the tokens where keep [T] (bool) holds, renumbered as out[keep]."""
        keep = keep.to(self.token.device)
        new = torch.cumsum(keep.long(), 0) - 1
        m = keep[self.token]
        return Ties(new[self.token[m]], self.expert[m], self.col[m], self.delta[m], self.w2)

    def explain(self, d: torch.Tensor, tokens: int = TIE_TOKENS) -> tuple[torch.Tensor, float]:
        """d [T, H] = out - ref (fp32): the `tokens` worst tokens that hold ties lose the
        part of their error a combination of their flips (each taken 0..1 times, least
        squares, then clamped) explains. Returns (d adjusted, flips explained). n flip
        directions (a few hundred: about 11% of a token's FC2 inputs at TIE_FC1) span n of
        H dimensions, and the clamp keeps less than that: 2% noise stayed at 1.9-2.0%,
        a scaled output and a dropped route as large (tests/moe/test_ties.py)."""
        d = d.clone()
        if not len(self):
            return d, 0.0
        dev = d.device
        tok, ex, col, delta = (t.to(dev) for t in (self.token, self.expert, self.col, self.delta))
        has = torch.zeros(d.shape[0], dtype=torch.bool, device=dev)
        has[tok] = True
        err = torch.where(has, d.norm(dim=1), torch.zeros((), device=dev))
        worst = err.topk(min(tokens, int(has.sum()))).indices
        pick = torch.isin(tok, worst)
        tok, ex, col, delta = tok[pick], ex[pick], col[pick], delta[pick]
        v = torch.empty(d.shape[1], tok.numel(), dtype=torch.float32, device=dev)  # flip directions
        for e in torch.unique(ex).tolist():
            at = (ex == e).nonzero().flatten()
            v[:, at] = _expert(self.w2, e).to(dev)[:, col[at]] * delta[at]
        flips = 0.0
        for t in worst.tolist():
            at = (tok == t).nonzero().flatten()
            vt = v[:, at].double()
            g = vt.T @ vt
            g += torch.eye(g.shape[0], dtype=g.dtype, device=dev) * (1e-9 * g.diagonal().mean())
            c = torch.linalg.solve(g, vt.T @ d[t].double()).clamp(0, 1)
            left = d[t] - (vt @ c).float()
            if left.norm() < d[t].norm():  # clamping can undo the fit: then keep the error
                d[t] = left
                flips += c.sum().item()
        return d, flips


def _activation_bounds(g: torch.Tensor, u: torch.Tensor | None, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest, highest) activation [n, I] over FC1 outputs g (and u) each off by up to
    TIE_FC1 of its row's RMS: the activation at the corners and midpoints of that box."""
    def box(v):
        if v is None:
            return (0.0,)
        rms = v.square().mean(-1, keepdim=True).sqrt()
        return tuple(k * TIE_FC1 * rms for k in (-1, 0, 1))

    seen = torch.stack([activation_reference(g + dg, None if u is None else u + du, spec)
                        for dg in box(g) for du in box(u)])
    return seen.amin(0), seen.amax(0)


def _fp8_round_trip_ties(a: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [n, I] through E4M3 as `_fp8_round_trip`, delta [n, I]): where a value in [lo, hi]
    (or its scale off by TIE_FC1) rounds to another code than a's, that code's value
    less a's; 0 elsewhere."""
    q, s = quantize_fp8_groups(a)
    sg = s.repeat_interleave(FP8_BLOCK, dim=-1)
    inv = torch.ones_like(sg) / sg
    t_lo, t_hi = lo * inv, hi * inv
    c = q.float()
    down = round_to_e4m3_signed(t_lo - TIE_FC1 * t_lo.abs()).float()
    up = round_to_e4m3_signed(t_hi + TIE_FC1 * t_hi.abs()).float()
    alt = torch.where(down != c, down, up)
    return dequantize_fp8_groups(q, s), (alt - c) * sg


def moe_reference(x: torch.Tensor, weights: tuple, routing: tuple[torch.Tensor, torch.Tensor], *,
                  spec: MoESpec, act_quant: bool | None = None, ties: bool = False):
    """x [T, H]; weights = (w1 [E, N1, H], w2 [E, H, I]) dense, `NVFP4Tensor` or
    `FP8BlockTensor` (dequantized: the reference of a quantized layer is its
    dequantized weights), rows in spec.gate_up_order, this rank's shard;
    routing = (ids [T, K], weights [T, K]). Returns fp32 [T, H]. Ids outside
    [0, E) add nothing.

    act_quant: round x and FC2's input (after the router weight when it comes
    first) through E4M3 per token and 128 elements, as W8A8 computes
    (`sparkinfer.quant.fp8.quantize_fp8_groups`); None: when the weights are
    FP8BlockTensors. The rest is fp32.
    ties: return (out, `Ties`): FC2's input codes a kernel may round the other way
    (none without act_quant), for `compare_to_reference`.
    Allocates; syncs with the host (loops over the active experts); not capture-legal.
    """
    w1, w2 = weights
    ids, rw = routing
    if act_quant is None:
        act_quant = isinstance(w1, FP8BlockTensor)
    xf = _fp8_round_trip(x) if act_quant else x.float()
    e_count = w1.shape[0]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    found = []
    for e in torch.unique(ids).tolist():
        if not 0 <= e < e_count:
            continue
        t_idx, k_idx = torch.nonzero(ids == e, as_tuple=True)
        h1 = xf[t_idx] @ _expert(w1, e).t()
        g, u = split_gate_up(h1, spec) if spec.gated else (h1, None)
        a = activation_reference(g, u, spec)
        wr = rw[t_idx, k_idx].float()[:, None]
        if not spec.router_weight_after_fc2:
            a = a * wr
        if act_quant and ties:
            lo, hi = _activation_bounds(g, u, spec)
            if not spec.router_weight_after_fc2:
                lo, hi = lo * wr, hi * wr
            a, delta = _fp8_round_trip_ties(a, lo, hi)
            if spec.router_weight_after_fc2:
                delta = delta * wr
            row, c = delta.nonzero(as_tuple=True)
            found.append(Ties(t_idx[row], torch.full_like(row, e), c, delta[row, c], w2))
        elif act_quant:
            a = _fp8_round_trip(a)
        h2 = a @ _expert(w2, e).t()
        if spec.router_weight_after_fc2:
            h2 = h2 * wr
        out.index_add_(0, t_idx, h2)
    return (out, Ties.cat(found, w2)) if ties else out


# ---------------------------------------------------------------------------
# Comparing a layer's output with this reference: one function, one tolerance
# table, used by tests/moe, tests/layers and `sparkinfer bench moe`.
#
# Cosine similarity alone cannot see a scale error (1.5 * out has cosine 1), so
# every comparison also bounds the relative error norm and the worst element.
# The reference must be computed with its OWN routing (`route_reference` on the
# logits), never the kernel's ids: a routing bug then shows up as an error.
#
# max_rel is per element, relative to the element and floored at the output's
# RMS: max_i |out_i - ref_i| / (|ref_i| + rms(ref)). The floor keeps elements
# near zero (where any absolute error is an unbounded relative one) from
# deciding it, while a 1.5x scale still gives >= 0.25 on the largest elements.

@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Bounds on one comparison (see `compare_to_reference`).

    cosine_min: lowest cosine similarity of the flattened outputs.
    rel_norm_max: highest ||out - ref|| / ||ref|| (Frobenius, fp32).
    max_rel_max: highest max_i |out_i - ref_i| / (|ref_i| + rms(ref)).
    """

    cosine_min: float
    rel_norm_max: float
    max_rel_max: float


# The tolerance table. Why these numbers: the kernels accumulate in fp32 but
# store the activated FC1 rows and the output in bf16 (relative rounding
# <= 2^-9 = 1.95e-3 per element); NVFP4 layers are compared on their
# dequantized weights, so both formats see the same error, and share a row.
#
# "interpreter": Triton's interpreter casts fp32 -> bf16 by truncation, not
#   round-to-nearest (0.28% low on average per cast; /tmp check at c49831a:
#   mean (bf16(x) - x) / x = -2.8e-3 vs 3.5e-5 for torch's cast), and a layer
#   casts twice, so its outputs run ~0.7% small. Measured on the 26 CPU
#   comparisons of tests/moe (c49831a): rel_norm 5.1e-3 .. 9.1e-3 (2.2e-3 ..
#   2.9e-3 once that scale is removed), max_rel 5.1e-3 .. 1.15e-2. Bounds:
#   rel_norm 1.5e-2 (1.6x the worst seen; a 1.5x scale gives 0.5, one dropped
#   route of six ~0.4), max_rel 3e-2 (2.6x the worst seen).
# "gpu": round-to-nearest casts remove the 0.7% bias, leaving ~3e-3 (the
#   interpreter's error with its scale removed): rel_norm 1e-2 (3x that),
#   max_rel 3e-2 as above. The GPU runs record every rel_norm and max_rel
#   (`sparkinfer bench moe` check rows), so these margins are checked there.
# "gpu_fp8": fp8_block on the GPU. Its reference rounds FC2's input to E4M3 too,
#   so any FC1 difference that crosses a rounding tie moves that input by a whole
#   E4M3 step (6-12%). Hopper's e4m3 wgmma accumulates a 128-long K block with
#   ~14-bit precision: FC1 differs from the exact sum by 1.3-1.7e-4 relative
#   (H200 diag at e2d9eba), which flips 1.1-1.5% of FC2's input codes; with the
#   same dots on bf16 operands 0.002% flip and the outputs match to 2.4e-3. The
#   flips leave rel_norm at 4.0-6.7e-3 (36 timed checks of `bench moe`, 12 check
#   rows, 9 GPU tests at e2d9eba) but one output element can collect several:
#   max_rel reached 7.8e-2 (tests) and 9.2e-2 (Qwen3 M = 4096). Bounds: rel_norm
#   1e-2 as for the other formats (the reference's own CUDA-division bug, fixed
#   at 4ca0b34, gave 1.4e-2; a 1.5x scale 0.5), max_rel 0.15. One token is the
#   tail: its flips have no other rows to average over, and one flip on a large
#   element of a top-weighted route gave 1.60e-2 (TP8 shard, T 1, an unseeded draw
#   at 0467373, gpu_tests_h200.json) and 1.16e-2 (the same shard, `bench moe`'s
#   timed check, H100 at c95a5fa), so the GPU tests seed their inputs and `bench
#   moe` compares with the flips explained (`Ties`, tests/moe/test_ties.py). An exact
#   FC1 (bf16 operands, or tl.dot's max_num_imprecise_acc) would remove the flips
#   at a speed cost not yet measured in a recorded run; until it is, the kernels
#   keep the fast accumulation.
# cosine >= 0.9999 is what the suite always used; kept beside the bounds that
# see magnitude, not instead of them.
TOLERANCES = {
    "interpreter": Tolerance(cosine_min=0.9999, rel_norm_max=1.5e-2, max_rel_max=3e-2),
    "gpu": Tolerance(cosine_min=0.9999, rel_norm_max=1e-2, max_rel_max=3e-2),
    "gpu_fp8": Tolerance(cosine_min=0.9999, rel_norm_max=1e-2, max_rel_max=0.15),
}


def tolerance_for(out: torch.Tensor, weight_format: str = "bf16") -> Tolerance:
    """The row of `TOLERANCES` that applies to an output computed on out's device
    (a CPU tensor comes from the Triton interpreter) in `weight_format`."""
    if not out.is_cuda:
        return TOLERANCES["interpreter"]
    return TOLERANCES["gpu_fp8" if weight_format == "fp8_block" else "gpu"]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One output against its reference; ok when finite and within `tol`."""

    cosine: float
    rel_norm: float
    max_rel: float
    finite: bool
    tol: Tolerance
    flips: float = 0.0  # E4M3 rounding flips taken out of the error (`Ties.explain`)
    raw_rel_norm: float | None = None  # rel_norm before they were (None: no ties given)

    @property
    def ok(self) -> bool:
        t = self.tol
        return (self.finite and self.cosine >= t.cosine_min and self.rel_norm <= t.rel_norm_max
                and self.max_rel <= t.max_rel_max)

    def as_row(self) -> dict:
        """The measured values and the verdict (within_tol), for a result row."""
        return dict(cosine=self.cosine, rel_norm=self.rel_norm, max_rel=self.max_rel,
                    finite=self.finite, within_tol=self.ok, flips=self.flips, raw_rel_norm=self.raw_rel_norm)

    def __str__(self) -> str:
        # Bounds print exactly (:g keeps 1.5e-2 and 0.15 as written in TOLERANCES): a
        # failure message must show the bound that was applied, not a rounded one.
        t = self.tol
        return (f"cosine {self.cosine:.6f} (>= {t.cosine_min:g}), rel_norm {self.rel_norm:.2e} "
                f"(<= {t.rel_norm_max:g}), max_rel {self.max_rel:.2e} (<= {t.max_rel_max:g}), "
                f"finite {self.finite}" + (f", after {self.flips:.1f} E4M3 flips" if self.flips else ""))


def compare_to_reference(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance | None = None, *,
                         weight_format: str = "bf16", ties: Ties | None = None) -> Comparison:
    """Compare a layer output out [T, H] (any float dtype) with its fp32 reference
    ref [T, H] (computed with the reference's own routing); tol defaults to
    `tolerance_for(out, weight_format)`. ties: the reference's (`moe_reference(...,
    ties=True)`, for these rows): the error the kernel's other roundings of FC2's
    E4M3 input explain is left out (`Ties.explain`). Allocates; syncs with the host
    (returns Python floats); not capture-legal."""
    tol = tol or tolerance_for(out, weight_format)
    o, r = out.float(), ref.float()
    finite = bool(torch.isfinite(o).all())
    rn = r.norm()
    flips, raw = 0.0, None
    if finite and ties is not None and o.dim() == 2:
        diff = o - r
        d, flips = ties.explain(diff)
        raw = (diff.norm() / rn).item()
        o = r + d
    o, r = o.flatten(), r.flatten()
    d = (o - r).abs()
    rms = rn / max(r.numel(), 1) ** 0.5
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item() if finite else float("nan")
    rel = (d.norm() / rn).item() if finite else float("inf")
    mx = (d / (r.abs() + rms)).max().item() if finite else float("inf")
    return Comparison(cosine=cos, rel_norm=rel, max_rel=mx, finite=finite, tol=tol, flips=flips, raw_rel_norm=raw)
