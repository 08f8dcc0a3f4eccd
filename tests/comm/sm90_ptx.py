"""Compile the fused-norm LL kernel for the H200 (sm_90) on a CPU machine and
read facts off its PTX (tests/comm/test_ll_zeroing.py). Run as a module in a
process without TRITON_INTERPRET (interpreted kernels cannot be compiled):

    python -m tests.comm.sm90_ptx   # prints one JSON line
"""

from __future__ import annotations

import json
import re

# The GPU shape of test_fused_norm's g_t8_h4096_ll_inplace: bf16, T = 8, H = 4096,
# 8 one-piece blocks per row of 256 words each, 4 warps (fused_norm.launch).
ONE_PIECE = dict(OP=4, W=2, BLOCK_W=256, HALF=True, EPW=2, NP=8, ONE_PASS=False, ONE_PIECE=True,
                 INTERPRET=False, SYNC=False)
_PTRS = {"p_x": "*bf16", "p_res": "*bf16", "p_w": "*bf16", "p_out": "*bf16", "p_res_out": "*bf16",
         "p_table": "*i64"}


def ll_norm_ptx(consts: dict, num_warps: int = 4) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparkinfer.comm.fused_norm.kernel import all_reduce_add_rms_norm_ll_kernel as kernel

    names = kernel.arg_names
    sig = {n: _PTRS.get(n, "constexpr" if n in consts else "fp32" if n == "eps" else
                       "i64" if n == "timeout_ns" else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _PTRS}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps)).asm["ptx"]


def line_zeroing_is_fenced(ptx: str) -> bool:
    """Whether the first store of a zero register after the kernel's last spin loop
    (the one-piece block zeroing its partial-sum line once read) has a block barrier
    (bar.sync) in its basic block before it."""
    lines = ptx.splitlines()
    last_spin = max(i for i, line in enumerate(lines) if line.startswith("SPIN_LOOP:"))
    zero = set()
    for i in range(last_spin, len(lines)):
        mov = re.match(r"\s*mov\.b64\s+(%rd\d+), 0;", lines[i])
        if mov:
            zero.add(mov.group(1))
        st = re.search(r"st\.global\.b64 \[ %rd\d+ \+ 0 \], \{ (%rd\d+) \}", lines[i])
        if st and st.group(1) in zero:
            j = i
            while not re.match(r"\$L__BB\d+_\d+:", lines[j]):
                j -= 1
            return any("bar.sync" in line for line in lines[j:i])
    raise AssertionError("no store of zeros after the last spin loop: the kernel changed shape")


def main() -> int:
    print(json.dumps(dict(one_piece_fenced=line_zeroing_is_fenced(ll_norm_ptx(ONE_PIECE)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
