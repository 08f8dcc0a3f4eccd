"""Tile configs around a plan's choice, to measure the planner's
thresholds and tiles on a GPU (`sparkinfer bench moe --sweep`; large-batch
tiles: `benchmarks/sweeps/moe_tile_sweep.py`).

Legend: T tokens, BM routed rows per tile, BN1 / BN2 weight rows per FC1 / FC2
program, S1 / S2 reduction splits of the micro family, BK reduction elements
per kernel step (`MoEPlan.chunk`).

Every candidate is served by the same kernels as the plan (constexpr variants),
so timing one is `plan.forced(config)`. Pure: no device, no compilation.
"""

from __future__ import annotations

import dataclasses

from sparkinfer.moe.plan import (
    FP8_BLOCK,
    MAX_SPLIT,
    SMEM_ONE_PER_SM,
    SMEM_TWO_PER_SM,
    MoEPlan,
    TileConfig,
    _stages,
    _weight_bytes,
    dequant_chunk,
    nvfp4_grouped_tiles,
    plan,
)

__all__ = ["candidates", "grouped_config", "tile_candidates", "order_candidates", "TILE_STAGE_CAP"]

TILE_STAGE_CAP = 4
# Large-batch tiles around the grouped plan (bf16): (name, BM, BN1, BN2, warps,
# programs per SM, BK). From the sm_90 compile (ptxas -v, ea79977 kernels,
# `benchmarks/sweeps/moe_tile_sweep.py --sm90` lists every one): the planned
# 128/64/128 x 8 warps emits m64n64k16 in FC1 (the two warpgroups split BM) and
# m64n128k16 in FC2, 142 / 141 registers, 192 KiB shared (3 stages of BK 128):
# one program per SM. BN1 128 or BM 256 at BK 128 fit only 2 stages; at BK 64
# the same tiles fit 4 (FC1 128/128: 255 registers, no spill; FC2 128/256: 202;
# FC2 256/128: 189, m64n256k16; FC1 256/64 at BK 64 spills 4 bytes, so it is
# not listed). "bk64-2cta": 96 KiB per program and <= 128 registers, so two
# share an SM. 16 warps do not compile at BM 256 x BN 256 (ptxas needs > 128
# registers a thread). "fc2-bm64": the planned BM 128 tiles with FC2 at 64 rows a program
# (TileConfig.block_m2; the 10th field), as NVFP4's FC2 ran faster at BM 64 (TILES_NVFP4):
# sm_90 at Qwen3 / Mixtral / DeepSeek-V3 M 4096, FC2 90 registers, m64n64k16, 160 KiB, no
# spill. Slower on an H100 at 1326b74 (sweeps/moe_tile_sweep_fc2_bm64_h100.json, M 4096, us / the
# planned): Qwen3 842 / 781, Mixtral 5,440 / 4,617, TP8 shard 1,779 / 1,627, DeepSeek-V3 10,547 / 10,187.
TILES_LARGE = (("fc2-bm64", 128, 128, 256, 8, 1, 64, 1, False, 64),
               ("bn1-128", 128, 128, 128, 8, 1, 128), ("bk64", 128, 64, 128, 8, 1, 64),
               ("bk64-bn1-128", 128, 128, 128, 8, 1, 64),
               ("bk64-bn2-256", 128, 64, 256, 8, 1, 64),
               ("bk64-wide", 128, 128, 256, 8, 1, 64), ("bk64-2cta", 128, 64, 128, 8, 2, 64),
               ("bm256", 256, 64, 128, 8, 1, 128), ("bm64", 64, 64, 128, 8, 1, 128),
               ("bm64-wide", 64, 128, 256, 8, 1, 128), ("bm64-bk64-wide", 64, 128, 256, 8, 1, 64),
               ("w4", 128, 64, 128, 4, 1, 128), ("bm256-bk64", 256, 64, 128, 8, 1, 64))
