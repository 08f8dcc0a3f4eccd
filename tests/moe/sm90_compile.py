"""Compile the MoE kernels a plan launches for the H200 (sm_90) on a CPU machine.

`record_launches(binding)` runs `run` with the kernels replaced by recorders
(tensors may live on the meta device, so real model shapes cost no memory);
`compile_sm90(launch)` compiles one recorded launch with Triton's ahead-of-time
path (ptxas included) and returns the compiled kernel (n_regs, n_spills,
metadata.shared).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from unittest import mock

import torch

import sparkinfer.moe.runner as moe_run

_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
        torch.int32: "*i32", torch.uint8: "*u8", torch.float8_e4m3fn: "*fp8e4nv"}
KERNELS = ("moe_fc1_kernel", "moe_act_kernel", "moe_fc2_kernel", "moe_reduce_kernel",
           "sort_count_kernel", "sort_scatter_kernel", "moe_quant_kernel",
           "nvfp4_dequant_kernel")


@dataclass
class Launch:
    fn: object
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, fn, sink):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        return lambda *a, **k: self.sink.append(Launch(self.fn, grid, a, k))


def record_launches(binding) -> list[Launch]:
    """Launches `run(binding)` would make, in order (nothing executes)."""
    import sparkinfer.moe.routing.launch as routing_launch

    sink: list[Launch] = []
    patches = [mock.patch.object(moe_run, n, _Recorder(getattr(moe_run, n), sink))
               for n in KERNELS]
    patches.append(mock.patch.object(routing_launch, "routing_kernel",
                                     _Recorder(routing_launch.routing_kernel, sink)))
    for p in patches:
        p.start()
    try:
        moe_run.run(binding)
    finally:
        for p in patches:
            p.stop()
    return sink


def ptxas_usage(compiled) -> dict:
    """Registers, spill bytes and shared memory of a compiled kernel, from `ptxas -v`."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(f.name)
    log = res.stderr + res.stdout
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {"regs": int(regs.group(1)) if regs else -1,
            "spill": int(spill.group(1)) if spill else 0,
            "shared": compiled.metadata.shared}


def compile_sm90(launch: Launch):
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    fn = launch.fn
    names = fn.arg_names
    kw = dict(launch.kwargs)
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages", "launch_pdl",
                                      "launch_cooperative_grid") if k in kw}
    sig, consts, attrs = {}, {}, {}
    for idx, (name, val) in enumerate(zip(names, launch.args)):
        # the launcher's specialization: 16-aligned pointers and ints divisible by 16
        if isinstance(val, torch.Tensor) or (type(val) is int and val % 16 == 0):
            attrs[(idx,)] = [["tt.divisibility", 16]]
        if isinstance(val, TensorDescriptor):  # TMA: the launcher's own type string
            sig[name] = mangle_type(val)
        elif isinstance(val, torch.Tensor):
            sig[name] = _PTR[val.dtype]
        elif isinstance(val, bool):
            sig[name] = "i1"
        elif isinstance(val, int):
            sig[name] = "i32"
        else:
            sig[name] = "fp32"
    defaults = inspect.signature(fn.fn).parameters
    for name in names[len(launch.args):]:
        sig[name] = "constexpr"
        consts[name] = kw[name] if name in kw else defaults[name].default
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_plan_launches(shape: dict, fmt: str, tokens: int, max_tokens: int,
                          spec_kw: dict | None = None, decode: str = "arith", tile: list | None = None) -> list[dict]:
    """Compile every launch of one call (router included) at real dims (meta
    tensors); usage rows per kernel. tile: a `tuning` tile row's fields after its name
    (BM, BN1, BN2, warps, programs per SM, BK[, FC1 passes[, rescale]]) forced on the plan."""
    from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, plan
    from sparkinfer.moe.tuning import _tile
    from tests.moe._util import meta_weights

    caps = MoECaps(max_tokens=max_tokens, **shape)
    spec = MoESpec(weight_format=fmt, **(spec_kw or {}))
    p = plan(caps, spec).with_changes(decode=decode)
    if tile is not None:
        p = _tile(p, *tile[:6], p.config_for(tokens), *tile[6:])
    h, e = caps.hidden, caps.num_experts
    meta = dict(dtype=torch.bfloat16, device="meta")
    bias = (torch.empty(e, device="meta") if spec.routing == "sigmoid_grouped" else None)
    b = bind(p, allocate_scratch(p, "meta"), meta_weights(p), x=torch.empty(tokens, h, **meta),
             out=torch.empty(tokens, h, **meta), logits=torch.empty(tokens, e, device="meta"),
             bias=bias)
    rows = []
    for launch in record_launches(b):
        compiled = compile_sm90(launch)
        # byte loads left synchronous (not turned into cp.async by the pipeliner)
        sync_u8 = len(re.findall(r"tt\.load [^\n]*!tt\.ptr<i8>", compiled.asm["ttgir"]))
        # 2-D bf16 tiles loaded synchronously (each K step waits on memory)
        sync_tiles = len(re.findall(r"tt\.load [^\n]*tensor<\d+x\d+x!tt\.ptr<bf16>", compiled.asm["ttgir"]))
        rows.append(dict(kernel=launch.fn.fn.__name__, family=b.config.family,
                         grid=list(launch.grid), **ptxas_usage(compiled),
                         sm90=".target sm_90" in compiled.asm["ptx"], sync_u8_loads=sync_u8, sync_bf16_tiles=sync_tiles,
                         launch_pdl=bool(launch.kwargs.get("launch_pdl")),
                         pdl_waits=compiled.asm["ptx"].count("griddepcontrol.wait"),
                         pdl_triggers=compiled.asm["ptx"].count("griddepcontrol.launch_dependents"),
                         mma=sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)[\w.]*",
                                                   compiled.asm["ptx"]))),
                         cvt_e4m3=len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32",
                                                 compiled.asm["ptx"])),
                         dequant_experts=b.config.dequant_experts, block_m=b.config.block_m,
                         fp8_rescale=b.config.fp8_rescale))
    return rows


if __name__ == "__main__":
    # python -m tests.moe.sm90_compile '<json: [[shape, fmt, tokens, max_tokens], ...]>'
    # (run without TRITON_INTERPRET: the interpreter's kernels cannot be compiled)
    import json
    import sys

    out = [compile_plan_launches(*case) for case in json.loads(sys.argv[1])]
    print(json.dumps(out))
