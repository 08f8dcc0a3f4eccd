"""Launch configurations around a plan's choice, to measure the planner's
thresholds and tiles on a GPU (`benchmarks/bench_moe.py --sweep`).

Legend: T tokens, BM routed rows per tile, BN1 / BN2 weight rows per FC1 / FC2
program, S1 / S2 reduction splits of the micro family.

Every candidate is served by the same kernels as the plan (constexpr variants),
so timing one is `plan.forced(config)`. Pure: no device, no compilation.
"""

from __future__ import annotations

import dataclasses

from sparkinfer.moe.plan import (MAX_SPLIT, SMEM_ONE_PER_SM, SMEM_TWO_PER_SM, LaunchConfig,
                                 MoEPlan, _stages, _weight_bytes)

__all__ = ["candidates", "grouped_config"]


def grouped_config(p: MoEPlan, bm: int, bn1: int, bn2: int, decode: str) -> LaunchConfig:
    """A `grouped` config with tiles (BM, BN1, BN2): 4 warps and two programs
    per SM up to BM 32, else 8 warps and one; pipeline depth (2..3 at two per
    SM, 2..4 at one) from the shared memory a step needs. Pure."""
    nvfp4 = p.spec.weight_format == "nvfp4"
    halves = 2 if p.spec.gated else 1
    big = bm > 32
    budget, warps, cap = (SMEM_ONE_PER_SM, 8, 4) if big else (SMEM_TWO_PER_SM, 4, 3)
    fc1 = halves * _weight_bytes(bn1, p.chunk, nvfp4) + p.chunk * bm * 2
    fc2 = _weight_bytes(bn2, p.chunk, nvfp4) + p.chunk * bm * 2
    return LaunchConfig("grouped", bm, bn1, bn2, num_warps=warps,
                        stages1=min(cap, _stages(fc1, budget)),
                        stages2=min(cap, _stages(fc2, budget)), decode=decode)


def candidates(p: MoEPlan, tokens: int) -> tuple[tuple[str, LaunchConfig], ...]:
    """(name, config) to time at `tokens`, the plan's own choice first ("planned").

    micro buckets (T <= 16): twice the reduction splits (more programs in
    flight at tiny T), and grouped BM 16 from T 4 (where micro stops paying).
    grouped: the neighbouring BM; at BM >= 64 also BM 64 and, for bf16, wider
    FC1 tiles (BN1 128: m64 wgmma per warpgroup on gate and up), for nvfp4 a
    deeper pipeline (up to 4 stages). nvfp4, T <= 64: the other decode.
    At most four per T, so a sweep of 4 shapes x 2 formats x 4 T compiles in
    about three minutes. Pure.
    """
    chosen = p.config_for(tokens)
    out = [("planned", chosen)]
    nvfp4 = p.spec.weight_format == "nvfp4"
    if nvfp4 and tokens <= 64:
        other = "ptx" if chosen.decode == "arith" else "arith"
        out.append((f"decode-{other}", dataclasses.replace(chosen, decode=other)))
    if chosen.family == "micro":
        s1, s2 = min(2 * chosen.split1, MAX_SPLIT), min(2 * chosen.split2, MAX_SPLIT)
        if (s1, s2) != (chosen.split1, chosen.split2):
            out.append((f"micro-s{s1}x{s2}", dataclasses.replace(chosen, split1=s1,
                                                                split2=s2, stages2=2)))
        if tokens >= 4:
            out.append(("grouped-bm16", grouped_config(p, 16, 64, 64, chosen.decode)))
        return tuple(out)
    if chosen.block_m <= 32:
        bm = 32 if chosen.block_m == 16 else 16
        out.append((f"grouped-bm{bm}", grouped_config(p, bm, 64, 64, chosen.decode)))
    elif nvfp4:  # BN1 128 spills at 255 registers with the decode; try a deeper pipeline
        out.append((f"grouped-bm{chosen.block_m}-deep",
                    grouped_config(p, chosen.block_m, 64, 128, chosen.decode)))
        if chosen.block_m != 64:
            out.append(("grouped-bm64", grouped_config(p, 64, 64, 128, chosen.decode)))
    else:
        out.append(("grouped-bn128", grouped_config(p, chosen.block_m, 128, 128, chosen.decode)))
        if chosen.block_m != 64:
            out.append(("grouped-bm64", grouped_config(p, 64, 64, 128, chosen.decode)))
    return tuple(out[:4])
