"""The kernels decode_attention launches compile for the H200 (sm_90) at the
decoder's real shapes on a CPU machine (ptxas only, no GPU): no register
spills, within shared memory, K / V streamed by 16-byte cp.async.

Runs in one subprocess without TRITON_INTERPRET (interpreted kernels cannot be
compiled)."""

import json

import pytest

from tests.sm90 import run_sm90_module

pytest.importorskip("triton.backends.nvidia")

H200_MAX_SHARED = 232448  # bytes of dynamic shared memory per block on sm_90
# id -> (B, Q, Hq, KVH, D, L, forced splits[, merge: False launches the combine kernel])
CASES = {
    "qwen3-decode-b1-8k": (1, 1, 32, 4, 128, 8192, None),
    "glm-air-decode-b1-8k": (1, 1, 96, 8, 128, 8192, None),
    "mixtral-decode-b8-4k": (8, 1, 32, 8, 128, 4096, None),
    "glm-air-decode-b64-4k": (64, 1, 96, 8, 128, 4096, None),
    "qwen3-decode-b64-576": (64, 1, 32, 4, 128, 576, None),  # bench decode's cache: one program walks 3 splits
    "qwen3-verify-q4-b2": (2, 4, 32, 4, 128, 4096, None),
    "glm-air-verify-q4-b2": (2, 4, 96, 8, 128, 4096, None),
    "qwen3-prefill-512": (1, 512, 32, 4, 128, 4096, None),
    "d64-decode-split": (1, 1, 16, 2, 64, 2048, 8),
    "d256-decode-split": (1, 1, 16, 1, 256, 4096, 8),
    "d256-prefill-512": (1, 512, 16, 1, 256, 4096, None),
    "qwen3-decode-b1-8k-combine": (1, 1, 32, 4, 128, 8192, None, False),
    "glm-air-verify-q4-b2-combine": (2, 4, 96, 8, 128, 4096, None, False),
    "d256-decode-split-combine": (1, 1, 16, 1, 256, 4096, 8, False),
}


@pytest.fixture(scope="module")
def compiled():
    rows = run_sm90_module("tests.attention.sm90_compile", json.dumps(list(CASES.values())))
    return dict(zip(CASES, rows))


@pytest.mark.parametrize("name", CASES)
def test_launches_compile_for_sm90(compiled, name):
    rows = compiled[name]
    b, q, hq, kvh, d, cache_len, forced, *merge = CASES[name]
    merge = merge[0] if merge else True
    split = rows[0]["split"]
    # batch-invariant splits: decode and verify rows of caches over SPLIT_KEYS positions,
    # at every B (b64 too: one program walks the splits); prefill never splits
    assert split == (q <= 4 and cache_len > 256)
    # a split call merges in the attention kernel (one launch), or in the combine kernel after it
    assert [r["kernel"] for r in rows] == ["attention_kernel"] + ["attention_combine_kernel"] * (split and not merge)
    assert rows[0]["merge"] == (split and merge)
    for r in rows:
        assert r["sm90"] and r["spill"] == 0 and r["shared"] <= H200_MAX_SHARED, r
    # the merge's count: one GPU-scope acquire-release atomic add a program (a scalar: one thread)
    assert rows[0]["atomics"] == (["atom.global.gpu.acq_rel.add.u32"] if split and merge else []), rows[0]
    # programmatic dependent launch: attention launches early behind rope and waits for it
    # (ATTENTION_PDL); a split call lets its successor launch once its loops end: the combine,
    # which waits for the partials and lets the o projection launch at its entry
    # (COMBINE_LETS_NEXT), or with the merge in the grid the o projection itself
    assert [(r["launch_pdl"], r["pdl_waits"] > 0, r["pdl_triggers"] > 0) for r in rows] == (
        [(True, True, split)] + [(True, True, True)] * (split and not merge))
    attn = rows[0]
    # K and V of the next steps in flight, in 16-byte cp.async copies
    assert attn["async_copies"] >= 4 and attn["cp_async_bytes"] == [16], attn
    if q == 1:  # the split heuristic assumes two decode programs fit one SM
        assert 2 * attn["shared"] <= H200_MAX_SHARED and 2 * attn["regs"] * 32 * attn["num_warps"] <= 65536, attn
