"""Compile the decoder's row kernels and the prefill gemm's schedules for the H200
(sm_90) on a CPU machine, at Qwen3-30B-A3B's dims: each call runs on meta tensors
with its kernel replaced by a recorder (nothing executes), with the launch options
set as a case asks (programmatic dependent launch, block sizes, warps), then the
launch compiles through Triton's ahead-of-time path and ptxas.

    python -m tests.models.sm90_compile '<json: [case name, ...]>'

(without TRITON_INTERPRET) prints one JSON row per case: ptxas usage, the MMAs, and
what the PTX does before `griddepcontrol.wait`.
"""

from __future__ import annotations

import json
import re
import sys
from unittest import mock

import torch

from tests.linear.sm90_compile import _before_wait
from tests.moe.sm90_compile import Launch, _Recorder, compile_sm90, ptxas_usage

# Qwen3-30B-A3B: 32 query heads, 4 KV heads of 128, hidden 2048, 128 experts, top 8
HQ, KVH, D, H, E, K = 32, 4, 128, 2048, 128, 8
_META = dict(device="meta")


def _record(module, kernel: str, call, **flags) -> Launch:
    """The launch `call()` makes of `module.<kernel>`, with module constants `flags` set."""
    sink: list[Launch] = []
    with mock.patch.dict(vars(module), flags), \
            mock.patch.object(module, kernel, _Recorder(getattr(module, kernel), sink)):
        call()
    return sink[0]


def _rope(tokens: int, pdl: bool, block_rows: int) -> Launch:
    import sparkinfer.rope.launch as rl
    from sparkinfer.rope import rotary_table

    bf16 = dict(dtype=torch.bfloat16, **_META)
    table = rotary_table(D, 1e6, 4096, "meta")
    cache = torch.empty(8, 4096, KVH, D, **bf16)
    ints = torch.empty(tokens, dtype=torch.int32, **_META)
    return _record(rl, "rope_qk_cache_kernel", lambda: rl.rope_qk_cache(
        torch.empty(tokens, (HQ + 2 * KVH) * D, **bf16), ints, ints, table, (cache, cache), (HQ, KVH, D),
        norms=(torch.empty(D, **bf16), torch.empty(D, **bf16))),
        ROPE_PDL=pdl, MAX_BLOCK_ROWS=block_rows, _min_programs=lambda device: 128)


def _norm(tokens: int, wait: bool) -> Launch:
    import sparkinfer.norm.launch as nl

    x = torch.empty(tokens, H, dtype=torch.bfloat16, **_META)
    on_gpu = nl.row_launch  # as on a GPU: the norm lets its successor launch at entry (PDL)
    return _record(nl, "add_rms_norm_kernel", lambda: nl.add_rms_norm(x, x, torch.empty(H, dtype=torch.bfloat16,
                                                                                          **_META), 1e-6),
                   NORM_WAIT=wait, row_launch=lambda h, device: on_gpu(h, "cuda"))


def _routing(tokens: int, pdl: bool, warps: int) -> Launch:
    import sparkinfer.moe.routing.launch as rl
    from sparkinfer.moe import MoESpec

    out = (torch.empty(tokens, K, dtype=torch.int32, **_META), torch.empty(tokens, K, dtype=torch.float32, **_META))
    return _record(rl, "routing_kernel", lambda: rl.route(torch.empty(tokens, E, dtype=torch.bfloat16, **_META),
                                                          MoESpec(weight_format="bf16"), out),
                   ROUTING_PDL=pdl, ROUTING_WARPS=warps)


def _gemm(m: int, n: int, k: int, tile: str, schedule: str) -> Launch:
    import importlib

    g = importlib.import_module("sparkinfer.linear.gemm")  # the package's `gemm` is the function

    bf16 = dict(dtype=torch.bfloat16, **_META)
    return _record(g, "gemm_kernel", lambda: g.gemm(torch.empty(m, k, **bf16), torch.empty(n, k, **bf16),
                                                    tile=g.GEMM_CANDIDATES[tile], tma=True, schedule=schedule))


CASES = {
    "rope-t1-pdl": lambda: _rope(1, True, 8),  # batch 1: one (token, head) row a program
    "rope-t64-pdl": lambda: _rope(64, True, 8),
    "rope-t1024-rows32": lambda: _rope(1024, False, 32),  # the widest block the sweep times
    "norm-t1-wait": lambda: _norm(1, True),
    "routing-t1-pdl-w1": lambda: _routing(1, True, 1),
    "gemm-qkv-1024-persistent": lambda: _gemm(1024, (HQ + 2 * KVH) * D, H, "128x128", "persistent"),
    "gemm-qkv-1024-ws": lambda: _gemm(1024, (HQ + 2 * KVH) * D, H, "64x128", "ws"),
}


def compile_case(name: str) -> dict:
    launch = CASES[name]()
    try:
        compiled = compile_sm90(launch)
    except Exception as e:  # noqa: BLE001 - a row saying why, for the test to show
        return dict(case=name, error=f"{type(e).__name__}: {str(e)[:2000]}")
    ptx = compiled.asm["ptx"]
    kw = launch.kwargs
    return dict(case=name, kernel=launch.fn.fn.__name__, grid=list(launch.grid), **ptxas_usage(compiled),
                sm90=".target sm_90" in ptx, launch_pdl=bool(kw.get("launch_pdl")), num_warps=kw.get("num_warps"),
                pdl_waits=ptx.count("griddepcontrol.wait"),
                pdl_triggers=ptx.count("griddepcontrol.launch_dependents"),
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                bar_shared=len(re.findall(r"mbarrier\.(?:try_wait|arrive)", ptx)),
                setmaxnreg=len(re.findall(r"setmaxnreg", ptx)),
                warp_specialized="ttg.warp_specialize(" in compiled.asm["ttgir"], **_before_wait(ptx))


if __name__ == "__main__":
    print(json.dumps([compile_case(c) for c in json.loads(sys.argv[1])]))
