"""Batch invariance of decode_attention through the Triton interpreter: a probe
row's out and lse are the same bits alone and beside random rows (random slots,
contexts and queries), for decode and verify queries, and at any forced program
count; the heuristic's even split over the programs (batch_invariant=False)
moves them, so the comparison can fail.

What B changes in a launch is the grid: B * KVH programs, and NS programs per
row while that is under the SM count. Here the planner sees 8 SMs
(launch._num_sms patched) and splits hold 64 keys (config.SPLIT_KEYS), so that
B = 1, 2, 4, 8 give rows of a 192-position cache 1 to 3 splits walked by 3, 2 or
1 programs each: the grids B = 1 to 64 give on the H200's 132 SMs, at the
interpreter's cost of B <= 8 (about 0.1 s a program; B = 64 alone took 8 s).
"""

import pytest
import torch

from sparkinfer.attention import config as attn_config
from sparkinfer.attention import decode_attention, plan_call
from sparkinfer.attention import launch as attn_launch

BUCKETS = (1, 2, 4, 8)
HQ, KVH, D, L = 2, 1, 16, 192
SLOTS = 4 * max(BUCKETS)


@pytest.fixture(autouse=True)
def _small_grid(monkeypatch):
    monkeypatch.setattr(attn_config, "SPLIT_KEYS", 64)
    monkeypatch.setattr(attn_launch, "_num_sms", lambda device: 8)


def _cache(seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SLOTS, L, KVH, D, generator=g).bfloat16()
    return k, torch.randn(SLOTS, L, KVH, D, generator=g).bfloat16()


def _step(probe_q, probe_slot, probe_pos, b: int, seed: int, caches, **kw):
    """The probe row at a random index among b - 1 random rows: (its out, its lse)."""
    g = torch.Generator().manual_seed(seed)
    q_len = probe_q.shape[0]
    q = torch.randn(b, q_len, HQ, D, generator=g).bfloat16()
    others = [s for s in torch.randperm(SLOTS, generator=g).tolist() if s != probe_slot][: b - 1]
    i = int(torch.randint(0, b, (1,), generator=g))
    slots = others[:i] + [probe_slot] + others[i:]
    q_pos = torch.randint(0, L - q_len + 1, (b,), generator=g)
    q_pos[i] = probe_pos
    q[i] = probe_q
    out = torch.full((b, q_len, HQ, D), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((b, q_len, HQ), float("nan"))
    decode_attention(q, *caches, torch.tensor(slots, dtype=torch.int32), q_pos.int(), sm_scale=D ** -0.5,
                     out=out, lse=lse, **kw)
    return out[i], lse[i]


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("q_len,probe_pos,buckets", [(1, 180, BUCKETS), (3, 141, (1, 8))],
                         ids=["decode", "verify-q3"])
def test_probe_row_is_the_same_bits_at_every_bucket(q_len, probe_pos, buckets):
    caches = _cache(q_len)
    probe_q = torch.randn(q_len, HQ, D, generator=torch.Generator().manual_seed(7)).bfloat16()
    alone = _step(probe_q, 5, probe_pos, 1, 0, caches)
    grids = set()
    for b in buckets:
        got = _step(probe_q, 5, probe_pos, b, 100 + b, caches)
        grids.add(plan_call(torch.empty(b, q_len, HQ, D), caches[0]).num_splits)
        for name, a, w in zip(("out", "lse"), got, alone):
            assert torch.equal(_bits(a), _bits(w)), f"B = {b}: the probe's {name} differs from B = 1"
    assert len(grids) > 1  # the programs per row did change with B (decode: 3, 2, 1)


def test_forced_program_counts_give_the_same_bits():
    caches = _cache(3)
    probe_q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(8)).bfloat16()
    runs = [_step(probe_q, 2, 191, 2, 9, caches, num_splits=n) for n in (1, 2, 3)]
    for n, (out, lse) in zip((2, 3), runs[1:]):
        assert torch.equal(_bits(out), _bits(runs[0][0])) and torch.equal(_bits(lse), _bits(runs[0][1])), n


def test_the_heuristic_split_moves_the_bits():
    """batch_invariant=False: one program per row against three rounds a 192-key
    row differently: the checks above have teeth."""
    caches = _cache(4)
    probe_q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(9)).bfloat16()
    one, three = (_step(probe_q, 1, 191, 2, 11, caches, num_splits=n, batch_invariant=False) for n in (1, 3))
    assert not (torch.equal(_bits(one[0]), _bits(three[0])) and torch.equal(_bits(one[1]), _bits(three[1])))
