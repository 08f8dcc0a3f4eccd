"""SASS instructions per weight in the main loop of the MoE GEMM kernels (CPU only).

Compiles the FC1 and FC2 launches that one call makes for the H200 (sm_90a)
with Triton's ahead-of-time path (tests/moe/sm90_compile.py, meta tensors, no
GPU), disassembles the cubin with the cuobjdump that Triton ships, takes the
largest loop (the span of the backward branch that closes it: one reduction
step) and divides its instruction count by the weights one thread handles per
step, (gate + up) x BN x BK / (32 x num_warps). Also reports registers, spills
and whether ptxas serialized the wgmma chain (its C7515 note).

    python3 benchmarks/sweeps/nvfp4_decode_sweep.py [--shapes mixtral,dsv3] \
        [--tokens 1,4,64] [--decodes arith,ptx] [--fmts nvfp4,bf16] [--out rows.json]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/, sparkinfer

SHAPES = {"mixtral": dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336),
          "dsv3": dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048),
          "qwen3": dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)}


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_lines(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction in `cubin`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]


def main_loop(ins: list[tuple[int, str]]) -> list[str]:
    """Instructions of the largest loop: from a backward branch's target to the branch."""
    spans = []
    for addr, op in ins:
        m = re.search(r"BRA[^0-9]*0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    return [op for addr, op in ins if lo <= addr <= hi]


def _opcode(op: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", op).split()[0]


def ptxas_note(ptx: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        log = subprocess.run([_tool("ptxas"), "-v", "--gpu-name", "sm_90a", f.name, "-o",
                              os.devnull], capture_output=True, text=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {"regs": int(regs.group(1)) if regs else -1,
            "spill": int(spill.group(1)) if spill else 0,
            "wgmma_serialized": "C7515" in log}


def rows_for(shape: str, fmt: str, tokens: int, decode: str, max_tokens: int) -> list[dict]:
    import torch

    from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, plan
    from tests.moe._util import meta_weights
    from tests.moe.sm90_compile import compile_sm90, record_launches

    caps = MoECaps(max_tokens=max_tokens, **SHAPES[shape])
    spec = MoESpec(weight_format=fmt)
    p = plan(caps, spec).with_changes(decode=decode)
    meta = dict(dtype=torch.bfloat16, device="meta")
    b = bind(p, allocate_scratch(p, "meta"), meta_weights(p),
             x=torch.empty(tokens, caps.hidden, **meta), out=torch.empty(tokens, caps.hidden, **meta),
             logits=torch.empty(tokens, caps.num_experts, device="meta"))
    out = []
    for launch in record_launches(b):
        name = launch.fn.fn.__name__
        if not name.startswith("moe_fc"):
            continue
        kw = launch.kwargs
        compiled = compile_sm90(launch)
        body = main_loop(sass_lines(compiled.asm["cubin"]))
        halves = 2 if name == "moe_fc1_kernel" and kw["GATED"] else 1
        per_thread = halves * kw["BN"] * kw["BK"] / (32 * kw["num_warps"])
        ops = collections.Counter(_opcode(op) for op in body)
        out.append(dict(shape=shape, fmt=fmt, tokens=tokens, decode=decode, kernel=name,
                        family=b.config.family, BN=kw["BN"], BK=kw["BK"], BM=kw["BM"],
                        loop_instructions=len(body), weights_per_thread=per_thread,
                        per_weight=round(len(body) / per_thread, 2),
                        top_ops=dict(ops.most_common(8)),
                        **ptxas_note(compiled.asm["ptx"])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral,dsv3")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--decodes", default="arith,ptx")
    ap.add_argument("--fmts", default="nvfp4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="JSON rows (default: print only)")
    a = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels cannot be compiled
    rows = []
    for shape in a.shapes.split(","):
        for fmt in a.fmts.split(","):
            for t in (int(x) for x in a.tokens.split(",")):
                for dec in (a.decodes.split(",") if fmt == "nvfp4" else ["arith"]):
                    for r in rows_for(shape, fmt, t, dec, a.max_tokens):
                        rows.append(r)
                        print(f"{r['shape']:8s} {r['fmt']:5s} T={r['tokens']:<4d} {r['decode']:5s} "
                              f"{r['kernel']:15s} {r['family']:7s} loop {r['loop_instructions']:5d} "
                              f"/ {r['weights_per_thread']:4.0f} w = {r['per_weight']:5.2f} "
                              f"per weight  regs {r['regs']:3d} spill {r['spill']} "
                              f"serialized {r['wgmma_serialized']}", flush=True)
    if a.out:
        from sparkinfer.bench.common import append_rows, metadata

        append_rows(a.out, rows, metadata())


if __name__ == "__main__":
    main()
