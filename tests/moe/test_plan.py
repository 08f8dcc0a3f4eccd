"""Planner decisions as a table (the heuristic, and the batch-invariant plan's
unsplit reductions), scratch specs, and every spec/caps/plan rejection."""

import pytest
import torch

from sparkinfer.errors import CapacityError, DTypeError, PlanError
from sparkinfer.moe import MoECaps, MoESpec, plan, plan_supports_aux_stream_overlap, scratch_specs
from sparkinfer.moe.plan import MICRO_MAX_TOKENS, NVFP4_DEQUANT_MIN_ROWS

DSV3 = dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048)
DSV3_TP8 = dict(num_experts=256, top_k=8, hidden=7168, intermediate=256)
QWEN3 = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)
MIXTRAL = dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336)

DECISIONS = [
    # id, shape, T, family, block_m, split1, split2
    ("dsv3-T1", DSV3, 1, "micro", 16, 1, 1),  # 256 FC1 programs: no FC1 split
    ("dsv3-T16", DSV3, 16, "micro", 16, 1, 1),
    ("dsv3-T64", DSV3, 64, "grouped", 16, 1, 1),
    ("dsv3-T1024", DSV3, 1024, "grouped", 64, 1, 1),  # mean 32 rows: BM 64 at BN1 128 (plan.py)
    ("dsv3-T4096", DSV3, 4096, "grouped", 128, 1, 1),
    ("dsv3tp8-T1", DSV3_TP8, 1, "micro", 16, 4, 1),
    ("qwen3-T1", QWEN3, 1, "micro", 16, 1, 2),  # 96 FC1 programs >= 66: no FC1 split
    ("qwen3-T256", QWEN3, 256, "grouped", 16, 1, 1),
    ("qwen3-T4096", QWEN3, 4096, "grouped", 128, 1, 1),
    ("mixtral-T1", MIXTRAL, 1, "micro", 16, 1, 3),
    ("mixtral-T8", MIXTRAL, 8, "micro", 16, 1, 1),
    ("mixtral-T64", MIXTRAL, 64, "grouped", 16, 1, 1),
    ("mixtral-T256", MIXTRAL, 256, "grouped", 64, 1, 1),
]


@pytest.mark.parametrize("shape,t,family,bm,s1,s2", [d[1:] for d in DECISIONS],
                         ids=[d[0] for d in DECISIONS])
def test_plan_decisions(shape, t, family, bm, s1, s2):
    p = plan(MoECaps(max_tokens=4096, batch_invariant=False, **shape), MoESpec(weight_format="nvfp4"))
    cfg = p.config_for(t)
    assert (cfg.family, cfg.block_m, cfg.split1, cfg.split2) == (family, bm, s1, s2)
    assert p.chunk == 128
    inv = plan(MoECaps(max_tokens=4096, **shape), MoESpec(weight_format="nvfp4")).config_for(t)
    assert (inv.family, inv.block_m, inv.split1, inv.split2) == (family, bm, 1, 1)  # never split


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("shape", [DSV3_TP8, QWEN3, MIXTRAL], ids=["dsv3tp8", "qwen3", "mixtral"])
def test_batch_invariant_plans_never_split(shape, fmt):
    """Every bucket, decode and prefill sizes: unsplit FC1 and FC2. NVFP4 decodes
    its experts to bf16 copies from 2,048 mean rows an expert as batch-dependent
    plans do (the copies give the kernels' bits: tests/moe/test_fp8_layer.py): a
    small-expert shape (E 8, K 8) at T 2048, not at T 1024."""
    small = dict(num_experts=8, top_k=8, hidden=1024, intermediate=1024)
    for sh in (shape, small):
        p = plan(MoECaps(max_tokens=4096, **sh), MoESpec(weight_format=fmt))
        for t, cfg in p.buckets:
            assert (cfg.split1, cfg.split2) == (1, 1), (sh, t, cfg)
            rows = t * sh["top_k"] / min(sh["num_experts"], t * sh["top_k"])
            want = fmt == "nvfp4" and t > MICRO_MAX_TOKENS and rows >= NVFP4_DEQUANT_MIN_ROWS
            assert (cfg.dequant_experts > 0) == want, (sh, t, cfg)
    inv = plan(MoECaps(max_tokens=4096, **small), MoESpec(weight_format="nvfp4"))
    assert inv.config_for(2048).dequant_experts > 0 and not inv.config_for(1024).dequant_experts
    specs = {s.name: s for s in scratch_specs(plan(MoECaps(max_tokens=64, **shape), MoESpec(weight_format=fmt)))}
    assert specs["fc2_partial"].dtype == torch.bfloat16 and specs["route_out"].dtype == torch.bfloat16


