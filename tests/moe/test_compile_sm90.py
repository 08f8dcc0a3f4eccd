"""The kernels each family launches compile for the H200 (sm_90) and fit its
shared memory, at a real model's dims, on a CPU machine (ptxas only, no GPU).

Runs in a subprocess without TRITON_INTERPRET (interpreted kernels cannot be
compiled), one subprocess for all cases.
"""

import json

import pytest

from tests.sm90 import run_sm90_module

pytest.importorskip("triton.backends.nvidia")

H200_MAX_SHARED = 232448  # bytes of dynamic shared memory per block on sm_90
QWEN3 = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)
DSV3_TP8 = dict(num_experts=256, top_k=8, hidden=7168, intermediate=256)
DSV3_ROUTING = dict(routing="sigmoid_grouped", n_group=8, topk_group=4)
MIXTRAL = dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336)
CASES = [("qwen3", fmt, t) for fmt in ("bf16", "nvfp4") for t in (1, 64, 1024)] + [
    ("dsv3_tp8", "nvfp4", 1), ("dsv3_tp8", "bf16", 4096), ("qwen3-ptx", "nvfp4", 64),
    ("mixtral", "nvfp4", 4), ("mixtral-ptx", "nvfp4", 4)]


def _compile(cases: list) -> list:
    """Rows of `tests.moe.sm90_compile` for each case (one subprocess for all)."""
    return run_sm90_module("tests.moe.sm90_compile", json.dumps(cases))


@pytest.fixture(scope="module")
def compiled():
    shapes = {"qwen3": (QWEN3, 1024, {}), "dsv3_tp8": (DSV3_TP8, 4096, DSV3_ROUTING),
              "mixtral": (MIXTRAL, 16, {})}
    case = [(*shapes[name.split("-")[0]], "ptx" if name.endswith("-ptx") else "arith")
            for name, _, _ in CASES]
    return dict(zip(CASES, _compile([[s, fmt, t, mt, kw, dec]
                                     for (s, mt, kw, dec), (_, fmt, t) in zip(case, CASES)])))


@pytest.mark.parametrize("name,fmt,t", CASES, ids=[f"{n}-{f}-T{t}" for n, f, t in CASES])
def test_launches_compile_for_sm90(compiled, name, fmt, t):
    rows = compiled[(name, fmt, t)]
    names = [r["kernel"] for r in rows]
    assert names[0] == "routing_kernel" and names[-1] == "moe_reduce_kernel"
    assert ("sort_count_kernel" in names) == (rows[0]["family"] == "grouped")
    assert rows[0]["family"] == ("micro" if t <= 16 else "grouped")
    micro = rows[0]["family"] == "micro"
    for r in rows:
        assert r["sm90"] and r["shared"] <= H200_MAX_SHARED and r["spill"] == 0, r
        # programmatic dependent launch (micro only): a kernel launched early waits for
        # its predecessor's grid before reading; FC1 and FC2 let their successor launch
        dependent = micro and r["kernel"] in ("moe_act_kernel", "moe_fc2_kernel",
                                              "moe_reduce_kernel")
        assert r["launch_pdl"] == dependent and (r["pdl_waits"] > 0) == dependent, r
        assert (r["pdl_triggers"] > 0) == (micro and r["kernel"] in (
            "moe_fc1_kernel", "moe_act_kernel", "moe_fc2_kernel")), r
        # NVFP4 codes and E4M3 scales ride the cp.async pipeline: no step waits on HBM
        assert r["sync_u8_loads"] == 0 or not r["kernel"].startswith("moe_fc"), r

