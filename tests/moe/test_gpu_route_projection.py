"""GPU: the router projection with its routing in one launch (`moe.routing.fused`) against
`linear` + the routing kernel, at the presets' router shapes and the GPU's own split tiles
(several feature blocks, K split: the finishers and the last program's routing), eagerly
and in a CUDA graph replayed: logits, ids and weights the same bits."""

import pytest
import torch

from sparkinfer.linear import linear
from sparkinfer.linear.config import linear_tile
from sparkinfer.moe import MoESpec
from sparkinfer.moe.routing import route
from sparkinfer.moe.routing.fused import FUSED_MAX_ROWS, route_projection, router_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [  # (name, E, H, router dtype, spec, K)
    ("qwen3", 128, 2048, torch.bfloat16, MoESpec(), 8),
    ("mixtral", 8, 4096, torch.bfloat16, MoESpec(), 2),
    ("glm-fp32-router", 128, 4096, torch.float32,
     MoESpec(routing="sigmoid_grouped", n_group=1, topk_group=1, routed_scaling_factor=1.0), 8),
    ("dsv3", 256, 7168, torch.bfloat16,
     MoESpec(routing="sigmoid_grouped", n_group=8, topk_group=4, routed_scaling_factor=2.5), 8),
]


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("name,e,h,dtype,spec,k", SHAPES, ids=[s[0] for s in SHAPES])
def test_gpu_fused_routing_equals_two_launches(name, e, h, dtype, spec, k):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(e + h)
    w = (torch.randn(e, h, device=dev, generator=g) * 2.0 / h ** 0.5).to(dtype)
    bias = torch.randn(e, device=dev, generator=g) * 0.1 if spec.routing == "sigmoid_grouped" else None
    tile = linear_tile(e, h, w.element_size(), torch.cuda.get_device_properties(dev).multi_processor_count)
    assert tile.split > 1, "the router's GPU tile splits K: the finishers' path is the one under test"
    sync, ref_sync = router_sync(w), router_sync(w)
    for t in (1, 2, 8, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1):
        x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.full((t, k), -7, dtype=torch.int32, device=dev)
        tw = torch.full((t, k), float("nan"), device=dev)
        logits = route_projection(x, w, spec, (ids, tw), sync=sync, bias=bias, fused=True)
        ref = linear(x, w, sync=ref_sync)
        rids, rtw = torch.empty_like(ids), torch.empty_like(tw)
        route(ref, spec, (rids, rtw), bias=bias)
        torch.cuda.synchronize()
        assert not sync.any(), f"{name} T={t}: semaphores not zero after the call"
        assert torch.equal(_bits(logits), _bits(ref)), f"{name} T={t}: logits differ"
        assert torch.equal(ids, rids), f"{name} T={t}: ids differ"
        assert torch.equal(_bits(tw), _bits(rtw)), f"{name} T={t}: weights differ"
        # replayed in a graph, with fresh inputs copied in: the same as eager
        logits_g = torch.empty_like(logits)
        route_projection(x, w, spec, (ids, tw), sync=sync, logits=logits_g, bias=bias, fused=True)  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            route_projection(x, w, spec, (ids, tw), sync=sync, logits=logits_g, bias=bias, fused=True)
        for _ in range(3):
            x.copy_(torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16))
            ids.fill_(-7)
            tw.fill_(float("nan"))
            graph.replay()
            ref = linear(x, w, sync=ref_sync)
            route(ref, spec, (rids, rtw), bias=bias)
            torch.cuda.synchronize()
            assert torch.equal(_bits(logits_g), _bits(ref)) and torch.equal(ids, rids)
            assert torch.equal(_bits(tw), _bits(rtw)) and not sync.any()
