"""GPU checks (skipped without CUDA or under the interpreter; run with
`TRITON_INTERPRET=0 pytest tests/attention/test_gpu.py`): the decoder's real
shapes against the fp32 reference with NaN-poisoned outputs and never-attended
cache positions NaN; DCP shards merged; CUDA-graph capture, then replays with
new inputs written in place."""

import dataclasses
import os
import random

import pytest
import torch

from sparkinfer.attention import attention_workspace, decode_attention, plan_call
from sparkinfer.comm.dcp.reference import merge_partials
from tests.attention._util import Case, assert_matches, make_inputs, poisoned, reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset)")

MODELS = {"qwen3": (32, 4), "glm-air": (96, 8), "mixtral": (32, 8)}  # (Hq, KVH) at TP 1, D 128


def _case(b, q, model, cache_len, *, seed, pos=None, num_splits=None) -> Case:
    """B rows on distinct slots in shuffled order; contexts spread over the cache."""
    hq, kvh = MODELS[model]
    rng = random.Random(seed)
    slots = list(range(b + 3))
    rng.shuffle(slots)
    q_pos = pos if pos is not None else tuple(rng.randrange(max(0, cache_len // 2 - q), cache_len - q + 1)
                                              for _ in range(b))
    return Case(B=b, Q=q, Hq=hq, KVH=kvh, D=128, S=b + 3, L=cache_len, slots=tuple(slots[:b]),
                q_pos=tuple(q_pos), num_splits=num_splits)


CASES = {f"decode-{m}-b{b}-L{n}": _case(b, 1, m, n, seed=b + n) for m in MODELS for b in (1, 8, 64)
         for n in (128, 8192)}
CASES.update({
    "decode-qwen3-b1-L8192-ctx100": _case(1, 1, "qwen3", 8192, seed=1, pos=(99,)),  # 33 splits, 2 busy
    "verify-q4-qwen3-b8": _case(8, 4, "qwen3", 4096, seed=2),
    "verify-q4-glm-air-b8": _case(8, 4, "glm-air", 4096, seed=3),
    "verify-q4-glm-air-b64": _case(64, 4, "glm-air", 2048, seed=4),
    "prefill-512-qwen3": _case(1, 512, "qwen3", 512, seed=5, pos=(0,)),
    "prefill-512-glm-air-after-1000": _case(2, 512, "glm-air", 2048, seed=6, pos=(1000, 0)),
    "decode-mixtral-b4-forced-64-splits": _case(4, 1, "mixtral", 4096, seed=7, num_splits=64),
})


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gpu_matches_reference(case):
    q, k, v, slots, q_pos = make_inputs(case, seed=len(CASES), device="cuda")
    out, lse = poisoned(case, "cuda")
    decode_attention(q, k, v, slots, q_pos, sm_scale=case.D ** -0.5, out=out, lse=lse,
                     num_splits=case.num_splits)
    assert_matches(out, lse, *reference(q, k, v, slots, q_pos, sm_scale=case.D ** -0.5))


@pytest.mark.parametrize("world", [2, 3])
def test_gpu_dcp_shards_merge(world):
    case = _case(8, 1, "qwen3", 4096, seed=world)
    q, k, v, slots, q_pos = make_inputs(case, seed=world, device="cuda")
    outs, lses = [], []
    for rank in range(world):
        out, lse = decode_attention(q, k[:, rank::world], v[:, rank::world], slots, q_pos, sm_scale=0.088,
                                    kv_stride=world, kv_offset=rank)
        outs.append(out.view(-1, case.Hq, case.D))
        lses.append(lse.view(-1, case.Hq))
    o, lse = merge_partials(torch.stack(outs), torch.stack(lses), lse_base="e")
    ref_o, ref_lse = reference(q, k, v, slots, q_pos, sm_scale=0.088)
    assert_matches(o.view_as(ref_o), lse.view_as(ref_lse), ref_o, ref_lse)


def _refill(case, step: int, seed: int, inputs: tuple, outputs: tuple) -> None:
    """New q, cache contents, slots and positions copied into `inputs` in place (what a
    captured graph reads), the outputs poisoned."""
    rng = random.Random(step)
    new = dataclasses.replace(case, slots=tuple(rng.sample(range(case.S), case.B)),
                              q_pos=tuple(rng.randrange(case.L - case.Q + 1) for _ in range(case.B)))
    for dst, src in zip(inputs, make_inputs(new, seed=seed, device="cuda")):
        dst.copy_(src)
    for t in outputs:
        t.fill_(float("nan"))


GRAPHS = {  # workspace kept by the launcher or given, programs per row the planner picks
    "decode-qwen3-b8-kept-ws": ("kept", 5, _case(8, 1, "qwen3", 4096, seed=8)),
    "decode-glm-air-b2-given-ws": ("given", 9, _case(2, 1, "glm-air", 8192, seed=9)),
    "decode-glm-air-b64-one-program": ("kept", 1, _case(64, 1, "glm-air", 2048, seed=10)),  # walks 8 splits
    "verify-q4-qwen3-b4-given-ws": ("given", 8, _case(4, 4, "qwen3", 2048, seed=11)),  # 2048 / 256 splits
}


@pytest.mark.parametrize("ws_mode,splits,case", GRAPHS.values(), ids=GRAPHS.keys())
def test_gpu_graph_capture_and_replay_with_new_inputs(ws_mode, splits, case):
    """Eager once (compiles; keeps the workspace), capture, then per replay: new q,
    cache contents, slots and positions copied in place, outputs poisoned; every
    replay matches the reference and, bit for bit, an eager call on the same inputs."""
    q, k, v, slots, q_pos = make_inputs(case, seed=0, device="cuda")
    out, lse = poisoned(case, "cuda")
    ws = attention_workspace(q, k) if ws_mode == "given" else None
    kw = dict(sm_scale=case.D ** -0.5, out=out, lse=lse, workspace=ws)
    assert plan_call(q, k).num_splits == splits
    decode_attention(q, k, v, slots, q_pos, **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode_attention(q, k, v, slots, q_pos, **kw)
    for step in range(3):
        _refill(case, step, 100 + step, (q, k, v, slots, q_pos), (out, lse))
        g.replay()
        torch.cuda.synchronize()
        assert_matches(out, lse, *reference(q, k, v, slots, q_pos, sm_scale=case.D ** -0.5))
        e_out, e_lse = decode_attention(q, k, v, slots, q_pos, sm_scale=case.D ** -0.5, workspace=ws)
        assert torch.equal(e_out, out) and torch.equal(e_lse, lse)


MERGES = {  # split calls: programs of a tile race to be the last, which merges
    "decode-qwen3-b1-L8192": _case(1, 1, "qwen3", 8192, seed=12),  # 33 programs a tile
    "decode-glm-air-b8-L4096": _case(8, 1, "glm-air", 4096, seed=13),
    "decode-mixtral-b4-forced-64": _case(4, 1, "mixtral", 4096, seed=14, num_splits=64),
    "verify-q4-qwen3-b2": _case(2, 4, "qwen3", 4096, seed=15),
}


@pytest.mark.parametrize("case", MERGES.values(), ids=MERGES.keys())
def test_gpu_merge_in_the_grid_gives_the_combine_kernels_bits(case, monkeypatch):
    """`launch.MERGE_IN_ATTENTION` (the tile's last program merges) against the combine
    kernel, on 20 fresh inputs eagerly and 20 graph replays back to back: every call the
    combine kernel's bits, and the reference."""
    from sparkinfer.attention import launch as attn_launch

    monkeypatch.setattr(attn_launch, "MERGE_IN_ATTENTION", True)
    q, k, v, slots, q_pos = make_inputs(case, seed=0, device="cuda")
    out, lse = poisoned(case, "cuda")
    kw = dict(sm_scale=case.D ** -0.5, out=out, lse=lse, num_splits=case.num_splits)
    assert plan_call(q, k, num_splits=case.num_splits).num_splits > 1
    decode_attention(q, k, v, slots, q_pos, **kw)  # compiles, keeps the workspace and the counters
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode_attention(q, k, v, slots, q_pos, **kw)
    for trial in range(40):
        _refill(case, trial, 200 + trial, (q, k, v, slots, q_pos), (out, lse))
        if trial % 2:
            g.replay()
        else:
            decode_attention(q, k, v, slots, q_pos, **kw)
        monkeypatch.setattr(attn_launch, "MERGE_IN_ATTENTION", False)
        c_out, c_lse = decode_attention(q, k, v, slots, q_pos, sm_scale=case.D ** -0.5,
                                        num_splits=case.num_splits)
        monkeypatch.setattr(attn_launch, "MERGE_IN_ATTENTION", True)
        torch.cuda.synchronize()
        assert torch.equal(out, c_out) and torch.equal(lse, c_lse), f"trial {trial}"
        if trial < 4:
            assert_matches(out, lse, *reference(q, k, v, slots, q_pos, sm_scale=case.D ** -0.5))
