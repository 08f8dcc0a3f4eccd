"""`run(binding)`: launch the kernels of one bound MoE call.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate per rank,
R = T*K routes, S splits.

micro:   [routing] -> FC1 (+ activation, bf16; or fp32 partials when split)
         -> FC2 (fp32 partials) -> weighted top-k sum.
grouped: [routing] -> sort count -> sort offsets -> sort scatter -> FC1 +
         activation (bf16, sorted rows) -> FC2 (per route) -> weighted top-k sum.
"""

from __future__ import annotations

import triton

from sparkinfer.moe.binding import _ACT, MoEBinding, max_tiles, sort_chunk
from sparkinfer.moe.kernels.fc1 import moe_fc1_kernel
from sparkinfer.moe.kernels.fc2 import moe_act_kernel, moe_fc2_kernel
from sparkinfer.moe.kernels.reduce import moe_reduce_kernel
from sparkinfer.moe.kernels.sort import sort_count_kernel, sort_offsets_kernel, sort_scatter_kernel
from sparkinfer.moe.plan import MICRO_BLOCK_M
from sparkinfer.moe.routing.launch import route

__all__ = ["run"]

# Top-k reduce width: the widest BH whose grid still has >= SMs / 2 programs,
# else 128. H200 at 14cdea2 (reduce kernel alone, benchmarks/results/
# moe_reduce_h200.json), us by BH 128 / 256 / 512 / 1024: T 1, H 7168: 1.79 /
# 1.80 / 2.04 / 3.03; T 8: 3.34 / 2.34 / 2.26 / 3.25; T 64: 19.9 / 19.0 / 6.9 /
# 3.0; T 4096: 1124 / 1059 / 299 / 126 (bf16 partials).
REDUCE_BLOCKS_H = (1024, 512, 256, 128)
ACT_BLOCK_R = 16
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


def _splits(chunks: int, split: int) -> tuple[int, int]:
    """(chunks per split, splits actually launched) for a reduction of `chunks`
    steps cut `split` ways (every launched split gets >= 1 chunk)."""
    per = triton.cdiv(chunks, split)
    return per, triton.cdiv(chunks, per)


def _gemm_common(b: MoEBinding, bk: int) -> dict:
    spec, c = b.plan.spec, b.plan.caps
    return dict(E=c.num_experts, K=c.top_k, KP=triton.next_power_of_2(c.top_k),
                RP=triton.next_power_of_2(MICRO_BLOCK_M * c.top_k), BK=bk,
                GATED=spec.gated, ACT=_ACT[spec.activation],
                NVFP4=spec.weight_format == "nvfp4",
                WEIGHT_BEFORE=not spec.router_weight_after_fc2,
                PTX_DECODE=b.config.decode == "ptx", INTERPRET=b.interpret,
                num_warps=b.config.num_warps)


