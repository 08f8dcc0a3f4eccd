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


NONFINITE = [
    # id, spec, the bad token's logits (E = 8)
    ("softmax-nan", MoESpec(), [0.5, float("nan"), 1, 2, 0, 0, 0, 0]),
    ("softmax-plus-inf", MoESpec(), [0.5, float("inf"), 1, 2, 0, 0, 0, 0]),
    ("softmax-all-minus-inf", MoESpec(), [float("-inf")] * 8),
    ("softmax-raw-nan", MoESpec(renormalize=False), [float("nan")] * 8),
    ("sigmoid-grouped-nan", MoESpec(routing="sigmoid_grouped", n_group=4, topk_group=2),
     [0.5, float("nan"), 1, 2, 0, 0, 0, 0]),
    ("sigmoid-raw-nan", MoESpec(routing="sigmoid_grouped", renormalize=False), [0.5, 0, 1, 2, float("nan"), 0, 0, 0]),
]


@pytest.mark.parametrize("spec,bad", [c[1:] for c in NONFINITE], ids=[c[0] for c in NONFINITE])
def test_routing_nonfinite_logits(spec, bad):
    """ids stay K distinct experts in [0, E); the bad token's weights are all NaN
    (its output row is NaN, like the reference's); other tokens are untouched."""
    t, e, k = 3, 8, 3
    logits = torch.randn(t, e)
    logits[1] = torch.tensor(bad)
    bias = torch.randn(e) * 0.1 if spec.routing == "sigmoid_grouped" else None
    ids = torch.full((t, k), -7, dtype=torch.int32)
    w = torch.full((t, k), 7.0)
    route(logits, spec, (ids, w), bias=bias)
    rid, rw = route_reference(logits, spec, k, bias=bias)
    assert ((ids >= 0) & (ids < e)).all(), ids
    assert all(len(set(row.tolist())) == k for row in ids), ids
    assert w[1].isnan().all() and rw[1].isnan().all(), (w, rw)
    good = [0, 2]
    assert torch.equal(ids[good], rid[good])
    torch.testing.assert_close(w[good], rw[good], rtol=1e-5, atol=1e-6)