# Planned BM <= 32 (memory-bound batches): wider BN cuts the activation
# re-reads (one per BN block); BM 64 doubles the rows that share a weight tile.
TILES_SMALL = (("bm16", 16, 64, 64, 4, 2, 128), ("bn2-128", 32, 64, 128, 4, 2, 128),
               ("bn-128", 32, 128, 128, 4, 1, 128), ("bn2-256", 32, 64, 256, 4, 1, 128),
               ("bk64", 32, 64, 64, 4, 2, 64), ("bk64-bn-128", 32, 128, 128, 4, 2, 64),
               ("w8-bn2-128", 32, 64, 128, 8, 1, 128), ("bm64", 64, 64, 128, 8, 1, 128),
               ("bm64-bk64-wide", 64, 128, 256, 8, 1, 64))
# fp8_block at planned BM 64 (its register bound, plan.FP8_MAX_BLOCK_M): BM 128 with FC1 in
# two passes of 64 rows (TileConfig.fc1_passes), FC2 at BN 128 or 64. (name, BM, BN1, BN2,
# warps, programs per SM, BK, FC1 passes). ptxas for sm_90 on the CPU (Qwen3 dims, M 4096,
# `moe_tile_sweep.py --sm90 --shapes qwen3 --formats fp8_block --m 4096`, 668d429 + this
# change): FC1 at BM 128 spills 296 bytes in two passes against 1,172 in one (255
# registers, 4 stages; 220-264 at 2-3 stages), m64n64k32 (the two warpgroups split BM);
# BM 64 in two passes: 205 registers, no spill. FC2 at BM 128: BN 128 spills 216, BN 64
# none. Stacking each pass's gate rows over its up rows as one [128, BK] tile (one dot a
# step, m64n128k32) spilled 600 at BM 128, so the passes keep two dots. Timed on an H200
# at f3e3672 (`moe_tile_sweep.py --shapes qwen3,mixtral --formats fp8_block --m 1024,4096`,
# sweeps/moe_tile_sweep_fp8_h200.json): every one slower than the planned BM 64 in one pass,
# us planned / best of these: Qwen3 M 1024 339 / 386, M 4096 962 / 1,103; Mixtral 1,783 /
# 2,087, 6,423 / 7,173 (their FC1 below the planned one's share of the FP8 rate at every point).
# Kept as sweep candidates, never planned.
# Then the rescaled accumulation (plan.FP8_RESCALE; the 9th field): BM 128 in one pass and
# in two, and the planned BM 64; listed first, so tile_candidates' cap of 13 keeps them.
# Compiled for sm_90 on the CPU without a spill (tests/moe/test_compile_sm90.py); timed on an
# H100 at 79e4281 (plan.FP8_RESCALE_BM128_MIN_ROWS has the numbers). "bm128-rescale-fc2-bm64":
# FC2 at 64 rows a program over BM 128 tiles (block_m2): 104 registers, 96 KiB, two programs an
# SM at M 4096 (sm_90, the same three shapes). H100 at 1326b74 (sweeps/moe_tile_sweep_fc2_bm64_h100.json,
# M 4096, us / the planned): Qwen3 654 / 673, TP8 shard 1,269 / 1,305 (planned BM 64), DeepSeek-V3
# 5,950 / 6,181 (BM 64), but Mixtral 4,148 / 3,592 (1,024 rows an expert: FC2 reads each weight tile
# twice as often); planned from 128 to 256 rows an expert since a second H100 lease at 91ff03f
# (plan.FP8_GROUPED_FC2_ROWS has its numbers).
TILES_FP8 = (("bm128-rescale", 128, 128, 128, 8, 1, 128, 1, True),
             ("bm128-rescale-fc2-bm64", 128, 128, 128, 8, 1, 128, 1, True, 64),
             ("bm128-2pass-rescale", 128, 128, 128, 8, 1, 128, 2, True),
             ("bm64-rescale", 64, 128, 128, 8, 1, 128, 1, True),
             ("bm128-2pass", 128, 128, 128, 8, 1, 128, 2), ("bm128-2pass-bn2-64", 128, 128, 64, 8, 1, 128, 2),
             ("bm64-2pass", 64, 128, 128, 8, 1, 128, 2))
