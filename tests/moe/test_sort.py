"""The grouped family's counting sort (kernels/sort.py through runner._sort):
sorted_route and tile_expert exactly as a stable sort by expert makes them, with
one and several one-hot tiles per program, one and several blocks of counts for a
scatter program to sum, ids outside [0, E) dropped, and the padding rows and tiles
-1 whatever the scratch held before."""

import types

import pytest
import torch
import triton

import sparkinfer.moe.binding as binding
from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, plan
from sparkinfer.moe.runner import _sort


def _reference(ids: torch.Tensor, e: int, bm: int, tiles: int):
    flat = ids.flatten().long()
    rows = torch.full((tiles * bm,), -1, dtype=torch.int32)
    tile_e = torch.full((tiles,), -1, dtype=torch.int32)
    start = 0
    for x in range(e):
        routes = (flat == x).nonzero().flatten()  # increasing: the sort is stable
        rows[start:start + len(routes)] = routes.int()
        n = triton.cdiv(len(routes), bm)
        tile_e[start // bm:start // bm + n] = x
        start += n * bm
    return rows, tile_e


# (256, 256, 8, 128): 64 chunks, two blocks of counts (CB 32) for each scatter program to sum;
# (256, 64, 8, 4): 4 programs take tile_expert's 288 tiles in three turns of 32 each
@pytest.mark.parametrize("e,t,k,programs", [(256, 64, 8, 128), (256, 64, 8, 4), (8, 600, 2, 1),
                                            (4, 9, 2, 128), (256, 256, 8, 128)])
def test_sort_matches_a_stable_sort_by_expert(monkeypatch, e, t, k, programs):
    monkeypatch.setattr(binding, "SORT_PROGRAMS", programs)  # 4 and 1: several tiles a program
    caps = MoECaps(max_tokens=max(t, 32), num_experts=e, top_k=k, hidden=64, intermediate=64)
    p = plan(caps, MoESpec())
    bm = p.config_for(max(t, 17)).block_m  # the scratch holds that bucket's tiles
    ids = torch.rand(t, e).topk(k).indices.int()
    ids[0, 0] = e  # out of range: dropped
    tiles = binding.max_tiles(t * k, e, bm)
    scratch = allocate_scratch(p, "cpu")
    for v in scratch.values():
        v.fill_(7)  # stale rows and experts: every one must be overwritten
    b = types.SimpleNamespace(plan=p, scratch=scratch, topk_ids=ids)
    _sort(b, t * k, bm, tiles)
    rows, tile_e = _reference(ids, e, bm, tiles)
    assert binding.sort_split(t * k, e)[0] > 1 or programs == 128
    assert torch.equal(scratch["sorted_route"][:tiles * bm], rows)
    assert torch.equal(scratch["tile_expert"][:tiles], tile_e)