MICRO_FC2 = [  # id, shape, T, format, BN2, FC2 stages (MICRO_FC2_* in plan.py)
    ("dsv3-T1", DSV3, 1, "nvfp4", 128, 4),  # 8 x 56 = 448 programs at BN 128 >= 3 x 132
    ("dsv3tp8-T8", DSV3_TP8, 8, "nvfp4", 128, 4),
    ("qwen3-T1", QWEN3, 1, "nvfp4", 64, 4),  # 8 x 16 = 128 < 396
    ("mixtral-T1", MIXTRAL, 1, "nvfp4", 64, 4),  # 3 splits of 112 chunks: 38 steps
    ("mixtral-T8", MIXTRAL, 8, "nvfp4", 64, 6),  # 112 steps >= 64: 6 stages
    ("dsv3-T1-bf16", DSV3, 1, "bf16", 64, 3),  # bf16 keeps BN 64
]


@pytest.mark.parametrize("shape,t,fmt,bn2,stages2", [d[1:] for d in MICRO_FC2],
                         ids=[d[0] for d in MICRO_FC2])
def test_micro_fc2_tiles(shape, t, fmt, bn2, stages2):
    cfg = plan(MoECaps(max_tokens=16, batch_invariant=False, **shape), MoESpec(weight_format=fmt)).config_for(t)
    assert (cfg.family, cfg.block_n1, cfg.block_n2, cfg.stages2) == ("micro", 64, bn2, stages2)


def test_buckets_cover_every_token_count_in_order():
    p = plan(MoECaps(max_tokens=100, **QWEN3), MoESpec())
    bounds = [b for b, _ in p.buckets]
    assert bounds == sorted(bounds) and bounds[-1] == 100
    assert [p.config_for(t).family for t in (1, 16, 17, 100)] == ["micro"] * 2 + ["grouped"] * 2
    assert plan_supports_aux_stream_overlap(p)


def test_scratch_specs_follow_the_families_planned():
    micro_only = plan(MoECaps(max_tokens=8, batch_invariant=False, **QWEN3), MoESpec())
    specs = {s.name: s for s in scratch_specs(micro_only)}
    assert set(specs) == {"topk_ids", "topk_weights", "fc1_partial", "fc1_act", "fc2_partial"}
    assert specs["fc2_partial"].shape == (2, 8 * 8, 2048) and specs["fc2_partial"].dtype == torch.float32
    both = plan(MoECaps(max_tokens=64, **QWEN3), MoESpec())
    specs = {s.name: s for s in scratch_specs(both)}
    assert specs["route_out"].shape == (64 * 8, 2048)
    assert specs["inter"].dtype == torch.bfloat16 and specs["inter"].shape[1] == 768


def test_small_dims_pick_a_smaller_chunk():
    assert plan(MoECaps(max_tokens=4, num_experts=4, top_k=2, hidden=64, intermediate=32),
                MoESpec()).chunk == 32


