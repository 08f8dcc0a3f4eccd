"""Compile the kernels `decode_attention` launches for the H200 (sm_90) on a CPU
machine, at real model shapes: the call runs on meta tensors with the kernels
replaced by recorders (nothing executes, no memory), then each recorded launch
compiles through Triton's ahead-of-time path and ptxas.

    python -m tests.attention.sm90_compile '<json: [[B, Q, Hq, KVH, D, L, num_splits, merge], ...]>'

(without TRITON_INTERPRET) prints one JSON list of rows per case.
"""

from __future__ import annotations

import json
import re
import sys
from unittest import mock

import torch

from tests.moe.sm90_compile import Launch, compile_sm90, ptxas_usage


class _Recorder:
    def __init__(self, fn, sink):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        return lambda *a, **k: self.sink.append(Launch(self.fn, grid, a, k))


def record_launches(b: int, q: int, hq: int, kvh: int, d: int, cache_len: int, num_splits=None,
                    merge: bool = True) -> list:
    """Launches of one call with q [B, Q, Hq, D] over a [4, L, KVH, D] cache (meta tensors);
    merge: a split call's merge in the attention kernel (launch.MERGE_IN_ATTENTION) or not."""
    import sparkinfer.attention.launch as attn_launch

    meta = dict(device="meta")
    sink: list[Launch] = []
    patches = [mock.patch.object(attn_launch, "_device_ok", lambda device: True),
               mock.patch.object(attn_launch, "MERGE_IN_ATTENTION", merge)]
    patches += [mock.patch.object(attn_launch, n, _Recorder(getattr(attn_launch, n), sink))
                for n in ("attention_kernel", "attention_combine_kernel")]
    for p in patches:
        p.start()
    try:
        cache = torch.empty(4, cache_len, kvh, d, dtype=torch.bfloat16, **meta)
        attn_launch.decode_attention(
            torch.empty(b, q, hq, d, dtype=torch.bfloat16, **meta), cache, cache,
            torch.empty(b, dtype=torch.int32, **meta), torch.empty(b, dtype=torch.int32, **meta),
            sm_scale=d ** -0.5, num_splits=num_splits)
    finally:
        for p in patches:
            p.stop()
    return sink


def _cp_async_sizes(ptx: str) -> list[int]:
    """Byte sizes of the cp.async copies in the PTX (16: full 16-byte vectors)."""
    return sorted({int(m, 0) for m in re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx)})


def compile_case(b, q, hq, kvh, d, cache_len, num_splits=None, merge=True) -> list[dict]:
    rows = []
    for launch in record_launches(b, q, hq, kvh, d, cache_len, num_splits, merge):
        compiled = compile_sm90(launch)
        ttgir = compiled.asm["ttgir"]
        rows.append(dict(kernel=launch.fn.fn.__name__, grid=list(launch.grid), **ptxas_usage(compiled),
                         sm90=".target sm_90" in compiled.asm["ptx"],
                         num_warps=launch.kwargs.get("num_warps"),
                         async_copies=ttgir.count("async_copy_global_to_local"),
                         cp_async_bytes=_cp_async_sizes(compiled.asm["ptx"]),
                         launch_pdl=bool(launch.kwargs.get("launch_pdl")),
                         pdl_waits=compiled.asm["ptx"].count("griddepcontrol.wait"),
                         pdl_triggers=compiled.asm["ptx"].count("griddepcontrol.launch_dependents"),
                         split=bool(launch.kwargs.get("SPLIT")), merge=bool(launch.kwargs.get("MERGE")),
                         atomics=re.findall(r"\batom\.[\w.]+", compiled.asm["ptx"]),
                         mma=("wgmma" if "warp_group_dot" in ttgir else "mma" if "tt.dot" in ttgir
                              or "mma" in compiled.asm["ptx"] else "none")))
    return rows


if __name__ == "__main__":
    print(json.dumps([compile_case(*case) for case in json.loads(sys.argv[1])]))
