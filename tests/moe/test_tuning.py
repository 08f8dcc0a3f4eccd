"""tuning.candidates: the plan's own config first, then valid alternatives
(distinct names, configs the plan does not pick, grids the bench can bind),
as a table over the benchmark shapes and the sweep's token counts."""

import pytest
import torch

from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, plan
from sparkinfer.moe.tuning import candidates, grouped_config

from tests.moe._util import meta_weights

SHAPES = {
    "dsv3": dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048),
    "qwen3": dict(num_experts=128, top_k=8, hidden=2048, intermediate=768),
    "mixtral": dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336),
    "dsv3_tp8": dict(num_experts=256, top_k=8, hidden=7168, intermediate=256),
}
CASES = [(s, f, t) for s in SHAPES for f in ("nvfp4", "bf16") for t in (1, 8, 64, 4096)]


@pytest.mark.parametrize("shape,fmt,t", CASES, ids=[f"{s}-{f}-T{t}" for s, f, t in CASES])
def test_candidates_start_with_the_plan_and_bind(shape, fmt, t):
    p = plan(MoECaps(max_tokens=4096, **SHAPES[shape]), MoESpec(weight_format=fmt))
    got = candidates(p, t)
    names = [n for n, _ in got]
    assert got[0] == ("planned", p.config_for(t)) and len(set(names)) == len(names) <= 4
    assert all(c != p.config_for(t) for _, c in got[1:]) and len(got) >= 2
    assert (fmt == "nvfp4" and t <= 64) == any(n.startswith("decode-") for n in names)
    for _, cfg in got:
        assert cfg.family == "grouped" or t <= 16  # micro serves at most 16 tokens
        pf = p.forced(cfg)
        meta = dict(dtype=torch.bfloat16, device="meta")
        k = SHAPES[shape]["top_k"]
        b = bind(pf, allocate_scratch(pf, "meta"), meta_weights(pf),
                 x=torch.empty(t, p.caps.hidden, **meta), out=torch.empty(t, p.caps.hidden, **meta),
                 topk_ids=torch.empty(t, k, dtype=torch.int32, device="meta"),
                 topk_weights=torch.empty(t, k, device="meta"))
        assert b.config == cfg


def test_grouped_config_matches_the_planner_and_sizes_stages_by_shared_memory():
    p = plan(MoECaps(max_tokens=4096, **SHAPES["mixtral"]), MoESpec())  # bf16, gated
    assert grouped_config(p, 16, 64, 64, "arith") == p.config_for(64)  # BM 16
    assert grouped_config(p, 128, 64, 128, "arith") == p.config_for(4096)
    wide = grouped_config(p, 128, 128, 128, "arith")
    # FC1 step: 2 * 128 * 128 * 2 + 128 * 128 * 2 bytes = 96 KiB -> 2 stages in 220 KiB
    assert (wide.num_warps, wide.stages1, wide.stages2) == (8, 2, 3)
