"""The decoder's row kernels and the prefill gemm's schedules compile for the H200
(sm_90) at Qwen3-30B-A3B's dims on a CPU machine (ptxas only, no GPU), with
programmatic dependent launch where it is built in (rope.launch.ROPE_PDL,
norm.launch.NORM_WAIT, moe.routing.launch.ROUTING_PDL; on since an H100 timed them):
a kernel launched early reads only what its predecessor does not write (rope: the
positions, slots and rotary rows) and writes nothing before `griddepcontrol.wait`.

Runs in one subprocess without TRITON_INTERPRET (interpreted kernels cannot be
compiled)."""

import json

import pytest

from tests.models.sm90_compile import CASES
from tests.sm90 import run_sm90_module

pytest.importorskip("triton.backends.nvidia")

H200_MAX_SHARED = 232448  # bytes of dynamic shared memory per block on sm_90


@pytest.fixture(scope="module")
def compiled():
    rows = run_sm90_module("tests.models.sm90_compile", json.dumps(list(CASES)))
    return {r["case"]: r for r in rows}


@pytest.mark.parametrize("name", CASES)
def test_compiles_for_sm90(compiled, name):
    r = compiled[name]
    assert "error" not in r and r["sm90"] and r["spill"] == 0 and r["shared"] <= H200_MAX_SHARED, r
    if r["launch_pdl"]:  # launched early: one wait, nothing written before it
        assert r["pdl_waits"] == 1 and r["stores_before_wait"] == 0 and r["copies_before_wait"] == 0, r
        assert r["loads_after_wait"] > 0, r
    else:
        assert r["pdl_waits"] == 0, r


def test_what_each_kernel_reads_before_its_wait(compiled):
    """rope at one row a program: the position, the slot and the cos / sin rows (4
    loads; 6 since the rows' halves are tiles of R/2 and v's of D: the position and
    the slot are loaded once for each tile shape), never qkv (2 more: lo and hi; at 8
    rows a program the gathers take more instructions); the norm and the routing:
    nothing (every input is the predecessor's output)."""
    assert compiled["rope-t1-pdl"]["loads_before_wait"] == 6
    assert compiled["rope-t64-pdl"]["loads_before_wait"] > 0
    assert compiled["norm-t1-wait"]["loads_before_wait"] == 0
    assert compiled["norm-t1-wait"]["pdl_triggers"] == 1  # and still lets the projection after it launch
    assert compiled["routing-t1-pdl-w1"]["loads_before_wait"] == 0 and compiled["routing-t1-pdl-w1"]["num_warps"] == 1


def test_gemm_schedules_use_tma_and_wgmma(compiled):
    """Both persistent schedules load by TMA into wgmma; "ws" on a 4-warp tile is
    partitioned into a producer and a consumer (setmaxnreg rebalances their registers)."""
    for name in ("gemm-qkv-1024-persistent", "gemm-qkv-1024-ws"):
        r = compiled[name]
        assert r["wgmma"] > 0 and r["tma_loads"] > 0, r
    assert not compiled["gemm-qkv-1024-persistent"]["warp_specialized"]
    ws = compiled["gemm-qkv-1024-ws"]
    assert ws["warp_specialized"] and ws["setmaxnreg"] > 0, ws
