"""bf16 "wide" grouped tiles (BN1 128, BN2 256, BK 64 where the plan's chunk is
128): planned above 16 mean routed rows per expert, served by the same kernels
through the Triton interpreter against the fp32 reference; a block_k that the
weights cannot take is rejected at bind."""

import dataclasses

import pytest
import torch

from sparkinfer.errors import PlanError
from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, moe_reference, plan, run
from sparkinfer.moe.routing import route_reference
from tests.moe._util import assert_moe_close, random_layer

DSV3 = dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048)
MIXTRAL = dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336)
QWEN3 = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)


@pytest.mark.parametrize("shape,t,bm,wide", [
    (DSV3, 1024, 64, True),      # mean 32 rows per expert
    (DSV3, 4096, 128, True),     # mean 128
    (QWEN3, 256, 32, False),     # mean 16: small tiles stay (BM 32 from 8 rows, plan.py)
    (QWEN3, 128, 16, False),     # mean 8: BM 16
    (MIXTRAL, 256, 64, True),    # mean 64
    (MIXTRAL, 4096, 128, True),
])
def test_bf16_plans_wide_tiles_above_16_rows_per_expert(shape, t, bm, wide):
    p = plan(MoECaps(max_tokens=4096, **shape), MoESpec())
    cfg = p.config_for(t)
    assert p.chunk == 128 and cfg.family == "grouped" and cfg.block_m == bm
    assert (cfg.block_n1, cfg.block_n2, cfg.block_k) == ((128, 256, 64) if wide else (64, 64, 0))
    nv = plan(MoECaps(max_tokens=4096, batch_invariant=False, **shape), MoESpec(weight_format="nvfp4")).config_for(t)
    if nv.dequant_experts:  # >= 2,048 rows per expert: bf16 tiles on decoded copies (plan.py)
        assert dataclasses.replace(nv, dequant_experts=0) == cfg
    else:  # the NVFP4 kernels keep the chunk (its prepared layout); BN1 128 from BM 64
        assert nv.block_k == 0 and nv.block_n1 == (128 if nv.block_m >= 64 else 64)


def _layer(t=40):
    caps = MoECaps(max_tokens=64, num_experts=4, top_k=2, hidden=256, intermediate=128)
    spec = MoESpec()
    p, w, src, scratch = random_layer(caps, spec)
    x = torch.randn(t, caps.hidden).bfloat16()
    logits = torch.randn(t, caps.num_experts)
    return caps, spec, p, w, src, scratch, x, logits


def test_wide_tiles_match_the_reference_and_the_chunk_sized_steps():
    caps, spec, p, w, src, scratch, x, logits = _layer()
    cfg = p.config_for(x.shape[0])
    assert (cfg.block_m, cfg.block_n1, cfg.block_n2, cfg.block_k) == (64, 128, 256, 64) and p.chunk == 128
    ref = moe_reference(x, src, route_reference(logits, spec, caps.top_k), spec=spec)
    outs = {}
    for bk in (64, 0):  # 0: steps of the plan's chunk (128)
        out = torch.full((x.shape[0], caps.hidden), float("nan"), dtype=torch.bfloat16)
        pf = p.forced(dataclasses.replace(cfg, block_k=bk))
        b = bind(pf, allocate_scratch(pf, "cpu"), w, x=x, out=out, logits=logits)
        run(b)
        assert torch.isfinite(out.float()).all()
        assert_moe_close(out, ref)
        outs[bk] = out
    assert_moe_close(outs[64], outs[0].float())  # two tilings: within the same bounds


@pytest.mark.parametrize("bk", [48, 96])
def test_block_k_the_weights_cannot_take_is_rejected(bk):
    caps, spec, p, w, src, scratch, x, logits = _layer()
    cfg = dataclasses.replace(p.config_for(x.shape[0]), block_k=bk)
    pf = p.forced(cfg)
    with pytest.raises(PlanError, match=f"block_k={bk}"):
        bind(pf, allocate_scratch(pf, "cpu"), w, x=x, logits=logits)
