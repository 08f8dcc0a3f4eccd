"""GPU: the qkv projection with rope in one launch (`rope.fused`) against `linear` + the
rope kernel, at the presets' qkv shapes and the GPU's own tiles, eagerly and in a CUDA
graph replayed with fresh inputs: q and the caches the same bits."""

import pytest
import torch

from sparkinfer.linear import linear, linear_sync
from sparkinfer.rope import rope_qk_cache, rotary_table
from sparkinfer.rope.fused import FUSED_MAX_ROWS, qkv_rope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [  # (name, Hq, KVH, D, rotary dim, H, head norms, qkv bias)
    ("qwen3", 32, 4, 128, 128, 2048, True, False),
    ("glm", 96, 8, 128, 64, 4096, False, True),
]


def _bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("name,hq,kvh,d,r,h,norm,bias", SHAPES, ids=[s[0] for s in SHAPES])
def test_gpu_fused_rope_equals_two_launches(name, hq, kvh, d, r, h, norm, bias):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(hq + h)
    n = (hq + 2 * kvh) * d
    w = (torch.randn(n, h, device=dev, generator=g) / h ** 0.5).bfloat16()
    b = (torch.randn(n, device=dev, generator=g) * 0.1).bfloat16() if bias else None
    slots_n, length = 4, 64
    table = rotary_table(r, 1e6, length, dev)
    norms = tuple((1 + 0.1 * torch.randn(d, device=dev, generator=g)).bfloat16() for _ in range(2)) if norm else None
    sync, ref_sync = linear_sync(w, tickets=1), linear_sync(w)
    for t in range(1, FUSED_MAX_ROWS + 2):
        x = torch.randn(t, h, device=dev, generator=g).bfloat16()
        pos = torch.randperm(length, device=dev, generator=g)[:t].int()
        slots = torch.randint(0, slots_n, (t,), device=dev, generator=g).int()
        caches = tuple(torch.full((slots_n, length, kvh, d), float("nan"), dtype=torch.bfloat16, device=dev)
                       for _ in range(2))
        ref_caches = tuple(torch.full_like(c, float("nan")) for c in caches)
        q = qkv_rope(x, w, b, pos, slots, table, caches, (hq, kvh, d), sync=sync, norms=norms, fused=True)
        rq = rope_qk_cache(linear(x, w, b, sync=ref_sync), pos, slots, table, ref_caches, (hq, kvh, d), norms=norms)
        torch.cuda.synchronize()
        assert not sync.any(), f"{name} T={t}: semaphores not zero after the call"
        assert torch.equal(_bits(q), _bits(rq)), f"{name} T={t}: q differs"
        for c, rc in zip(caches, ref_caches):
            assert torch.equal(_bits(c), _bits(rc)), f"{name} T={t}: a cache differs"
        q_g = torch.empty_like(q)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            qkv_rope(x, w, b, pos, slots, table, caches, (hq, kvh, d), sync=sync, norms=norms, fused=True, q_out=q_g)
        for _ in range(3):
            x.copy_(torch.randn(t, h, device=dev, generator=g).bfloat16())
            for c in caches + ref_caches:
                c.fill_(float("nan"))
            graph.replay()
            rq = rope_qk_cache(linear(x, w, b, sync=ref_sync), pos, slots, table, ref_caches, (hq, kvh, d),
                               norms=norms)
            torch.cuda.synchronize()
            assert torch.equal(_bits(q_g), _bits(rq)) and not sync.any()
            for c, rc in zip(caches, ref_caches):
                assert torch.equal(_bits(c), _bits(rc))
