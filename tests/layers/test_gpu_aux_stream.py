"""Shared experts on an auxiliary stream on a GPU: a GLM-4.5-Air-sized MoE block (128 experts,
top-8, H 4096, I 1408, one shared expert) captured in a CUDA graph with the overlap on,
replayed 1,000 times while a second stream keeps the GPU busy with large matmuls; a
watchdog (the rank's timeout) turns a hang into a failure; every replay must give the
same bits as the first, and those bits must equal the overlap-off graph's."""

import pytest
import torch

from sparkinfer.runtime import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _replays(world, n):
    import torch.nn.functional as F

    from sparkinfer.layers.aux_stream import CudaStreamOps, moe_with_shared_experts
    from sparkinfer.moe import MoECaps, MoELayer, MoESpec, plan_supports_aux_stream_overlap

    dev = world.device
    g = torch.Generator(device=dev).manual_seed(0)
    e, k, h, i, t = 128, 8, 4096, 1408, 8
    w1 = torch.randn(e, 2 * i, h, device=dev, generator=g).bfloat16() / h ** 0.5
    w2 = torch.randn(e, h, i, device=dev, generator=g).bfloat16() / i ** 0.5
    gu = torch.randn(2 * i, h, device=dev, generator=g).bfloat16() / h ** 0.5
    down = torch.randn(h, i, device=dev, generator=g).bfloat16() / i ** 0.5
    router = torch.randn(e, h, device=dev, generator=g) / h ** 0.5
    bias = torch.randn(e, device=dev, generator=g) * 0.01
    layer = MoELayer(MoECaps(max_tokens=t, num_experts=e, top_k=k, hidden=h, intermediate=i),
                     MoESpec(routing="sigmoid_grouped", routed_scaling_factor=2.5), (w1, w2), device=dev, bias=bias)
    x = torch.randn(t, h, device=dev, generator=g).bfloat16()
    out = torch.empty(t, h, device=dev, dtype=torch.bfloat16)
    aux, ops = torch.cuda.Stream(dev), CudaStreamOps(dev)
    safe = plan_supports_aux_stream_overlap(layer.plan)

    def block(enabled):
        def shared(z):
            a, b = F.linear(z, gu).chunk(2, dim=-1)
            return F.linear(F.silu(a) * b, down)
        return moe_with_shared_experts(x, router=lambda z: F.linear(z.float(), router),
                                       routed=lambda z, lg: layer(z, lg, out=out), shared=shared,
                                       overlap_safe=safe, streams=ops, aux=aux, enabled=enabled)

    graphs = {}
    for enabled in (True, False):
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            block(enabled)
            graphs[enabled] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[enabled], stream=s):
                res = block(enabled)
        graphs[enabled] = (graphs[enabled], res)
        torch.cuda.current_stream(dev).wait_stream(s)
    g_off, r_off = graphs[False]
    g_off.replay()
    expect = r_off.clone()
    g_on, r_on = graphs[True]
    busy = torch.cuda.Stream(dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    same = 0
    for j in range(n):
        if j % 10 == 0:
            with torch.cuda.stream(busy):
                for _ in range(4):
                    a = (a @ a).clamp_(-1, 1)  # large matmuls competing for the SMs
        g_on.replay()
        same += bool(torch.equal(r_on, expect))
    torch.cuda.synchronize(dev)
    return same, bool(torch.isfinite(expect).all())


def test_overlap_replays_beside_busy_stream_never_hang_and_repeat_bitwise():
    n = 1000
    same, finite = run_ranks(_replays, 1, backend="cuda", args=(n,), timeout_s=300)[0]
    assert finite and same == n