# NVFP4 (decode in registers): BK 128 only (BK fixes the prepared interleave).
# `moe_tile_sweep.py --sm90 --formats nvfp4` at 9ae2d3a (every shape, M 1024 and 4096): BN1 64
# at BM 128 (planned before plan.NVFP4_GROUPED_BN1; "kernel" in
# sweeps/moe_tile_sweep_nvfp4_n128_h100.json) emits m64n64k16 in FC1 (236-244 registers):
# its two warpgroups split BM, so each decodes the whole 64-row weight tile, twice the decode
# work per MMA. BN1 128 gives each warpgroup its own 64 rows at n = BM (BM 128: 254-255
# registers, no spill; BM 64: 169). BM 256 (472-508 bytes) and BM 128 at 4 warps (628-636) spill.
# Tried and removed: FC1's BN1 gate rows stacked over their up rows as one weight tile, one dot a
# step (ae743f8): at BM 256 each warpgroup ran m64n256k16 but ptxas spilled 364-368 bytes at 2
# stages; H100 (sweeps/moe_tile_sweep_nvfp4_stacked_h100.json), us planned / stacked BM 128 /
# stacked BM 256: Qwen3 M 4096 1,231 / 1,493 / 1,959, Mixtral M 4096 7,185 / 8,939 / 11,899,
# DeepSeek-V3 M 4096 10,761 / 12,820 / 22,042 (at BM 128 twice the programs load each activation tile).
# BN2 256 gives each FC2 warpgroup two accumulation chains (sm_90 compile: BM 128 spills 292
# bytes at 255 registers, BM 64 takes 228, no spill); timed on an H200 at 0812327: faster at
# all 8 points (plan.NVFP4_GROUPED_BN2 has the numbers), planned at BM 64 since. At BM 128 FC1
# ran fastest (Qwen3 M 4096 582 us against 655 at BM 64) and FC2 slowest (496 at BN2 256 against 411
# at BM 64): "n128-fc2-bm64-bn2-256" runs FC1 at BM 128 and FC2 at 64 rows a program over the same
# sorted tiles (TileConfig.block_m2; 10th field), planned at BM 128 since an H100 timed it (plan.py).
TILES_NVFP4 = (("bn1-64", 128, 64, 128, 8, 1, 128), ("bm64-bn1-64", 64, 64, 128, 8, 1, 128),
               ("bm64-w4", 64, 64, 128, 4, 1, 128), ("n128", 128, 128, 128, 8, 1, 128),
               ("bm64-n128", 64, 128, 128, 8, 1, 128), ("n128-bn2-256", 128, 128, 256, 8, 1, 128),
               ("bm64-n128-bn2-256", 64, 128, 256, 8, 1, 128),
               ("n128-fc2-bm64-bn2-256", 128, 128, 256, 8, 1, 128, 1, False, 64))


def grouped_config(p: MoEPlan, bm: int, bn1: int, bn2: int, decode: str, bm2: int = 0) -> TileConfig:
    """A `grouped` config with tiles (BM, BN1, BN2) and FC2 at bm2 rows a program
    (TileConfig.block_m2; 0: BM): 4 warps and two programs per SM up to BM 32, else
    8 warps and one; pipeline depth (2..3 at two per SM, 2..4 at one) from the shared
    memory a step needs. fp8_block: BN1 is always 128 (whole activation groups). Pure."""
    nvfp4 = p.spec.weight_format == "nvfp4"
    fp8 = p.spec.weight_format == "fp8_block"
    bn1 = FP8_BLOCK if fp8 else bn1
    halves = 2 if p.spec.gated else 1
    big = bm > 32
    budget, warps, cap = (SMEM_ONE_PER_SM, 8, 4) if big else (SMEM_TWO_PER_SM, 4, 3)
    act = 1 if fp8 else 2  # bytes per activation element
    fc1 = halves * _weight_bytes(bn1, p.chunk, nvfp4, fp8) + p.chunk * bm * act
    fc2 = _weight_bytes(bn2, p.chunk, nvfp4, fp8) + p.chunk * (bm2 or bm) * act
    return TileConfig("grouped", bm, bn1, bn2, num_warps=warps,
                        stages1=min(cap, _stages(fc1, budget)),
                        stages2=min(cap, _stages(fc2, budget)), decode=decode, block_m2=bm2)