REJECT = [
    ("spec-format", lambda: MoESpec(weight_format="fp8"), PlanError, "weight_format"),
    ("spec-activation", lambda: MoESpec(activation="gelu"), PlanError, "activation"),
    ("spec-order", lambda: MoESpec(gate_up_order="mixed"), PlanError, "gate_up_order"),
    ("spec-routing", lambda: MoESpec(routing="hash"), PlanError, "routing"),
    ("spec-groups", lambda: MoESpec(n_group=2, topk_group=3), PlanError, "topk_group"),
    ("caps-zero", lambda: MoECaps(0, 8, 2, 64, 32), PlanError, "max_tokens=0"),
    ("caps-topk", lambda: MoECaps(4, 2, 4, 64, 32), PlanError, "top_k=4"),
    ("caps-rank", lambda: MoECaps(4, 8, 2, 64, 32, tp_rank=2, tp_size=2), PlanError, "tp_rank"),
    ("caps-dtype", lambda: MoECaps(4, 8, 2, 64, 32, out_dtype=torch.float32), DTypeError,
     "out_dtype"),
    ("plan-hidden", lambda: plan(MoECaps(4, 8, 2, 48, 32), MoESpec()), PlanError, "H=48; the hidden size"),
    ("plan-T", lambda: plan(MoECaps(4, 8, 2, 64, 32), MoESpec()).config_for(5), CapacityError,
     "T=5"),
]


@pytest.mark.parametrize("make,err,match", [r[1:] for r in REJECT], ids=[r[0] for r in REJECT])
def test_rejections(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_with_changes_and_forced_configs():
    p = plan(MoECaps(max_tokens=64, **QWEN3), MoESpec(weight_format="nvfp4"))
    assert {c.decode for _, c in p.with_changes(decode="arith").buckets} == {"arith"}
    cfg = p.config_for(64)
    forced = p.forced(cfg)
    assert forced.config_for(1) == cfg and forced.buckets == ((64, cfg),)


@pytest.mark.parametrize("t,bm,bm2", [(256, 32, 0), (384, 64, 0), (512, 64, 0), (1024, 64, 0), (2048, 128, 64),
                                       (4096, 128, 0)],
                         ids=["mean16", "mean24", "mean32", "mean64", "mean128", "mean256"])
def test_fp8_rescale_plans_bm64_and_bm128_from_their_thresholds(monkeypatch, t, bm, bm2):
    """plan.FP8_RESCALE: grouped fp8_block tiles take BM 64 from FP8_RESCALE_BM64_MIN_ROWS
    and BM 128 from FP8_RESCALE_BM128_MIN_ROWS mean rows an expert (Qwen3's dims: T * 8 / 128
    rows, 16 at T 256 .. 256 at T 4096), with FC2 at FP8_GROUPED_FC2_ROWS rows a program below
    FP8_FC2_FULL_MIN_ROWS; without it they stop at FP8_MAX_BLOCK_M and follow the bf16 table
    (BM 32 up to 32 rows)."""
    import importlib

    from sparkinfer.moe.plan import (
        FP8_FC2_FULL_MIN_ROWS,
        FP8_GROUPED_FC2_ROWS,
        FP8_MAX_BLOCK_M,
        FP8_RESCALE_BM64_MIN_ROWS,
        FP8_RESCALE_BM128_MIN_ROWS,
    )

    caps = MoECaps(max_tokens=4096, num_experts=128, top_k=8, hidden=2048, intermediate=768)
    spec = MoESpec(weight_format="fp8_block")
    rows = t * 8 / 128
    assert bm == (128 if rows >= FP8_RESCALE_BM128_MIN_ROWS else 64 if rows >= FP8_RESCALE_BM64_MIN_ROWS else 32)
    assert bm2 == (FP8_GROUPED_FC2_ROWS if bm == 128 and rows < FP8_FC2_FULL_MIN_ROWS else 0)
    cfg = plan(caps, spec).config_for(t)  # on by default
    assert cfg.fp8_rescale and cfg.family == "grouped" and (cfg.block_m, cfg.block_m2) == (bm, bm2)
    monkeypatch.setattr(importlib.import_module("sparkinfer.moe.plan"), "FP8_RESCALE", False)
    cfg = plan(caps, spec).config_for(t)
    assert not cfg.fp8_rescale and cfg.block_m == min(FP8_MAX_BLOCK_M, 32 if rows <= 32 else 64)
