"""A split call's merge in the attention kernel (`launch.MERGE_IN_ATTENTION`: the last of
a tile's programs to finish merges the partials) against the combine kernel launched
after the grid: the same bits, through the Triton interpreter. The per-tile counters are
back at zero after every call, so the next call (new inputs) merges right; during
capture without counters the call launches the combine kernel, with the same bits."""

import pytest
import torch

from sparkinfer.attention import decode_attention, plan_call
from sparkinfer.attention import launch as attn_launch
from sparkinfer.bench.launches import LaunchCounter
from tests.attention._util import Case, assert_matches, make_inputs, poisoned, reference

CASES = {
    # batch-invariant splits of 256 keys: rows of 3, 2 and 1 splits, a program walking two
    "inv-decode-g4": Case(B=3, Q=1, Hq=4, KVH=1, D=64, S=4, L=600, slots=(3, 0, 1), q_pos=(599, 300, 100),
                          num_splits=2),
    # more programs than splits: most programs count without a key
    "inv-decode-g2-kvh2": Case(B=2, Q=1, Hq=4, KVH=2, D=32, S=3, L=800, slots=(2, 0), q_pos=(700, 3)),
    "inv-verify-q3": Case(B=2, Q=3, Hq=4, KVH=2, D=64, S=2, L=520, slots=(1, 0), q_pos=(517, 255)),
    "heuristic-split3": Case(B=2, Q=1, Hq=4, KVH=1, D=64, S=3, L=200, slots=(2, 0), q_pos=(199, 40),
                             num_splits=3, batch_invariant=False),
}


def _call(case, q, k, v, slots, q_pos, *, merge, monkeypatch):
    monkeypatch.setattr(attn_launch, "MERGE_IN_ATTENTION", merge)
    out, lse = poisoned(case)
    with LaunchCounter() as launches:
        decode_attention(q, k, v, slots, q_pos, sm_scale=case.D ** -0.5, out=out, lse=lse,
                         num_splits=case.num_splits, batch_invariant=case.batch_invariant)
    return out, lse, {k: n for k, n in launches.counts.items() if k.startswith("triton: ")}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_merge_in_the_grid_gives_the_combine_kernels_bits(case, monkeypatch):
    cfg = plan_call(make_inputs(case, seed=0)[0], make_inputs(case, seed=0)[1], num_splits=case.num_splits,
                    batch_invariant=case.batch_invariant)
    assert cfg.split_slots > 1 and cfg.num_splits > 1, "the case must split"
    for seed in (1, 2):  # a second call on new inputs: the first call's merges left the counters at 0
        inputs = make_inputs(case, seed=seed)
        m_out, m_lse, m_launches = _call(case, *inputs, merge=True, monkeypatch=monkeypatch)
        c_out, c_lse, c_launches = _call(case, *inputs, merge=False, monkeypatch=monkeypatch)
        assert m_launches == {"triton: attention_kernel": 1}
        assert c_launches == {"triton: attention_kernel": 1, "triton: attention_combine_kernel": 1}
        assert_matches(m_out, m_lse, *reference(*inputs, sm_scale=case.D ** -0.5))
        assert torch.equal(m_out.view(torch.int16), c_out.view(torch.int16))
        assert torch.equal(m_lse.view(torch.int32), c_lse.view(torch.int32))
        counters = attn_launch._COUNTERS[(torch.device("cpu"), cfg.grid[0])]
        assert counters.shape == (cfg.grid[0],) and not counters.any()


def test_capture_without_counters_launches_the_combine(monkeypatch):
    case = CASES["inv-decode-g2-kvh2"]
    inputs = make_inputs(case, seed=3)
    want, want_lse, _ = _call(case, *inputs, merge=True, monkeypatch=monkeypatch)
    cfg = plan_call(inputs[0], inputs[1])
    workspace = torch.empty(cfg.workspace_numel)
    monkeypatch.setattr(attn_launch, "_COUNTERS", {})
    monkeypatch.setattr(attn_launch, "_capturing", lambda device: True)
    out, lse = poisoned(case)
    with LaunchCounter() as launches:
        decode_attention(*inputs, sm_scale=case.D ** -0.5, out=out, lse=lse, workspace=workspace)
    assert dict(launches.counts) == {"triton: attention_kernel": 1, "triton: attention_combine_kernel": 1}
    assert attn_launch._COUNTERS == {}  # nothing allocated during capture (no torch op counted either)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)) and torch.equal(lse, want_lse)
