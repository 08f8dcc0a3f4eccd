"""Every rejection of prepare_weights and bind, and the capture rule for `out`."""

import dataclasses

import pytest
import torch

import sparkinfer.moe.binding as moe_binding
from sparkinfer.errors import CapacityError, CaptureError, DTypeError, LayoutError, PlanError, ShapeError
from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, plan, prepare_weights
from sparkinfer.quant import quantize_nvfp4
from tests.moe._util import random_layer

CAPS = MoECaps(max_tokens=8, num_experts=4, top_k=2, hidden=64, intermediate=32)


@pytest.fixture
def layer():
    return random_layer(CAPS, MoESpec())


def _good(t=3):
    return dict(x=torch.randn(t, 64).bfloat16(), logits=torch.randn(t, 4))


BIND_REJECT = [
    ("x-dtype", lambda a: a.update(x=a["x"].float()), DTypeError, "x dtype"),
    ("x-hidden", lambda a: a.update(x=torch.randn(3, 32).bfloat16()), ShapeError, "H=64"),
    ("x-too-many-tokens", lambda a: a.update(x=torch.randn(9, 64).bfloat16(),
                                            logits=torch.randn(9, 4)), CapacityError, "T=9"),
    ("x-strided", lambda a: a.update(x=torch.randn(64, 3).bfloat16().t()), LayoutError, "strides"),
    ("out-dtype", lambda a: a.update(out=torch.empty(3, 64)), DTypeError, "out dtype"),
    ("out-shape", lambda a: a.update(out=torch.empty(2, 64, dtype=torch.bfloat16)), ShapeError,
     "out shape"),
    ("logits-shape", lambda a: a.update(logits=torch.randn(3, 5)), ShapeError, "logits shape"),
    ("logits-dtype", lambda a: a.update(logits=torch.randn(3, 4).double()), DTypeError,
     "logits dtype"),
    ("logits-and-ids", lambda a: a.update(topk_ids=torch.zeros(3, 2, dtype=torch.int32),
                                          topk_weights=torch.ones(3, 2)),
     ShapeError, "exactly one"),
    ("ids-dtype", lambda a: (a.pop("logits"), a.update(topk_ids=torch.zeros(3, 2),
                                                       topk_weights=torch.ones(3, 2))),
     DTypeError, "topk_ids dtype"),
    ("ids-no-weights", lambda a: (a.pop("logits"), a.update(
        topk_ids=torch.zeros(3, 2, dtype=torch.int32))), ShapeError, "without topk_weights"),
    ("ids-shape", lambda a: (a.pop("logits"), a.update(
        topk_ids=torch.zeros(3, 3, dtype=torch.int32), topk_weights=torch.ones(3, 3))),
     ShapeError, "topk_ids shape"),
    ("bias-shape", lambda a: a.update(bias=torch.zeros(5)), ShapeError, "bias shape"),
]


@pytest.mark.parametrize("edit,err,match", [r[1:] for r in BIND_REJECT],
                         ids=[r[0] for r in BIND_REJECT])
def test_bind_rejects(layer, edit, err, match):
    p, w, _, scratch = layer
    args = _good()
    edit(args)
    with pytest.raises(err, match=match):
        bind(p, scratch, w, **args)


def test_bind_rejects_scratch_and_weights_of_another_plan(layer):
    p, w, src, scratch = layer
    with pytest.raises(ShapeError, match="scratch lacks 'fc1_partial'"):
        bind(p, {k: v for k, v in scratch.items() if k != "fc1_partial"}, w, **_good())
    with pytest.raises(ShapeError, match=r"scratch\['topk_ids'\] shape"):
        bind(p, dict(scratch, topk_ids=torch.zeros(2, 2, dtype=torch.int32)), w, **_good())
    p4 = plan(CAPS, MoESpec(weight_format="nvfp4"))
    with pytest.raises(LayoutError, match="prepare_weights"):
        bind(p4, scratch, w, **_good())


