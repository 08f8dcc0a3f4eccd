"""`run(binding)`: launch the kernels of one bound MoE call.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate per rank,
R = T*K routes, S splits.

micro:   [routing] -> FC1 (+ activation, bf16; or fp32 partials when split)
         -> FC2 (fp32 partials) -> weighted top-k sum.
grouped: [routing] -> sort count -> sort scatter (+ offsets) -> FC1 +
         activation (bf16, sorted rows) -> FC2 (per route) -> weighted top-k sum.

fp8_block: the same kernels with e4m3 operands; micro quantizes x inside FC1,
grouped in one pass before it (`moe_quant_kernel`); FC2's input is e4m3 +
scales from FC1's (or the act kernel's) epilogue.
NVFP4 buckets with `dequant_experts`: grouped, and per chunk of experts:
decode FC1's weights to bf16 -> FC1 (bf16 tiles) -> decode FC2's -> FC2; the
copies keep the NVFP4 kernels' K order, FC1 gathers x and stores FC2's input
in it, so the sums are theirs (`step_k_order`, `k_position`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from sparkinfer.errors import ShapeError
from sparkinfer.moe.binding import _ACT, MoEBinding, max_tiles, sort_chunk, sort_split
from sparkinfer.moe.kernels.common import NVFP4_TILE_ROWS
from sparkinfer.moe.kernels.convert import moe_quant_kernel, nvfp4_dequant_kernel
from sparkinfer.moe.kernels.fc1 import moe_fc1_kernel
from sparkinfer.moe.kernels.fc2 import moe_act_kernel, moe_fc2_kernel
from sparkinfer.moe.kernels.reduce import moe_reduce_kernel, moe_reduce_norm_kernel
from sparkinfer.moe.kernels.sort import sort_count_kernel, sort_scatter_kernel
from sparkinfer.moe.plan import FP8_BLOCK, MICRO_BLOCK_M
from sparkinfer.moe.routing.launch import route
from sparkinfer.norm.launch import check_rows, row_launch

__all__ = ["RouteSum", "run"]

# Top-k reduce width: the widest BH whose grid still has >= SMs / 2 programs,
# else 128. H200 at 14cdea2 (reduce kernel alone, benchmarks/results/
# moe_reduce_h200.json), us by BH 128 / 256 / 512 / 1024: T 1, H 7168: 1.79 /
# 1.80 / 2.04 / 3.03; T 8: 3.34 / 2.34 / 2.26 / 3.25; T 64: 19.9 / 19.0 / 6.9 /
# 3.0; T 4096: 1124 / 1059 / 299 / 126 (bf16 partials).
REDUCE_BLOCKS_H = (1024, 512, 256, 128)
ACT_BLOCK_R = 16
# Tokens per program of the grouped FP8 family's x quantization (a [128, 32]
# bf16 tile, 8 KiB, per program; memory-bound, 448 programs at T 256, H 7168).
QUANT_BLOCK_T = 32
# micro family: the act kernel, FC2 and the reduce are launched with
# programmatic dependent launch: FC1 and FC2 let the next kernel's blocks launch
# once their K loops end, and those blocks wait (griddepcontrol.wait) before
# reading. H200 at fc6e16b + x_latenopf.patch vs MICRO_PDL off, graph replay
# (moe_layout_ab_h200.json, two calls): 23 of 24 micro points faster (Mixtral
# NVFP4 M=1 82.3 vs 82.1 us, within noise), e.g. TP8
# shard NVFP4 M=1 21.2 vs 22.8 us, M=2 29.5 vs 31.1, Qwen3 NVFP4 M=1 20.5 vs
# 21.1, DeepSeek-V3 bf16 M=8 1096.6 vs 1120.3. Letting them launch at FC1's
# start, or prefetching FC2's weights into L2 before the wait, made large
# shapes slower (DeepSeek-V3 NVFP4 M=1 86.6 / 97.0 vs 76.7 us).
MICRO_PDL = True
# micro FC1 launched early behind the routing (which lets its successor launch at
# entry), waiting at its own entry (WAIT). On since an H100 A/B with attention.launch's
# ATTENTION_PDL and COMBINE_LETS_NEXT (their comment has the numbers: about 1% a batch-1 step).
FC1_PDL = True


def _splits(chunks: int, split: int) -> tuple[int, int]:
    """(chunks per split, splits actually launched) for a reduction of `chunks`
    steps cut `split` ways (every launched split gets >= 1 chunk)."""
    per = triton.cdiv(chunks, split)
    return per, triton.cdiv(chunks, per)


def _sort(b: MoEBinding, routes: int, block_m: int, tiles: int) -> None:
    c, s = b.plan.caps, b.scratch
    ch = sort_chunk(c.num_experts)
    sub, nch = sort_split(routes, c.num_experts)
    ep = triton.next_power_of_2(c.num_experts)
    ids, rows = b.topk_ids, tiles * block_m
    sort_count_kernel[(nch,)](ids, s["sort_counts"], s["sorted_route"], routes, sub,
                              triton.cdiv(rows, nch), rows, E=c.num_experts, EP=ep, CH=ch,
                              FILL=1024)
    sort_scatter_kernel[(nch,)](ids, s["sort_counts"], s["sorted_route"], s["tile_expert"], routes, sub,
                                nch, tiles, E=c.num_experts, EP=ep, CH=ch, CB=max(1, 8192 // ep), BM=block_m,
                                TB=max(1, 8192 // ep), num_warps=8)


@dataclass(frozen=True)
class _Weights:
    """What the GEMM kernels read for one matrix: values, scales (NVFP4 codes or
    FP8 block scales; a placeholder otherwise), NVFP4 global scales (or a
    placeholder), and (expert stride, row stride, scale expert stride)."""

    w: torch.Tensor
    s: torch.Tensor
    g: torch.Tensor
    strides: tuple[int, int, int]


def _weights(w, s, g, nvfp4: bool) -> _Weights:
    strides = (w.stride(0), 0 if nvfp4 else w.stride(1), 0 if s is None else s.stride(0))
    return _Weights(w, w if s is None else s, w if g is None else g, strides)


def run(b: MoEBinding, reduce: bool = True) -> RouteSum | None:
    """Compute b.out [T, H] = MoE(b.x) for the bound call; reduce False: everything but
    the top-k sum, returned as a `RouteSum` for the residual add + RMSNorm after it.

    Allocates nothing, never syncs with the host, legal inside CUDA graph
    capture (all grids come from T and the plan, never from routed data).
    """
    spec, c, cfg, w = b.plan.spec, b.plan.caps, b.config, b.weights
    if b.logits is not None:
        route(b.logits, spec, (b.topk_ids, b.topk_weights), bias=b.bias)
    fmt = spec.weight_format
    nvfp4 = fmt == "nvfp4"
    w1, w2 = _weights(w.w1, w.s1, w.g1, nvfp4), _weights(w.w2, w.s2, w.g2, nvfp4)
    bk = cfg.block_k or b.plan.chunk
    common = dict(E=c.num_experts, K=c.top_k, KP=triton.next_power_of_2(c.top_k),
                  RP=triton.next_power_of_2(MICRO_BLOCK_M * c.top_k), BK=bk, GATED=spec.gated,
                  ACT=_ACT[spec.activation], NVFP4=nvfp4, FP8=fmt == "fp8_block",
                  GSCALE=nvfp4, WEIGHT_BEFORE=not spec.router_weight_after_fc2,
                  PTX_DECODE=cfg.decode == "ptx", INTERPRET=b.interpret, RESCALE=cfg.fp8_rescale,
                  ROWS=cfg.rows_on_mma_m, num_warps=cfg.num_warps)
    if cfg.family == "micro":
        part, splits = _micro(b, w1, w2, common)
        stride_ps = part.stride(0)
    else:
        part, splits, stride_ps = _grouped(b, w1, w2, common), 1, 0
    t, h = b.tokens, c.hidden
    pdl = MICRO_PDL and cfg.family == "micro" and not b.interpret
    if not reduce:
        return RouteSum(part, b.topk_ids, b.topk_weights, splits, stride_ps, c.num_experts,
                        spec.router_weight_after_fc2, pdl, b.out.dtype)
    bh = next((bh for bh in REDUCE_BLOCKS_H if 2 * t * triton.cdiv(h, bh) >= c.num_sms),
              REDUCE_BLOCKS_H[-1])
    moe_reduce_kernel[(t, triton.cdiv(h, bh))](
        part, b.topk_ids, b.topk_weights, b.out, h, stride_ps, part.stride(-2),
        b.out.stride(0), E=c.num_experts, K=c.top_k, S=splits,
        BH=bh, WEIGHT_AFTER=spec.router_weight_after_fc2, **(dict(PDL=True, launch_pdl=True) if pdl else {}))


@dataclass(frozen=True)
class RouteSum:
    """A MoE call's output not yet summed over its top-k routes (`run(b, reduce=False)`):
    FC2's rows part [S, R, H] (S splits, stride_ps apart; grouped: S 1), the routes'
    expert ids and router weights, and the dtype the sum rounds to; `+ extra` adds a
    [T, H] tensor (a shared expert's output) after that rounding, as a torch add would.

    `add_rms_norm` runs the sum inside the residual add + RMSNorm that follows the layer
    (moe_reduce_norm_kernel): the bits of moe_reduce_kernel then `sparkinfer.norm`'s
    add_rms_norm (tests/moe/test_route_sum.py), one launch fewer per MoE layer (issue 28;
    tests/models/test_launch_count.py)."""

    part: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    splits: int
    stride_ps: int
    experts: int
    weight_after: bool
    wait: bool  # FC2 lets its successor launch early (micro): the sum waits in gdc_wait
    dtype: torch.dtype
    extra: torch.Tensor | None = None

    def __add__(self, extra: torch.Tensor) -> RouteSum:
        if self.extra is not None:
            raise ShapeError("a RouteSum takes one extra term; add the others to it first")
        return dataclasses.replace(self, extra=extra)

    def add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
        """(out, residual_out) = (rmsnorm(x + residual) * weight, x + residual), x this
        sum (rounded to `dtype`, + extra). Shapes and dtypes as `sparkinfer.norm.add_rms_norm`."""
        t, k = self.ids.shape
        h = weight.shape[-1]
        check_rows("residual", residual, h)
        if residual.shape[0] != t or residual.dtype != self.dtype:
            raise ShapeError(f"residual {tuple(residual.shape)} {residual.dtype}: the sum is [{t}, {h}] "
                             f"{self.dtype}")
        extra = self.extra if self.extra is not None else residual
        check_rows("extra", extra, h)
        if extra.shape[0] != t:
            raise ShapeError(f"extra {tuple(extra.shape)}: the sum is [{t}, {h}]")
        out = torch.empty_like(residual) if out is None else out
        residual_out = torch.empty_like(residual) if residual_out is None else residual_out
        for name, x in (("out", out), ("residual_out", residual_out)):
            check_rows(name, x, h)
        if t:
            moe_reduce_norm_kernel[(t,)](
                self.part, self.ids, self.weights, extra, residual, weight, out, residual_out, h,
                self.stride_ps, self.part.stride(-2), extra.stride(0), residual.stride(0), out.stride(0),
                residual_out.stride(0), float(eps), E=self.experts, K=k, S=self.splits,
                WEIGHT_AFTER=self.weight_after, HAS_EXTRA=self.extra is not None, WAIT=self.wait,
                **row_launch(h, residual.device), **(dict(launch_pdl=True) if self.wait else {}))
        return out, residual_out


def _micro(b: MoEBinding, w1: _Weights, w2: _Weights, common: dict):
    """micro: FC1 (+ activation; or fp32 partials and the act kernel) -> FC2
    partials. Returns (FC2 partials [S2, R, H], S2)."""
    spec, c, cfg, s = b.plan.spec, b.plan.caps, b.config, b.scratch
    t, h, i, bk = b.tokens, c.hidden, b.plan.intermediate, common["BK"]
    routes, fp8 = t * c.top_k, common["FP8"]
    alpha, limit = float(spec.swiglu_alpha), float(spec.swiglu_limit)
    ids, tw = b.topk_ids, b.topk_weights
    pdl = MICRO_PDL and not b.interpret
    trigger = dict(PDL=True) if pdl else {}  # FC1: lets its successor launch early
    on = dict(trigger, launch_pdl=True) if pdl else {}  # the early-launched dependents
    (cps1, sp1), (cps2, sp2) = _splits(h // bk, cfg.split1), _splits(i // bk, cfg.split2)
    # one FC1 split: FC1 applies the activation and stores bf16 rows (FP8: e4m3
    # rows + scales); more: fp32 gate/up partials, which moe_act_kernel turns into those rows
    split = sp1 > 1
    a = s["fc1_act"]
    a_s = s["fc1_act_scale"] if fp8 else a
    p1 = s["fc1_partial"] if split else a
    p2 = s["fc2_partial"]
    p1s = (p1.stride(0), p1.stride(1)) if split else (0, p1.stride(0))
    moe_fc1_kernel[(routes, triton.cdiv(i, cfg.block_n1), sp1)](
        b.x, b.x, w1.w, w1.s, w1.g, ids, tw, ids, ids, p1, a_s, w1.w, t, i, h // bk, cps1, 0,
        c.num_experts, b.x.stride(0), *w1.strides, *p1s, alpha, limit,
        BM=cfg.block_m, BN=cfg.block_n1, MICRO=True, PARTIALS=split, X_FP8=False,
        num_stages=cfg.stages1, WAIT=pdl and FC1_PDL, **common, **trigger,
        **(dict(launch_pdl=True) if pdl and FC1_PDL else {}))
    if split:  # sum and activate the partials once per route
        moe_act_kernel[(triton.cdiv(routes, ACT_BLOCK_R), i // bk)](
            p1, tw, a, a_s, routes, i, *p1s, a.stride(0), alpha, limit, BR=ACT_BLOCK_R,
            BI=bk, S1=sp1, GATED=common["GATED"], ACT=common["ACT"],
            WEIGHT_BEFORE=common["WEIGHT_BEFORE"], FP8=fp8, INTERPRET=common["INTERPRET"], **on)
    moe_fc2_kernel[(routes, triton.cdiv(h, cfg.block_n2), sp2)](
        a, a_s, w2.w, w2.s, w2.g, ids, tw, ids, ids, p2, w2.w, a, t, h, i // bk, cps2, 0,
        c.num_experts,
        a.stride(0), *w2.strides, p2.stride(0), p2.stride(1), BM=cfg.block_m,
        BN=cfg.block_n2, MICRO=True, X_FP8=True, num_stages=cfg.stages2, **common, **on)
    return p2, sp2


def _grouped(b: MoEBinding, w1: _Weights, w2: _Weights, common: dict):
    """grouped: sort -> [FP8: quantize x] -> FC1 -> FC2, over all experts at once
    or (NVFP4 dequantized path) one chunk of experts at a time, each chunk's
    weights first decoded to bf16 in w_bf16. Returns route_out [R, H]."""
    spec, c, cfg, s = b.plan.spec, b.plan.caps, b.config, b.scratch
    t, h, i, e = b.tokens, c.hidden, b.plan.intermediate, c.num_experts
    routes, bk = t * c.top_k, common["BK"]
    tiles = max_tiles(routes, e, cfg.block_m)
    _sort(b, routes, cfg.block_m, tiles)
    x, xs = b.x, b.x
    if common["FP8"]:  # x once to e4m3 + scales, not in every FC1 program
        x, xs = s["x_fp8"], s["x_scale"]
        moe_quant_kernel[(triton.cdiv(t, QUANT_BLOCK_T), h // FP8_BLOCK)](
            b.x, x, xs, t, b.x.stride(0), h // FP8_BLOCK, BT=QUANT_BLOCK_T, G=FP8_BLOCK,
            INTERPRET=b.interpret)
    inter, ro = s["inter"], s["route_out"]
    inter_s = s["inter_scale"] if common["FP8"] else inter
    ids, tw, srt, te = b.topk_ids, b.topk_weights, s["sorted_route"], s["tile_expert"]
    alpha, limit = float(spec.swiglu_alpha), float(spec.swiglu_limit)
    n1 = (2 if spec.gated else 1) * i
    chunk = cfg.dequant_experts
    if chunk:  # bf16 kernels on decoded copies (in NVFP4's K order), the global scale in their epilogues
        common = dict(common, NVFP4=False, GSCALE=True)
        wb = s["w_bf16"]
    for e_lo in range(0, e, chunk or e):
        e_hi = min(e, e_lo + (chunk or e))
        ww1, ww2 = w1, w2
        if chunk:
            ww1 = _decoded(b, w1, wb, e_lo, e_hi, n1, h)
        moe_fc1_kernel[_grid(cfg, tiles, i, cfg.block_n1)](
            x, xs, ww1.w, ww1.s, ww1.g, ids, tw, srt, te, inter, inter_s,
            _desc(cfg, ww1, e_hi - e_lo, n1, h, cfg.block_n1 // cfg.fc1_passes, bk), t, i, h // bk, h // bk,
            e_lo, e_hi, x.stride(0), *ww1.strides, 0, inter.stride(0), alpha, limit,
            BM=cfg.block_m, BN=cfg.block_n1, MICRO=False, PARTIALS=False, X_FP8=True,
            num_stages=cfg.stages1, GROUP=cfg.group_m, TMA=cfg.tma, PASSES=cfg.fc1_passes,
            KCH=b.plan.chunk if chunk else 0, **common)
        if chunk:
            ww2 = _decoded(b, w2, wb, e_lo, e_hi, h, i)
        bm2 = cfg.fc2_block_m  # FC2's rows a program: block_m / bm2 programs a sorted tile
        d_a = TensorDescriptor(inter, list(inter.shape), list(inter.stride()),
                               [bm2, bk]) if cfg.tma else inter
        moe_fc2_kernel[_grid(cfg, tiles * (cfg.block_m // bm2), h, cfg.block_n2)](
            inter, inter_s, ww2.w, ww2.s, ww2.g, ids, tw, srt, te, ro,
            _desc(cfg, ww2, e_hi - e_lo, h, i, cfg.block_n2, bk), d_a, t, h, i // bk, i // bk,
            e_lo, e_hi, inter.stride(0), *ww2.strides, 0, ro.stride(0), BM=bm2,
            BN=cfg.block_n2, MICRO=False, X_FP8=True, num_stages=cfg.stages2,
            GROUP=cfg.group_m, TMA=cfg.tma, TILE_M=cfg.block_m if bm2 != cfg.block_m else 0, **common)
    return ro


def _grid(cfg, tiles: int, n: int, bn: int) -> tuple[int, int, int]:
    """A grouped GEMM's grid: (tiles, weight blocks) or, group_m > 0, their
    product on one axis (kernels/common.py grouped_ids)."""
    blocks = triton.cdiv(n, bn)
    return (tiles * blocks, 1, 1) if cfg.group_m else (tiles, blocks, 1)


def _desc(cfg, wt: _Weights, experts: int, n: int, r: int, bn: int, bk: int):
    """TMA descriptor over experts x [n, r] weights (block [1, bn, bk]) when the
    config loads weights by TMA, else the weights (the kernel ignores them)."""
    if not cfg.tma:
        return wt.w
    return TensorDescriptor(wt.w, [experts, n, r], [wt.strides[0], wt.strides[1], 1],
                            [1, bn, bk])


def _decoded(b: MoEBinding, wt: _Weights, wb, e_lo: int, e_hi: int, n: int, r: int) -> _Weights:
    """Decode experts [e_lo, e_hi) of one prepared NVFP4 matrix [E, n, r] into
    wb as bf16 [e_hi - e_lo, n, r]; the _Weights the bf16 kernels read (global
    scales still wt.g, indexed by the global expert id)."""
    nvfp4_dequant_kernel[(e_hi - e_lo, triton.cdiv(n, NVFP4_TILE_ROWS), r // b.plan.chunk)](
        wt.w, wt.s, wb, e_lo, b.plan.caps.num_experts, n, r, r // b.plan.chunk, wt.w.stride(0),
        wt.s.stride(0), n * r, BN=NVFP4_TILE_ROWS, BK=b.plan.chunk,
        PTX_DECODE=b.config.decode == "ptx", INTERPRET=b.interpret)
    return _Weights(wb, wb, wt.g, (n * r, r, 0))
