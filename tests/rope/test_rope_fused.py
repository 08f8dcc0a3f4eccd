"""The qkv projection with rope in one launch (interpreted) against the two launches it
replaces (`linear`, then `rope_qk_cache`): the same q, k cache and v cache bits, at each
token count around the fusion's limit, with partial rotary, head norms, a bias, decode
context parallelism and a split tile; the semaphores zero again."""

import pytest
import torch

from sparkinfer.linear import linear, linear_sync
from sparkinfer.linear.config import LinearTile
from sparkinfer.rope import rope_qk_cache, rotary_table
from sparkinfer.rope.fused import FUSED_MAX_ROWS, qkv_rope

# (Hq, KVH, D, R, norm, bias, kv_stride, kv_offset)
CASES = [
    (4, 2, 32, 32, True, False, 1, 0),
    (4, 4, 64, 32, False, True, 1, 0),  # partial rotary, qkv bias
    (8, 2, 128, 128, True, False, 2, 1),  # decode-context parallel: odd positions here
]
H = 64


def _setup(t, hq, kvh, d, r, norm, bias, seed, stride=1):
    g = torch.Generator().manual_seed(seed)
    s, length = 3, 16
    x = torch.randn(t, H, generator=g).bfloat16()
    w = (torch.randn((hq + 2 * kvh) * d, H, generator=g) * 0.2).bfloat16()
    b = (torch.randn(w.shape[0], generator=g) * 0.1).bfloat16() if bias else None
    pos = torch.randperm(length * stride, generator=g)[:t].int()
    slots = torch.randint(0, s, (t,), generator=g).int()
    table = rotary_table(r, 10000.0, length * stride, "cpu")
    norms = ((1 + 0.1 * torch.randn(d, generator=g)).bfloat16(),
             (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()) if norm else None
    caches = tuple(torch.full((s, length, kvh, d), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    return x, w, b, pos, slots, table, norms, caches


def _same(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))  # NaN slots included


@pytest.mark.parametrize("hq,kvh,d,r,norm,bias,stride,offset", CASES,
                         ids=[f"hq{c[0]}_kv{c[1]}_d{c[2]}_r{c[3]}_s{c[6]}" for c in CASES])
@pytest.mark.parametrize("t", [1, 3, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1])
def test_fused_qkv_rope_equals_two_launches(t, hq, kvh, d, r, norm, bias, stride, offset):
    x, w, b, pos, slots, table, norms, caches = _setup(t, hq, kvh, d, r, norm, bias, seed=t * 100 + d, stride=stride)
    sync = linear_sync(w, tickets=1)
    kw = dict(norms=norms, kv_stride=stride, kv_offset=offset)
    q = qkv_rope(x, w, b, pos, slots, table, caches, (hq, kvh, d), sync=sync, fused=True, **kw)
    assert not sync.any(), "the semaphores must be zero again for the next call"
    ref_caches = tuple(torch.full_like(c, float("nan")) for c in caches)
    rq = rope_qk_cache(linear(x, w, b, sync=linear_sync(w)), pos, slots, table, ref_caches, (hq, kvh, d), **kw)
    assert _same(q, rq)
    assert _same(caches[0], ref_caches[0]) and _same(caches[1], ref_caches[1])
    if stride == 1:  # every position is this rank's
        assert not caches[0].isnan().all() and not caches[1].isnan().all(), "the keys and values must be written"


@pytest.mark.parametrize("t", [1, 3])
def test_fused_qkv_rope_after_split_blocks(t):
    """The GPU's launch shape: several feature blocks of 64, K split in four slices: the
    last block's finisher runs the rope rows."""
    hq, kvh, d, r = 4, 2, 32, 32
    x, w, b, pos, slots, table, norms, caches = _setup(t, hq, kvh, d, r, True, False, seed=7 + t)
    tile = LinearTile(stream=False, block_n=64, block_k=16, k_slice=16, split=4)
    sync = linear_sync(w, tickets=1)
    q = qkv_rope(x, w, None, pos, slots, table, caches, (hq, kvh, d), sync=sync, norms=norms, fused=True, tile=tile)
    assert not sync.any()
    ref_caches = tuple(torch.full_like(c, float("nan")) for c in caches)
    qkv = linear(x, w, sync=linear_sync(w), tile=tile)
    rq = rope_qk_cache(qkv, pos, slots, table, ref_caches, (hq, kvh, d), norms=norms)
    assert _same(q, rq) and _same(caches[0], ref_caches[0]) and _same(caches[1], ref_caches[1])
