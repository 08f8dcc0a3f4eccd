"""Grouped program order (TileConfig.group_m), TMA loads (TileConfig.tma), FP8
FC1 in two passes (TileConfig.fc1_passes) and persistent programs (TileConfig.persistent):
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


def _outputs(fmt, configs, logits=None, **caps_kw):
    caps = MoECaps(max_tokens=64, num_experts=4, top_k=2, hidden=256, intermediate=128,
                   batch_invariant=False, **caps_kw)
    spec = MoESpec(weight_format=fmt)
    p, w, src, _ = random_layer(caps, spec)
    x = torch.randn(T, caps.hidden).bfloat16()
    logits = torch.randn(T, caps.num_experts) if logits is None else logits
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


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("sms", [1, 3])
def test_persistent_programs_give_the_plain_configs_bits(fmt, sms):
    """One program (or three per SM x 1..3 SMs) walking every active tile's work items: the
    loop's bounds come from the count the sort stores, so a tile left out or run twice
    (a wrong count, a wrong walk) shows as a NaN row (the output is poisoned) or other bits."""
    changes = [{}, dict(persistent=1), dict(persistent=3, group_m=3), dict(persistent=1, group_m=4)]
    if fmt != "nvfp4":
        changes += [dict(persistent=1, tma=True), dict(persistent=2, group_m=4, tma=True)]
    outs, ref = _outputs(fmt, changes, num_sms=sms)
    assert torch.isfinite(outs[0].float()).all()
    assert_moe_close(outs[0], ref, fmt)
    for change, out in zip(changes[1:], outs[1:]):
        assert torch.equal(out, outs[0]), change


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "nvfp4"])
def test_tail_tiles_give_the_plain_configs_bits(fmt):
    """Experts' last tiles at BM / 2 or BM / 4 rows. Every token takes expert 0 and one of
    1, 2, 3 (24, 10 and 6 tokens): at BM 64 the tiles hold 40 (BM), 24 (BM / 2), 10 and 6
    routes (BM / 4 with tail 2); at BM 32, 32 + 8, 24, 10, 6. A row left out is NaN (the
    output is poisoned); one run at a wrong BM reads or writes other rows' bits."""
    logits = torch.zeros(T, 4)
    logits[:, 0] = 10.0
    second = torch.tensor([1] * 24 + [2] * 10 + [3] * 6)
    logits[torch.arange(T), second] = 5.0 + torch.rand(T)
    logits += 0.1 * torch.rand(T, 4)  # distinct weights per token
    changes = [dict(block_m=64, num_warps=8), dict(block_m=64, num_warps=8, tail=1),
               dict(block_m=64, num_warps=8, tail=2), dict(block_m=64, num_warps=8, tail=2, group_m=3),
               dict(block_m=32, tail=1)]
    if fmt == "nvfp4":  # the dequantized path too, in its expert chunks
        changes.append(dict(block_m=64, num_warps=8, tail=2, dequant_experts=2))
    else:
        changes.append(dict(block_m=64, num_warps=8, tail=2, tma=True, group_m=4))
    outs, ref = _outputs(fmt, changes, logits)
    assert torch.isfinite(outs[0].float()).all()
    assert_moe_close(outs[0], ref, fmt)
    for change, out in zip(changes[1:], outs[1:]):
        assert torch.equal(out, outs[0]), change


@pytest.mark.parametrize("change,match", [
    (dict(tail=1, block_m=16, family="grouped"), "tail=1 for a 'grouped' bucket of block_m 16"),
    (dict(family="micro", block_m=16, tma=False, group_m=0, persistent=1),
     "persistent=1 for a 'micro' bucket"),
    (dict(persistent=-1), "persistent >= 0"),
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