def test_bind_rejects_configs_that_cannot_serve_the_call(layer):
    p, w, _, scratch = layer
    micro = p.config_for(1)
    odd = p.forced(dataclasses.replace(micro, family="resident"))
    with pytest.raises(PlanError,
                       match=r"config family 'resident' for T=3; the kernel families are \('micro', 'grouped'\)"):
        bind(odd, allocate_scratch(odd, "cpu"), w, **_good())
    wide = dataclasses.replace(p, caps=dataclasses.replace(CAPS, max_tokens=32), buckets=((32, micro),))
    with pytest.raises(PlanError, match="the micro family serves T <= block_m=16 tokens, got T=17"):
        bind(wide, allocate_scratch(wide, "cpu"), w, **_good(17))


@pytest.mark.parametrize("bm2, family", [(8, "micro"), (48, "grouped"), (8, "grouped"), (128, "grouped")])
def test_bind_rejects_fc2_rows_that_do_not_divide_the_tile(layer, bm2, family):
    """TileConfig.block_m2: a divisor of a grouped tile's block_m, at least 16 (64 here)."""
    p, w, _, _ = layer
    cfg = dataclasses.replace(p.config_for(1), family="grouped", block_m=64) if family == "grouped" else p.config_for(1)
    bad = p.forced(dataclasses.replace(cfg, block_m2=bm2))
    with pytest.raises(PlanError, match=f"block_m2={bm2}"):
        bind(bad, allocate_scratch(bad, "cpu"), w, **_good())


def test_missing_out_allocates_eagerly_but_raises_during_capture(layer, monkeypatch):
    p, w, _, scratch = layer
    b = bind(p, scratch, w, **_good())
    assert b.out.shape == (3, 64) and b.out.dtype == torch.bfloat16
    monkeypatch.setattr(moe_binding, "_capturing", lambda device: True)
    with pytest.raises(CaptureError, match="preallocated out"):
        bind(p, scratch, w, **_good())


PREPARE_REJECT = [
    ("w1-shape", lambda w1, w2: (w1[:, :32], w2), ShapeError, "w1 shape"),
    ("w2-shape", lambda w1, w2: (w1, w2[:, :32]), ShapeError, "w2 shape"),
    ("w1-dtype", lambda w1, w2: (w1.to(torch.int32), w2), DTypeError, "bf16/fp16/fp32"),
    ("nvfp4-for-bf16", lambda w1, w2: (quantize_nvfp4(w1), w2), DTypeError, "w1"),
]


@pytest.mark.parametrize("edit,err,match", [r[1:] for r in PREPARE_REJECT],
                         ids=[r[0] for r in PREPARE_REJECT])
def test_prepare_weights_rejects(layer, edit, err, match):
    p, _, (w1, w2), _ = layer
    with pytest.raises(err, match=match):
        prepare_weights(p, *edit(w1, w2))


def test_prepare_weights_nvfp4_rejects_dense_and_bad_global_scale():
    p = plan(CAPS, MoESpec(weight_format="nvfp4"))
    w1, w2 = torch.randn(4, 64, 64), torch.randn(4, 64, 32)
    with pytest.raises(DTypeError, match="takes NVFP4Tensor"):
        prepare_weights(p, w1, quantize_nvfp4(w2))
    q1 = quantize_nvfp4(w1)
    bad = type(q1)(q1.packed, q1.scales, q1.global_scale[:2])
    with pytest.raises(ShapeError, match="global_scale shape"):
        prepare_weights(p, bad, quantize_nvfp4(w2))


def test_allocate_scratch_takes_shared_buffers_only_where_they_fit():
    p = plan(CAPS, MoESpec())
    first = allocate_scratch(p, "cpu")
    again = allocate_scratch(p, "cpu", share=first)
    assert all(again[k] is first[k] for k in first)
    bigger = allocate_scratch(plan(dataclasses.replace(CAPS, max_tokens=64), MoESpec()), "cpu", share=first)
    assert bigger["topk_ids"] is not first["topk_ids"] and bigger["topk_ids"].shape == (64, 2)
    assert bigger["tile_expert"] is not first.get("tile_expert")