def candidates(p: MoEPlan, tokens: int) -> tuple[tuple[str, TileConfig], ...]:
    """(name, config) to time at `tokens`, the plan's own choice first ("planned").

    micro buckets (T <= 16): FC1 unsplit where the plan splits it, twice the
    reduction splits (more programs in flight at tiny T), 8 warps a program (the
    NVFP4 decode's issue slots), and grouped BM 16 from T 4 (where micro stops paying).
    grouped: the neighbouring BMs (BM 32: 16 and 64); at BM >= 64 also BM 64 and, for bf16, wider
    FC1 tiles (BN1 128: m64 wgmma per warpgroup on gate and up), for nvfp4 BN1 64 (its
    warpgroups split BM) and the other of BM 64 / 128. nvfp4 grouped, T <= 64: the other decode.
    nvfp4 grouped: the other side of NVFP4_DEQUANT_MIN_ROWS second ("dequant":
    bf16 tiles on decoded copies, or "nvfp4-kernel"), so the sweep times the
    threshold. At most five per T, so a sweep of 4 shapes x 2 formats x 4 T
    compiles in about three minutes. Pure.
    """
    chosen = p.config_for(tokens)
    out = [("planned", chosen)]
    nvfp4 = p.spec.weight_format == "nvfp4"
    if nvfp4 and chosen.family == "grouped":
        out.append(_other_nvfp4_path(p, tokens))
        if chosen.dequant_experts:  # the rest are variations of the NVFP4 kernels' tiles
            chosen = out[-1][1]
    if nvfp4 and tokens <= 64 and chosen.family != "micro":  # micro: both decodes timed by bench_moe --quick
        other = "ptx" if chosen.decode == "arith" else "arith"
        out.append((f"decode-{other}", dataclasses.replace(chosen, decode=other)))
    if chosen.family == "micro":
        if chosen.split1 > 1:  # FC1 unsplit: FC2 reads bf16 activations instead of summing fp32 partials
            out.append(("micro-fc1-unsplit", dataclasses.replace(chosen, split1=1)))
        s1, s2 = min(2 * chosen.split1, MAX_SPLIT), min(2 * chosen.split2, MAX_SPLIT)
        if (s1, s2) != (chosen.split1, chosen.split2):
            out.append((f"micro-s{s1}x{s2}", dataclasses.replace(chosen, split1=s1,
                                                                split2=s2, stages2=2)))
        # two warpgroups on n8 halves of the rows (sm_90: m64n8k16). H100 at 1326b74
        # (sweeps/moe_sweep_micro_w8_h100.json), us 8 warps / the planned 4 at M 1: NVFP4 Qwen3 26.5 /
        # 18.6, TP8 shard 54.5 / 40.6, DeepSeek-V3 107.4 / 93.0; bf16 Qwen3 32.8 / 32.0, TP8 shard 47.5
        # / 42.7, DeepSeek-V3 239.9 / 281.6 (where micro-s2x2 took 240.2): kept as a candidate only
        if chosen.num_warps == 4:
            out.append(("micro-w8", dataclasses.replace(chosen, num_warps=8)))
        if tokens >= 4:
            out.append(("grouped-bm16", grouped_config(p, 16, 64, 64, chosen.decode)))
        return tuple(out)
    if chosen.block_m <= 32:
        bm = 32 if chosen.block_m == 16 else 16
        out.append((f"grouped-bm{bm}", grouped_config(p, bm, 64, 64, chosen.decode)))
        if chosen.block_m == 32:  # the other neighbour
            out.append(("grouped-bm64", grouped_config(p, 64, 64, 128, chosen.decode)))
    elif nvfp4:  # the warpgroups splitting BM (BN1 64, plan.NVFP4_GROUPED_BN1), the other BM
        out.append(("grouped-bn1-64", grouped_config(p, chosen.block_m, 64, 128, chosen.decode)))
        other = 64 if chosen.block_m == 128 else 128
        bn1, bn2, bm2 = nvfp4_grouped_tiles(other)
        out.append((f"grouped-bm{other}", grouped_config(p, other, bn1, bn2, chosen.decode, bm2)))
    elif p.spec.weight_format == "fp8_block":  # BM 64 is the largest that fits (plan.py)
        out.append(("grouped-bn2-64", grouped_config(p, chosen.block_m, 128, 64, chosen.decode)))
        out.append(("grouped-bm32", grouped_config(p, 32, 128, 64, chosen.decode)))
    else:
        out.append(("grouped-bn128", grouped_config(p, chosen.block_m, 128, 128, chosen.decode)))
        if chosen.block_m != 64:
            out.append(("grouped-bm64", grouped_config(p, 64, 64, 128, chosen.decode)))
    seen, kept = set(), []
    for name, cfg in out:  # the first of equal configs
        if cfg not in seen:
            seen.add(cfg)
            kept.append((name, cfg))
    return tuple(kept[:4])