def _sort(b: MoEBinding, routes: int, block_m: int, tiles: int) -> None:
    c, s = b.plan.caps, b.scratch
    ch = sort_chunk(c.num_experts)
    nch = triton.cdiv(routes, ch)
    ep = triton.next_power_of_2(c.num_experts)
    ids = b.topk_ids
    sort_count_kernel[(nch,)](ids, s["sort_counts"], routes, E=c.num_experts, EP=ep, CH=ch)
    sort_offsets_kernel[(1,)](s["sort_counts"], s["sort_base"], s["tile_expert"],
                              s["sorted_route"], nch, tiles, E=c.num_experts, EP=ep,
                              CB=max(1, 8192 // ep), BM=block_m, FILL=1024,
                              TB=max(1, 8192 // ep), num_warps=8)
    sort_scatter_kernel[(nch,)](ids, s["sort_base"], s["sorted_route"], routes, E=c.num_experts,
                                EP=ep, CH=ch)


def run(b: MoEBinding) -> None:
    """Compute b.out [T, H] = MoE(b.x) for the bound call.

    Allocates nothing, never syncs with the host, legal inside CUDA graph
    capture (all grids come from T and the plan, never from routed data).
    """
    spec, c, cfg, s, w = b.plan.spec, b.plan.caps, b.config, b.scratch, b.weights
    t, h, i = b.tokens, c.hidden, c.intermediate
    routes = t * c.top_k
    if b.logits is not None:
        route(b.logits, spec, (b.topk_ids, b.topk_weights), bias=b.bias)
    nvfp4 = spec.weight_format == "nvfp4"
    s1, s2 = (w.s1, w.s2) if nvfp4 else (w.w1, w.w2)
    g1, g2 = (w.g1, w.g2) if nvfp4 else (w.w1, w.w2)
    # expert stride, row stride (bf16; NVFP4 rows are tiled), scale expert stride
    sw1 = (w.w1.stride(0), 0 if nvfp4 else w.w1.stride(1), s1.stride(0) if nvfp4 else 0)
    sw2 = (w.w2.stride(0), 0 if nvfp4 else w.w2.stride(1), s2.stride(0) if nvfp4 else 0)
    bk = cfg.block_k or b.plan.chunk
    chunks1, chunks2 = h // bk, i // bk
    common = _gemm_common(b, bk)
    alpha, limit = float(spec.swiglu_alpha), float(spec.swiglu_limit)
    ids, tw = b.topk_ids, b.topk_weights
    pdl = MICRO_PDL and cfg.family == "micro" and not b.interpret
    trigger = dict(PDL=True) if pdl else {}  # FC1: lets its successor launch early
    on = dict(trigger, launch_pdl=True) if pdl else {}  # the early-launched dependents
    if cfg.family == "micro":
        (cps1, sp1), (cps2, sp2) = _splits(chunks1, cfg.split1), _splits(chunks2, cfg.split2)
        # one FC1 split: FC1 applies the activation and stores bf16 rows; more:
        # fp32 gate/up partials, which moe_act_kernel turns into those rows
        split = sp1 > 1
        p1 = s["fc1_partial"] if split else s["fc1_act"]
        p2 = s["fc2_partial"]
        p1s = (p1.stride(0), p1.stride(1)) if split else (0, p1.stride(0))
        moe_fc1_kernel[(routes, triton.cdiv(i, cfg.block_n1), sp1)](
            b.x, w.w1, s1, g1, ids, tw, ids, ids, p1, t, i, chunks1, cps1,
            h, *sw1, *p1s, alpha, limit,
            BM=cfg.block_m, BN=cfg.block_n1, MICRO=True, PARTIALS=split,
            num_stages=cfg.stages1, **common, **trigger)
        if split:  # sum and activate the partials once per route
            a = s["fc1_act"]
            moe_act_kernel[(triton.cdiv(routes, ACT_BLOCK_R), i // bk)](
                p1, tw, a, routes, i, *p1s, a.stride(0), alpha, limit, BR=ACT_BLOCK_R,
                BI=bk, S1=sp1, GATED=common["GATED"], ACT=common["ACT"],
                WEIGHT_BEFORE=common["WEIGHT_BEFORE"], INTERPRET=common["INTERPRET"], **on)
            p1 = a
        moe_fc2_kernel[(routes, triton.cdiv(h, cfg.block_n2), sp2)](
            p1, w.w2, s2, g2, ids, tw, ids, ids, p2, t, h, chunks2, cps2, p1.stride(0), *sw2,
            p2.stride(0), p2.stride(1), BM=cfg.block_m, BN=cfg.block_n2, MICRO=True,
            num_stages=cfg.stages2, **common, **on)
        part, splits, stride_ps = p2, sp2, p2.stride(0)
    else:
        tiles = max_tiles(routes, c.num_experts, cfg.block_m)
        _sort(b, routes, cfg.block_m, tiles)
        srt, te, inter, ro = s["sorted_route"], s["tile_expert"], s["inter"], s["route_out"]
        moe_fc1_kernel[(tiles, triton.cdiv(i, cfg.block_n1), 1)](
            b.x, w.w1, s1, g1, ids, tw, srt, te, inter, t, i, chunks1, chunks1,
            h, *sw1, 0, inter.stride(0), alpha, limit,
            BM=cfg.block_m, BN=cfg.block_n1, MICRO=False, PARTIALS=False,
            num_stages=cfg.stages1, **common)
        moe_fc2_kernel[(tiles, triton.cdiv(h, cfg.block_n2), 1)](
            inter, w.w2, s2, g2, ids, tw, srt, te, ro, t, h, chunks2, chunks2,
            inter.stride(0), *sw2, 0, ro.stride(0), BM=cfg.block_m, BN=cfg.block_n2,
            MICRO=False, num_stages=cfg.stages2, **common)
        part, splits, stride_ps = ro, 1, 0
    bh = next((bh for bh in REDUCE_BLOCKS_H if 2 * t * triton.cdiv(h, bh) >= c.num_sms),
              REDUCE_BLOCKS_H[-1])
    moe_reduce_kernel[(t, triton.cdiv(h, bh))](
        part, ids, tw, b.out, h, splits, stride_ps, part.stride(-2), b.out.stride(0),
        E=c.num_experts, K=c.top_k, KP=triton.next_power_of_2(c.top_k), BH=bh,
        WEIGHT_AFTER=spec.router_weight_after_fc2, **on)

