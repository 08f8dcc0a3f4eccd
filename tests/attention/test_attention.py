"""decode_attention against the fp32 reference through the Triton interpreter:
decode, verify and prefill tiles, GQA groups 1 to 12, D 64 / 128, slots out of
order, strided q and caches, forced and heuristic KV splits (batch-invariant
splits by the row's context, and the heuristic's even split over the programs),
and decode-context parallel shards merged by log-sum-exp. Fresh random inputs,
NaN-poisoned outputs, never-attended cache positions NaN."""

import pytest
import torch

from sparkinfer.attention import decode_attention, plan_call
from sparkinfer.comm.dcp.reference import merge_partials
from tests.attention._util import Case, assert_matches, make_inputs, poisoned, reference

# q_pos: rows mid-cache, at position 0 (one key), and past the cache end (all L keys)
CASES = {
    "decode-g1-d64": Case(B=3, Q=1, Hq=2, KVH=2, D=64, S=4, L=80, slots=(2, 0, 3), q_pos=(37, 0, 95)),
    "decode-g2-d128": Case(B=2, Q=1, Hq=4, KVH=2, D=128, S=3, L=70, slots=(1, 2), q_pos=(69, 12)),
    "decode-g4-d64": Case(B=3, Q=1, Hq=8, KVH=2, D=64, S=5, L=130, slots=(4, 1, 0), q_pos=(129, 64, 3)),
    "decode-g8-d128": Case(B=2, Q=1, Hq=8, KVH=1, D=128, S=2, L=96, slots=(1, 0), q_pos=(50, 200)),
    "decode-g12-d64": Case(B=2, Q=1, Hq=24, KVH=2, D=64, S=3, L=72, slots=(2, 0), q_pos=(71, 8)),
    "verify-q4-g4-d128": Case(B=2, Q=4, Hq=4, KVH=1, D=128, S=3, L=72, slots=(2, 1), q_pos=(60, 0)),
    "verify-q3-g12-d64": Case(B=2, Q=3, Hq=12, KVH=1, D=64, S=2, L=64, slots=(1, 0), q_pos=(40, 61)),
    "prefill-q70-g2-d64": Case(B=1, Q=70, Hq=4, KVH=2, D=64, S=2, L=80, slots=(1,), q_pos=(5,)),
    "prefill-q20-g8-d64": Case(B=2, Q=20, Hq=8, KVH=1, D=64, S=3, L=40, slots=(2, 0), q_pos=(0, 17)),
    "split3-decode-g4-d128": Case(B=2, Q=1, Hq=4, KVH=1, D=128, S=3, L=200, slots=(2, 0),
                                  q_pos=(199, 40), num_splits=3, batch_invariant=False),
    "split4-verify-q4-g8-d64": Case(B=1, Q=4, Hq=8, KVH=1, D=64, S=2, L=150, slots=(1,), q_pos=(140,),
                                    num_splits=4, batch_invariant=False),
    "split2-prefill-q20-g8-d64": Case(B=1, Q=20, Hq=8, KVH=1, D=64, S=1, L=90, slots=(0,), q_pos=(60,),
                                      num_splits=2, batch_invariant=False),
    # batch-invariant splits of 256 keys: rows of 3, 2 and 1 splits, the first two
    # programs walking two splits each, a row of 0 keys past the others
    "inv-split2-decode-g4-d64": Case(B=3, Q=1, Hq=4, KVH=1, D=64, S=4, L=600, slots=(3, 0, 1),
                                     q_pos=(599, 300, 100), num_splits=2),
    "inv-verify-q3-g2-d64": Case(B=2, Q=3, Hq=4, KVH=2, D=64, S=2, L=520, slots=(1, 0), q_pos=(517, 255)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case):
    q, k, v, slots, q_pos = make_inputs(case, seed=hash(case) % 1000)
    out, lse = poisoned(case)
    res = decode_attention(q, k, v, slots, q_pos, sm_scale=case.D ** -0.5, out=out, lse=lse,
                           num_splits=case.num_splits, batch_invariant=case.batch_invariant)
    assert res[0] is out and res[1] is lse  # given outputs are filled, not replaced
    assert_matches(out, lse, *reference(q, k, v, slots, q_pos, sm_scale=case.D ** -0.5))


def test_strided_q_and_joint_kv_cache_layouts():
    """q a head slice of a fused QKV buffer, k / v views of one [S, L, 2, KVH, D] cache."""
    c = Case(B=2, Q=2, Hq=8, KVH=2, D=64, S=3, L=70, slots=(2, 0), q_pos=(66, 9))
    q, k, v, slots, q_pos = make_inputs(c, seed=3, strided=True)
    assert not q.is_contiguous() and not k.is_contiguous()
    out, lse = decode_attention(q, k, v, slots, q_pos, sm_scale=0.1)
    assert_matches(out, lse, *reference(q, k, v, slots, q_pos, sm_scale=0.1))


@pytest.mark.parametrize("invariant,L", [(False, 256), (True, 600)], ids=["heuristic", "invariant"])
def test_heuristic_splits_a_lone_long_row(invariant, L):
    """B * KVH = 1 program on 132 SMs: the heuristic splits (L // 128 = 2; invariant:
    cdiv(L, 256) = 3), the launcher keeps the workspace, and a given workspace
    gives the same bits."""
    c = Case(B=1, Q=1, Hq=4, KVH=1, D=64, S=1, L=L, slots=(0,), q_pos=(L - 26,))
    q, k, v, slots, q_pos = make_inputs(c, seed=4)
    kw = dict(sm_scale=0.125, batch_invariant=invariant)
    assert plan_call(q, k, batch_invariant=invariant).num_splits == (3 if invariant else 2)
    out, lse = poisoned(c)
    decode_attention(q, k, v, slots, q_pos, out=out, lse=lse, **kw)
    assert_matches(out, lse, *reference(q, k, v, slots, q_pos, sm_scale=0.125))
    out2, lse2 = poisoned(c)
    ws = torch.full((plan_call(q, k, batch_invariant=invariant).workspace_numel,), float("nan"))
    decode_attention(q, k, v, slots, q_pos, out=out2, lse=lse2, workspace=ws, **kw)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


# DCP: W ranks, rank r holds global positions r, r + W, ... (kv_stride W, kv_offset r)
DCP = {
    "w2-decode": (2, Case(B=3, Q=1, Hq=8, KVH=2, D=64, S=3, L=90, slots=(1, 2, 0), q_pos=(88, 0, 41))),
    "w3-verify-q3": (3, Case(B=2, Q=3, Hq=4, KVH=1, D=128, S=2, L=80, slots=(1, 0), q_pos=(70, 1))),
    "w3-decode-split2": (3, Case(B=2, Q=1, Hq=12, KVH=1, D=64, S=2, L=96, slots=(0, 1), q_pos=(95, 30),
                                 num_splits=2, batch_invariant=False)),
    "w2-decode-invariant-splits": (2, Case(B=2, Q=1, Hq=4, KVH=1, D=64, S=2, L=1100, slots=(1, 0),
                                           q_pos=(1099, 400))),  # 550 keys a rank: 3 splits
}


@pytest.mark.parametrize("world,case", DCP.values(), ids=DCP.keys())
def test_dcp_shards_merge_to_the_unsplit_reference(world, case):
    q, k, v, slots, q_pos = make_inputs(case, seed=7 + world)
    sm = case.D ** -0.5
    outs, lses = [], []
    for rank in range(world):
        kr, vr = k[:, rank::world], v[:, rank::world]  # [S, L_r, KVH, D]: this rank's positions
        out, lse = poisoned(case)
        decode_attention(q, kr, vr, slots, q_pos, sm_scale=sm, kv_stride=world, kv_offset=rank, out=out,
                         lse=lse, num_splits=case.num_splits, batch_invariant=case.batch_invariant)
        assert_matches(out, lse, *reference(q, kr, vr, slots, q_pos, sm_scale=sm, kv_stride=world,
                                            kv_offset=rank))
        outs.append(out.view(-1, case.Hq, case.D))
        lses.append(lse.view(-1, case.Hq))
    o, l = merge_partials(torch.stack(outs), torch.stack(lses), lse_base="e")
    ref_o, ref_l = reference(q, k, v, slots, q_pos, sm_scale=sm)
    assert_matches(o.view_as(ref_o), l.view_as(ref_l), ref_o, ref_l)


@pytest.mark.parametrize("num_splits,invariant,L", [(None, False, 40), (2, False, 40), (2, True, 600)],
                         ids=["unsplit", "split2", "invariant-split"])
def test_rank_without_keys_gives_zero_and_minus_inf(num_splits, invariant, L):
    """W = 3, rank 2 holds positions 2, 5, ...: queries at 0 and 1 see none of them."""
    c = Case(B=2, Q=1, Hq=4, KVH=2, D=64, S=2, L=L, slots=(1, 0), q_pos=(1, 0))
    q, k, v, slots, q_pos = make_inputs(c, seed=11, kv_stride=3, kv_offset=2)
    out, lse = poisoned(c)
    decode_attention(q, k, v, slots, q_pos, sm_scale=0.125, kv_stride=3, kv_offset=2, out=out, lse=lse,
                     num_splits=num_splits, batch_invariant=invariant)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, float("-inf")))


@pytest.mark.parametrize("b,q,cache_len", [(0, 1, 16), (2, 0, 16), (1, 2, 0)], ids=["no-rows", "no-queries",
                                                                                  "empty-cache"])
def test_empty_shapes(b, q, cache_len):
    """Nothing to attend: empty outputs, or out = 0 and lse = -inf over an empty cache."""
    c = Case(B=b, Q=q, Hq=4, KVH=2, D=64, S=2, L=cache_len, slots=(0,) * b, q_pos=(5,) * b)
    qt, k, v, slots, q_pos = make_inputs(c, seed=12)
    out, lse = poisoned(c)
    decode_attention(qt, k, v, slots, q_pos, sm_scale=0.1, out=out, lse=lse)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.full_like(lse, float("-inf")))
