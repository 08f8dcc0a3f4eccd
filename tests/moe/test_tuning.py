"""tuning.candidates: the plan's own config first, then valid alternatives
(distinct names, configs the plan does not pick, grids the bench can bind),
as a table over the benchmark shapes and the sweep's token counts."""

import pytest
import torch

from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, plan
from sparkinfer.moe.tuning import TILE_STAGE_CAP, candidates, grouped_config, tile_candidates
from tests.moe._util import meta_weights

SHAPES = {
    "dsv3": dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048),
    "qwen3": dict(num_experts=128, top_k=8, hidden=2048, intermediate=768),
    "mixtral": dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336),
    "dsv3_tp8": dict(num_experts=256, top_k=8, hidden=7168, intermediate=256),
}
FORMATS = ("nvfp4", "bf16", "fp8_block")
CASES = [(s, f, t) for s in SHAPES for f in FORMATS for t in (1, 8, 64, 4096)]


def _bind_meta(p, k, t):
    """bind() of a T-token call to plan p on meta tensors (shapes and checks only)."""
    meta = dict(dtype=torch.bfloat16, device="meta")
    return bind(p, allocate_scratch(p, "meta"), meta_weights(p),
                x=torch.empty(t, p.caps.hidden, **meta), out=torch.empty(t, p.caps.hidden, **meta),
                topk_ids=torch.empty(t, k, dtype=torch.int32, device="meta"),
                topk_weights=torch.empty(t, k, device="meta"))


@pytest.mark.parametrize("shape,fmt,t", CASES, ids=[f"{s}-{f}-T{t}" for s, f, t in CASES])
def test_candidates_start_with_the_plan_and_bind(shape, fmt, t):
    p = plan(MoECaps(max_tokens=4096, **SHAPES[shape]), MoESpec(weight_format=fmt))
    got = candidates(p, t)
    names = [n for n, _ in got]
    assert got[0] == ("planned", p.config_for(t)) and len(set(names)) == len(names) <= 4
    assert all(c != p.config_for(t) for _, c in got[1:]) and len(got) >= 2
    micro = p.config_for(t).family == "micro"
    assert (fmt == "nvfp4" and t <= 64 and not micro) == any(n.startswith("decode-") for n in names)
    assert (micro and p.config_for(t).split1 > 1) == ("micro-fc1-unsplit" in names)
    for _, cfg in got:
        assert cfg.family == "grouped" or t <= 16  # micro serves at most 16 tokens
        assert _bind_meta(p.forced(cfg), SHAPES[shape]["top_k"], t).config == cfg


def test_grouped_config_matches_the_planner_and_sizes_stages_by_shared_memory():
    p = plan(MoECaps(max_tokens=4096, **SHAPES["mixtral"]), MoESpec())  # bf16, gated
    assert grouped_config(p, 16, 64, 64, "ptx") == p.config_for(32)  # mean 8 rows per expert: BM 16
    assert grouped_config(p, 32, 64, 64, "ptx") == p.config_for(64)  # bf16, mean 16: BM 32 (plan.py)
    pn = plan(MoECaps(max_tokens=4096, dequant_scratch_bytes=0, **SHAPES["mixtral"]),
              MoESpec(weight_format="nvfp4"))  # the NVFP4 kernels' tiles (no dequantized path)
    g, c = grouped_config(pn, 128, 128, 256, "ptx"), pn.config_for(4096)  # (bf16 plans wide tiles there)
    assert (g.block_m, g.block_n1, g.block_n2, g.num_warps) == (c.block_m, c.block_n1, c.block_n2, c.num_warps)
    assert (g.block_m2, c.block_m2) == (0, 64)  # NVFP4 BM 128 tiles run FC2 at 64 rows (plan.NVFP4_GROUPED_FC2_ROWS)
    wide = grouped_config(p, 128, 128, 128, "arith")
    # FC1 step: 2 * 128 * 128 * 2 + 128 * 128 * 2 bytes = 96 KiB -> 2 stages in 220 KiB
    assert (wide.num_warps, wide.stages1, wide.stages2) == (8, 2, 3)


TILE_CASES = [(s, f, t) for s in SHAPES for f in FORMATS for t in (8, 1024, 4096)]


@pytest.mark.parametrize("shape,fmt,t", TILE_CASES, ids=[f"{s}-{f}-T{t}" for s, f, t in TILE_CASES])
def test_tile_candidates_start_with_the_plan_fit_shared_memory_and_bind(shape, fmt, t):
    p = plan(MoECaps(max_tokens=4096, **SHAPES[shape]), MoESpec(weight_format=fmt))
    got = tile_candidates(p, t)
    names = [n for n, _ in got]
    assert got[0] == ("planned", p) and len(set(names)) == len(names) <= 13
    if t <= 16:  # micro: nothing to tile
        assert len(got) == 1
        return
    assert len(got) >= (2 if fmt == "fp8_block" else 3)  # fp8: only BK 128 / BN1 128 tiles
    seen = {(p.chunk, p.config_for(t))}
    for name, tp in got[1:]:
        cfg = tp.config_for(t)
        assert (tp.chunk, cfg) not in seen, name
        seen.add((tp.chunk, cfg))
        assert cfg.family == "grouped" and tp.caps == p.caps and tp.spec == p.spec
        assert p.caps.hidden % tp.chunk == 0 and p.caps.intermediate % tp.chunk == 0
        assert tp.chunk == p.chunk or fmt == "bf16"  # NVFP4's chunk fixes the prepared bytes
        nbytes = {"bf16": 2, "nvfp4": 0.5 + 1 / 16, "fp8_block": 1}[fmt]
        act = 1 if fmt == "fp8_block" else 2
        step1 = 2 * cfg.block_n1 * tp.chunk * nbytes + tp.chunk * cfg.block_m * act
        step2 = cfg.block_n2 * tp.chunk * nbytes + tp.chunk * cfg.block_m * act
        budget = (112 if name.endswith("2cta") else 220) * 1024
        assert 2 <= cfg.stages1 <= TILE_STAGE_CAP and cfg.stages1 * step1 <= budget, name
        assert 2 <= cfg.stages2 <= TILE_STAGE_CAP and cfg.stages2 * step2 <= budget, name
        b = _bind_meta(tp, SHAPES[shape]["top_k"], t)
        assert b.config == cfg and b.plan.chunk == tp.chunk


def test_tile_candidates_skip_chunks_the_dims_do_not_allow():
    # H 192: the plan's chunk is 64, so no BK 128 tile; I 96 -> chunk 32: none at all
    p = plan(MoECaps(max_tokens=4096, num_experts=8, top_k=2, hidden=192, intermediate=128),
             MoESpec())
    assert p.chunk == 64
    assert all(tp.chunk == 64 for _, tp in tile_candidates(p, 4096))
    p32 = plan(MoECaps(max_tokens=4096, num_experts=8, top_k=2, hidden=192, intermediate=96),
               MoESpec())
    assert p32.chunk == 32 and tile_candidates(p32, 4096) == (("planned", p32),)
