"""The router projection with its routing in one launch (interpreted) against the two
launches it replaces (`linear`, then `route`): the same logits, ids and weights, bit for
bit, at every row count; the semaphores zero again; bad calls refused."""

import pytest
import torch

from sparkinfer.errors import LayoutError
from sparkinfer.linear import linear
from sparkinfer.linear.config import LinearTile
from sparkinfer.moe import MoESpec
from sparkinfer.moe.routing import fused as fused_mod
from sparkinfer.moe.routing import route, route_reference
from sparkinfer.moe.routing.fused import route_projection, router_sync

CASES = [
    ("softmax-renorm-bf16", MoESpec(), 16, 4, torch.bfloat16),
    ("softmax-raw-bf16-E-not-pow2", MoESpec(renormalize=False), 12, 3, torch.bfloat16),
    ("sigmoid-grouped-fp32-router", MoESpec(routing="sigmoid_grouped", n_group=4, topk_group=2,
                                            routed_scaling_factor=2.5), 16, 4, torch.float32),
]
H = 64


def _inputs(t, e, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(e, H, generator=g) * 0.5).to(dtype)
    return x, w


def _poisoned(t, k):
    return torch.full((t, k), -7, dtype=torch.int32), torch.full((t, k), float("nan"))


@pytest.mark.parametrize("spec,e,k,dtype", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("t", [1, 5, fused_mod.FUSED_MAX_ROWS, fused_mod.FUSED_MAX_ROWS + 1])
def test_fused_routing_equals_projection_then_routing(spec, e, k, dtype, t):
    x, w = _inputs(t, e, dtype, seed=t)
    bias = torch.randn(e) * 0.1 if spec.routing == "sigmoid_grouped" else None
    sync = router_sync(w)
    ids, tw = _poisoned(t, k)
    logits = torch.full((t, e), float("nan"), dtype=w.dtype)
    route_projection(x, w, spec, (ids, tw), sync=sync, logits=logits, bias=bias, fused=True)
    assert not sync.any(), "the semaphores must be zero again for the next call"

    ref_logits = linear(x, w, sync=router_sync(w))
    rids, rtw = _poisoned(t, k)
    route(ref_logits, spec, (rids, rtw), bias=bias)
    assert torch.equal(logits.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       ref_logits.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(ids, rids)
    assert torch.equal(tw.view(torch.int32), rtw.view(torch.int32))
    # and the routing is the routing: against the fp32 reference on the same logits, on the
    # rows without tied logits (bf16 ties have no defined top-k)
    pids, ptw = route_reference(logits.float(), spec, k, bias=bias)
    untied = (logits.float().sort(dim=-1).values.diff(dim=-1) != 0).all(dim=-1)
    assert untied.any()
    assert torch.equal(ids[untied], pids[untied])
    torch.testing.assert_close(tw[untied], ptw[untied], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [1, 7])
def test_fused_routing_after_split_blocks(t):
    """The GPU's launch shape: two feature blocks of 64 experts, K split in four slices, so
    each block's finisher adds partials and the last finisher routes."""
    spec, e, k = MoESpec(), 128, 8
    tile = LinearTile(stream=False, block_n=64, block_k=16, k_slice=16, split=4)
    x, w = _inputs(t, e, torch.bfloat16, seed=10 + t)
    sync = router_sync(w)
    ids, tw = _poisoned(t, k)
    logits = route_projection(x, w, spec, (ids, tw), sync=sync, fused=True, tile=tile)
    assert not sync.any()
    ref_logits = linear(x, w, sync=router_sync(w), tile=tile)
    rids, rtw = _poisoned(t, k)
    route(ref_logits, spec, (rids, rtw))
    assert torch.equal(logits.view(torch.int16), ref_logits.view(torch.int16))
    assert torch.equal(ids, rids) and torch.equal(tw.view(torch.int32), rtw.view(torch.int32))
    torch.testing.assert_close(ref_logits.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)


def test_fused_call_repeats_bitwise():
    spec, e, k = MoESpec(), 16, 4
    x, w = _inputs(3, e, torch.bfloat16, seed=0)
    sync = router_sync(w)
    outs = []
    for _ in range(2):
        ids, tw = _poisoned(3, k)
        route_projection(x, w, spec, (ids, tw), sync=sync, fused=True)
        outs.append((ids, tw))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_route_projection_refuses_a_short_sync():
    spec, e, k = MoESpec(), 16, 4
    x, w = _inputs(2, e, torch.bfloat16, seed=0)
    ids, tw = _poisoned(2, k)
    with pytest.raises(LayoutError, match="router_sync"):
        route_projection(x, w, spec, (ids, tw), sync=torch.zeros(1, dtype=torch.int32))