def _other_nvfp4_path(p: MoEPlan, tokens: int) -> tuple[str, TileConfig]:
    """The NVFP4 grouped config on the other side of the dequantize threshold."""
    if p.config_for(tokens).dequant_experts:
        no = plan(dataclasses.replace(p.caps, dequant_scratch_bytes=0), p.spec)
        return "nvfp4-kernel", no.config_for(tokens)
    bf16 = plan(p.caps, dataclasses.replace(p.spec, weight_format="bf16")).config_for(tokens)
    padded = dataclasses.replace(p.caps, intermediate=p.intermediate)  # the copies' I
    return "dequant", dataclasses.replace(bf16, dequant_experts=max(1, dequant_chunk(padded, p.spec)))


def _tile(p: MoEPlan, bm: int, bn1: int, bn2: int, warps: int, per_sm: int, bk: int,
          chosen: TileConfig, passes: int = 1, rescale: bool = False, bm2: int = 0) -> MoEPlan:
    """p forced to these tiles, with the chosen config's decode, program order and loads
    (rescale: the rescaled FP8 accumulation, TileConfig.fp8_rescale; bm2: FC2's rows a
    program, TileConfig.block_m2). NVFP4: the NVFP4
    kernels' tiles, whose prepared weights no TMA descriptor walks, even where the plan
    chose the dequantized path (its bf16 tiles load the copies by TMA)."""
    nvfp4 = p.spec.weight_format == "nvfp4"
    fp8 = p.spec.weight_format == "fp8_block"
    halves = 2 if p.spec.gated else 1
    budget = SMEM_TWO_PER_SM if per_sm == 2 else SMEM_ONE_PER_SM
    fixed = 8 * 1024 if nvfp4 else 0  # the dequantized operand's staging (plan.SMEM_FIXED)

    def stages(per_stage):
        return max(2, min(TILE_STAGE_CAP, (budget - fixed) // per_stage))

    act = 1 if fp8 else 2  # bytes per activation element
    fc1 = halves * _weight_bytes(bn1, bk, nvfp4, fp8) + bk * bm * act
    fc2 = _weight_bytes(bn2, bk, nvfp4, fp8) + bk * (bm2 or bm) * act
    cfg = TileConfig("grouped", bm, bn1, bn2, num_warps=warps, stages1=stages(fc1),
                     stages2=stages(fc2), decode=chosen.decode, group_m=chosen.group_m,
                     tma=chosen.tma and not nvfp4, fc1_passes=passes, fp8_rescale=rescale or chosen.fp8_rescale,
                     block_m2=bm2)
    return dataclasses.replace(p.forced(cfg), chunk=bk)


def tile_candidates(p: MoEPlan, tokens: int, small: bool = False) -> tuple[tuple[str, MoEPlan], ...]:
    """(name, plan) to time at a grouped batch of `tokens`: ("planned", p) first,
    then p forced to each tile of TILES_LARGE (planned BM >= 64), TILES_SMALL
    (BM <= 32) or TILES_NVFP4, pipeline depth 2..4 from the shared memory a
    step needs (one or two programs per SM); fp8_block at BM >= 64 TILES_FP8 first
    (FC1 in two passes; the rescaled accumulation), at BM 32 its rescaled BM 64. A plan's chunk is BK: a BK 64 plan
    needs weights prepared for it (bf16: the same tensors). Tiles whose BK does
    not divide H and I (or exceeds the plan's chunk), and repeats of an earlier
    (BK, config), are left out; at most 13. small: TILES_SMALL whatever BM was planned
    (a mixed step's few rows per expert past the wide tiles' threshold). Pure: no
    device, no compilation.
    """
    chosen = p.config_for(tokens)
    if chosen.family != "grouped":
        return (("planned", p),)
    if small:
        table = TILES_SMALL
    elif p.spec.weight_format == "nvfp4":
        table = TILES_NVFP4
    elif p.spec.weight_format == "fp8_block" and chosen.block_m >= 64:
        table = TILES_FP8 + TILES_LARGE
    elif p.spec.weight_format == "fp8_block":  # BM 32: also the rescaled BM 64 (rows on M)
        table = tuple(c for c in TILES_FP8 if c[0] == "bm64-rescale") + TILES_SMALL
    else:
        table = TILES_LARGE if chosen.block_m >= 64 else TILES_SMALL
    out, seen = [("planned", p)], {(p.chunk, chosen)}
    for name, bm, bn1, bn2, warps, per_sm, bk, *extra in table:
        if p.caps.hidden % bk or p.intermediate % bk or bk > p.chunk:
            continue
        if p.spec.weight_format == "fp8_block" and (bk, bn1) != (FP8_BLOCK, FP8_BLOCK):
            continue  # a K step is one scale block; FC1 programs hold whole activation groups
        if p.spec.weight_format == "fp8_block" and FP8_BLOCK % bn2:
            continue  # an FC2 tile takes one weight scale a step: its rows lie in one block
        tp = _tile(p, bm, bn1, bn2, warps, per_sm, bk, chosen, *extra)
        if (tp.chunk, tp.buckets[0][1]) not in seen:
            seen.add((tp.chunk, tp.buckets[0][1]))
            out.append((name, tp))
    return tuple(out[:13])


def order_candidates(p: MoEPlan, tokens: int, groups: tuple[int, ...] = (8,)) -> tuple[tuple[str, MoEPlan], ...]:
    """(name, plan) to time at a grouped batch of `tokens`: ("planned", p), then
    the planned tiles in the launch order ("plain"), in each grouped program order of `groups` (TileConfig.group_m),
    with TMA loads, and both (where the weights allow TMA: not the NVFP4
    kernels' prepared tiles). Pure."""
    chosen = p.config_for(tokens)
    if chosen.family != "grouped":
        return (("planned", p),)
    out = [("planned", p), ("plain", p.forced(dataclasses.replace(chosen, group_m=0, tma=False)))]
    out += [(f"group{g}", p.forced(dataclasses.replace(chosen, group_m=g, tma=False)))
            for g in groups]
    if p.spec.weight_format != "nvfp4" or chosen.dequant_experts:
        out.append(("tma", p.forced(dataclasses.replace(chosen, tma=True, group_m=0))))
        out += [(f"tma-group{g}", p.forced(dataclasses.replace(chosen, tma=True, group_m=g)))
                for g in groups]
    return tuple((n, q) for n, q in out if n == "planned" or q.config_for(tokens) != chosen)
