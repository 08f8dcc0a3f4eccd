"""The launches of `linear` compile for the H200 (sm_90) at the decoder's real
shapes on a CPU machine (ptxas only, no GPU): no register spills, within shared
memory, on wgmma, and programmatic dependent launch where the design puts it:
the preload schedule issues its weight loads before `griddepcontrol.wait` and
reads x and writes nothing until after it; the stream schedule touches no
memory before it.

Runs in one subprocess without TRITON_INTERPRET (interpreted kernels cannot be
compiled)."""

import json

import pytest

from tests.sm90 import run_sm90_module

pytest.importorskip("triton.backends.nvidia")

H200_MAX_SHARED = 232448  # bytes of dynamic shared memory per block on sm_90
# id -> (N, K, M, dtype, bias, gated)
CASES = {
    "qwen3-qkv-m1": (5120, 2048, 1, "bf16", False, False),  # coarse at every M (COARSE_SMALL_SLICES)
    "qwen3-qkv-m1-fine": (5120, 2048, 1, "bf16", False, False, {"COARSE_SMALL_SLICES": False}),  # preload, KS 256
    "qwen3-o-m1": (2048, 4096, 1, "bf16", False, False),  # preload, KS 512, split 8
    "qwen3-o-m1-late": (2048, 4096, 1, "bf16", False, False, {"PRELOAD_EARLY": False}),  # loads after the wait
    "glm-shared-gate-up-m16": (2816, 4096, 16, "bf16", False, False),  # preload, KS 512: the largest slice
    "qwen3-qkv-m64": (5120, 2048, 64, "bf16", False, False),  # coarse: 2 groups of 4 slices, 4 row blocks
    "qwen3-o-m128": (2048, 4096, 128, "bf16", False, False),  # coarse, launches of 64 rows
    # coarse, 128 features a program (8 warps; config.COARSE_BLOCK_N, not the default)
    "qwen3-qkv-m64-bn128": (5120, 2048, 64, "bf16", False, False, {"COARSE_BLOCK_N": 128}),
    "glm-shared-down-gated-m64": (4096, 1408, 64, "bf16", False, True),  # coarse, 4 gated x blocks
    "glm-router-fp32-m64": (128, 4096, 64, "bf16>fp32", False, False),  # coarse, tf32x3 in 64-wide steps
    "glm-router-fp32-m8": (128, 4096, 8, "bf16>fp32", False, False),  # preload, tf32x3, x upcast in the kernel
    "glm-shared-down-gated-m8": (4096, 1408, 8, "bf16", False, True),  # preload, silu(gate) * up as x loads
    "qwen3-lm-head-m128": (151936, 2048, 128, "bf16", False, False),  # stream, 8 row blocks
    "qwen3-lm-head-m65": (151936, 2048, 65, "bf16", False, False),  # stream, 5 row blocks (a mixed step's head)
    "glm-qkv-bias-m1": (14336, 4096, 1, "bf16", True, False),  # stream, one row block
}


@pytest.fixture(scope="module")
def compiled():
    rows = run_sm90_module("tests.linear.sm90_compile", json.dumps(list(CASES.values())))
    return dict(zip(CASES, rows))


@pytest.mark.parametrize("name", CASES)
def test_launch_compiles_for_sm90_and_waits_where_designed(compiled, name):
    r = compiled[name]
    assert r["sm90"] and r["spill"] == 0 and r["shared"] <= H200_MAX_SHARED, r
    assert r["wgmma"] > 0, r
    assert r["launch_pdl"] and r["pdl_waits"] == 1 and r["pdl_triggers"] == 1, r
    assert r["stores_before_wait"] == 0 and r["copies_before_wait"] == 0, r
    if r["stream"]:
        assert r["loads_before_wait"] == 0 and r["copies_after_wait"] > 0, r
    elif name.endswith("-late"):  # launch.PRELOAD_EARLY off: nothing read before the wait
        assert r["loads_before_wait"] == 0 and r["loads_after_wait"] >= 8 and r["split"] > 1, r
    else:  # the whole weight slice in flight before the wait, in 16-byte vectors
        assert r["loads_before_wait"] >= 8 and r["split"] > 1, r
