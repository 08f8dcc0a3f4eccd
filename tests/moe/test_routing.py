"""Routing kernels (interpreted) against the torch reference, and their rejections."""

import pytest
import torch

from sparkinfer.errors import DTypeError, PlanError, ShapeError
from sparkinfer.moe import MoESpec
from sparkinfer.moe.routing import route, route_reference

CASES = [
    ("softmax-renorm", MoESpec(), 8, 2, torch.float32),
    ("softmax-raw-bf16", MoESpec(renormalize=False), 6, 3, torch.bfloat16),
    ("softmax-E-not-pow2", MoESpec(), 10, 4, torch.float32),
    ("sigmoid-grouped", MoESpec(routing="sigmoid_grouped", n_group=4, topk_group=2,
                                routed_scaling_factor=2.5), 16, 4, torch.float32),
    ("sigmoid-one-group", MoESpec(routing="sigmoid_grouped"), 8, 2, torch.float32),
    ("sigmoid-groups-of-one", MoESpec(routing="sigmoid_grouped", n_group=8, topk_group=4),
     8, 2, torch.float32),
]


@pytest.mark.parametrize("spec,e,k,dtype", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_routing_matches_reference(spec, e, k, dtype):
    t = 5
    logits = torch.randn(t, e).to(dtype)
    while (logits.sort(dim=-1).values.diff(dim=-1) == 0).any():  # bf16 ties: no defined top-k
        logits = torch.randn(t, e).to(dtype)
    bias = torch.randn(e) * 0.1 if spec.routing == "sigmoid_grouped" else None
    ids = torch.full((t, k), -7, dtype=torch.int32)
    w = torch.full((t, k), float("nan"))
    route(logits, spec, (ids, w), bias=bias)
    rid, rw = route_reference(logits, spec, k, bias=bias)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


REJECT = [
    ("logits-1d", dict(logits=torch.randn(8)), ShapeError, "logits shape"),
    ("logits-int", dict(logits=torch.zeros(2, 8, dtype=torch.int32)), DTypeError, "logits dtype"),
    ("ids-dtype", dict(ids=torch.zeros(2, 2)), DTypeError, "int32 ids"),
    ("out-shape", dict(w=torch.zeros(3, 2)), ShapeError, "outputs"),
    ("groups", dict(spec=MoESpec(routing="sigmoid_grouped", n_group=3, topk_group=1)), PlanError,
     "n_group=3"),
    ("bias", dict(spec=MoESpec(routing="sigmoid_grouped"), bias=torch.zeros(4)), ShapeError,
     "bias"),
]


@pytest.mark.parametrize("over,err,match", [r[1:] for r in REJECT], ids=[r[0] for r in REJECT])
def test_route_rejects(over, err, match):
    a = dict(logits=torch.randn(2, 8), spec=MoESpec(), ids=torch.zeros(2, 2, dtype=torch.int32),
             w=torch.zeros(2, 2), bias=None)
    a.update(over)
    with pytest.raises(err, match=match):
        route(a["logits"], a["spec"], (a["ids"], a["w"]), bias=a["bias"])
