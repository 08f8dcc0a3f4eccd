"""Grouped program order (TileConfig.group_m), TMA loads (TileConfig.tma) and FP8
FC1 in two passes (TileConfig.fc1_passes):
the same sums in another order or through descriptors, so the same bits as the
plain grouped config, and within the fp32 reference's bounds; refused where
they do not apply. Triton interpreter; the GPU sweep times them
(benchmarks/sweeps/moe_tile_sweep.py --orders)."""

import dataclasses

import pytest
import torch

from sparkinfer.errors import PlanError
from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, moe_reference, run
from sparkinfer.moe.routing import route_reference
from tests.moe._util import assert_moe_close, poison_scratch, random_layer

T = 40  # 80 routes over 4 experts: 2 + 4 tiles of BM 32 or 64, so group_m 4 leaves a short group


def _outputs(fmt, configs, **caps_kw):
    caps = MoECaps(max_tokens=64, num_experts=4, top_k=2, hidden=256, intermediate=128,
                   batch_invariant=False, **caps_kw)
    spec = MoESpec(weight_format=fmt)
    p, w, src, _ = random_layer(caps, spec)
    x = torch.randn(T, caps.hidden).bfloat16()
    logits = torch.randn(T, caps.num_experts)
    ref = moe_reference(x, src, route_reference(logits, spec, caps.top_k), spec=spec)
    base = dataclasses.replace(p.config_for(T), group_m=0, tma=False)  # the plain order
    assert base.family == "grouped", base
    outs = []
    for change in configs:
        pf = p.forced(dataclasses.replace(base, **change))
        out = torch.full((T, caps.hidden), float("nan"), dtype=torch.bfloat16)
        scratch = allocate_scratch(pf, "cpu")  # the dequantized path's copies: its own
        poison_scratch(scratch)
        run(bind(pf, scratch, w, x=x, out=out, logits=logits))
        outs.append(out)
    return outs, ref


@pytest.mark.parametrize("fmt,caps_kw", [("bf16", {}), ("fp8_block", {}),
                                         ("nvfp4", dict(dequant_scratch_bytes=1 << 30))])
def test_orders_and_tma_give_the_plain_configs_bits(fmt, caps_kw):
    changes = [{}, dict(group_m=3), dict(group_m=4, tma=True)]
    if fmt == "nvfp4":  # the dequantized path (bf16 copies) is the one TMA can read
        changes = [dict(dequant_experts=2), dict(dequant_experts=2, group_m=4),
                   dict(dequant_experts=2, group_m=4, tma=True)]
    else:
        changes.append(dict(tma=True))
    if fmt == "fp8_block":  # FC1 in two passes of 64 rows, at the plan's BM and at 64 and 128
        changes += [dict(fc1_passes=2), dict(fc1_passes=2, block_m=64, num_warps=8),
                    dict(fc1_passes=2, block_m=128, num_warps=8, group_m=4, tma=True)]
    outs, ref = _outputs(fmt, changes, **caps_kw)
    assert torch.isfinite(outs[0].float()).all()
    assert_moe_close(outs[0], ref, fmt)
    for change, out in zip(changes[1:], outs[1:]):
        assert torch.equal(out, outs[0]), change


@pytest.mark.parametrize("change,match", [
    (dict(family="micro", block_m=16, group_m=2, tma=False), "group_m=2, tma=False for the 'micro'"),
    (dict(group_m=-1, tma=False), "group_m >= 0"),
    (dict(tma=True), "tma=True for NVFP4 kernels"),
    (dict(fc1_passes=2), "fc1_passes=2 for a 'grouped' bf16 bucket"),
])
def test_bind_refuses_orders_and_tma_where_they_do_not_apply(change, match):
    caps = MoECaps(max_tokens=64, num_experts=4, top_k=2, hidden=256, intermediate=256)
    fmt = "nvfp4" if change.get("tma") is True else "bf16"
    p, w, _, scratch = random_layer(caps, MoESpec(weight_format=fmt))
    cfg = dataclasses.replace(p.config_for(T), **change)
    pf = p.forced(cfg)
    with pytest.raises(PlanError, match=match):
        bind(pf, allocate_scratch(pf, "cpu"), w, x=torch.randn(8, 256).bfloat16(),
             logits=torch.randn(8, 4))
