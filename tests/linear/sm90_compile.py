"""Compile the kernel `linear` launches for the H200 (sm_90) on a CPU machine, at
the decode projections' real shapes: the call runs on meta tensors with the
kernel replaced by a recorder (an H200's 132 SMs planned, PDL on), then the
launch compiles through Triton's ahead-of-time path and ptxas, specialized as
Triton's launcher would (ints equal to 1 become constants, ints divisible by 16
are marked so, M never).

    python -m tests.linear.sm90_compile '<json: [[N, K, M, dtype, bias, gated(, config)], ...]>'

(dtype "bf16", "fp32", or "bf16>fp32": x bf16, w fp32)

(without TRITON_INTERPRET) prints one JSON row per case: ptxas usage, the MMA
used, and what the PTX does before `griddepcontrol.wait`.
"""

from __future__ import annotations

import json
import re
import sys
from unittest import mock

import torch

from tests.moe.sm90_compile import _PTR, Launch, ptxas_usage

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class _Recorder:
    def __init__(self, fn, sink):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        return lambda *a, **k: self.sink.append(Launch(self.fn, grid, a, k))


def record_launch(n: int, k: int, m: int, dtype: str, bias: bool, gated: bool = False,
                  config: dict | None = None) -> Launch:
    """The launch of linear(x [M, K], w [N, K]) with its semaphores on an H200 (meta tensors);
    config: `sparkinfer.linear.config` (or `launch`) attributes set for the call."""
    import sparkinfer.linear.launch as lin

    xt, wt = (_DTYPES[d] for d in dtype.split(">")) if ">" in dtype else (_DTYPES[dtype],) * 2
    meta = dict(device="meta")
    sink: list[Launch] = []
    w = torch.empty(n, k, dtype=wt, **meta)
    config = dict(config or {})
    launch_flags = {k: config.pop(k) for k in list(config) if hasattr(lin, k) and not hasattr(lin.config, k)}
    with mock.patch.dict(vars(lin.config), config), mock.patch.dict(vars(lin), launch_flags), \
            mock.patch.object(lin, "_num_sms", lambda device: 132), \
            mock.patch.object(lin, "linear_preload_kernel", _Recorder(lin.linear_preload_kernel, sink)), \
            mock.patch.object(lin, "linear_stream_kernel", _Recorder(lin.linear_stream_kernel, sink)):
        lin.linear(torch.empty(m, k * (2 if gated else 1), dtype=xt, **meta), w,
                   torch.empty(n, dtype=wt, **meta) if bias else None, sync=lin.linear_sync(w), pdl=True, gated=gated)
    return sink[0]


def compile_launch(launch: Launch):
    """Triton's AOT compile of a recorded launch for sm_90, specialized like its launcher."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    fn, kw = launch.fn, dict(launch.kwargs)
    options = {o: kw.pop(o) for o in ("num_warps", "num_stages", "launch_pdl") if o in kw}
    sig, consts, attrs = {}, {}, {}
    for idx, (name, val) in enumerate(zip(fn.arg_names, launch.args)):
        if isinstance(val, torch.Tensor):
            sig[name], attrs[(idx,)] = _PTR[val.dtype], [["tt.divisibility", 16]]
            continue
        ty, spec = native_specialize_impl(BaseBackend, val, False, name not in fn.do_not_specialize, True)
        if ty == "constexpr":
            sig[name], consts[name] = "constexpr", spec
            continue
        sig[name] = ty
        if spec == "D":
            attrs[(idx,)] = [["tt.divisibility", 16]]
    for name in fn.arg_names[len(launch.args):]:
        sig[name], consts[name] = "constexpr", kw[name]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _before_wait(ptx: str) -> dict:
    """Memory instructions of the PTX before and after its first griddepcontrol.wait."""
    at = ptx.find("griddepcontrol.wait")
    head, tail = ptx[:at], ptx[at:]

    def count(text: str, pattern: str) -> int:
        return len(re.findall(pattern, text))
    load, copy, write = r"ld\.global", r"cp\.async\.\w+\.shared", r"\bst\.global|\batom\.|\bred\."
    return dict(loads_before_wait=count(head, load), copies_before_wait=count(head, copy),
                stores_before_wait=count(head, write), loads_after_wait=count(tail, load),
                copies_after_wait=count(tail, copy))


def compile_case(n: int, k: int, m: int, dtype: str, bias: bool, gated: bool = False,
                 config: dict | None = None) -> dict:
    launch = record_launch(n, k, m, dtype, bias, gated, config)
    compiled = compile_launch(launch)
    ptx = compiled.asm["ptx"]
    kw = launch.kwargs
    name = launch.fn.fn.__name__
    return dict(kernel=name, grid=list(launch.grid), stream=name == "linear_stream_kernel", split=kw["SPLIT"],
                row_blocks=kw["RB"],
                **ptxas_usage(compiled), sm90=".target sm_90" in ptx, launch_pdl=bool(kw.get("launch_pdl")),
                pdl_waits=ptx.count("griddepcontrol.wait"), pdl_triggers=ptx.count("griddepcontrol.launch_dependents"),
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)), **_before_wait(ptx))


if __name__ == "__main__":
    print(json.dumps([compile_case(*case) for case in json.loads(sys.argv[1])]))
