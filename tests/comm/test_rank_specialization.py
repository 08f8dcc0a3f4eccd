"""Every comm kernel that takes `rank` compiles the same code on every rank.

Triton compiles an integer argument equal to 1 as a constant (and 0 as an
int divisible by 16), so without `do_not_specialize=["rank"]` rank 1 runs a
differently compiled kernel; on the H200 that made the fused LL kernel's fp32
outputs differ by 1 ulp between ranks in ~8% of calls
(2x H200 stress runs; after the fix 0 of 3315 iterations differed; results in git
history: `git show 97a0fe7:benchmarks/results/gpu2_fused_stress_2xh200.json`).
Ranks must agree bitwise.
"""

import importlib
import pkgutil

import sparkinfer.comm as comm_pkg


def _unspecialized(fn) -> set:
    """Argument names the jit decorator exempts from specialization (compiled
    JITFunction or, under TRITON_INTERPRET, InterpretedFunction)."""
    if hasattr(fn, "params"):
        return {p.name for p in fn.params if p.do_not_specialize}
    return set(fn.kwargs.get("do_not_specialize") or ())


def _comm_kernels():
    """(name, jit function, argument names) of every top-level comm kernel."""
    for mod in pkgutil.walk_packages(comm_pkg.__path__, comm_pkg.__name__ + "."):
        if mod.name.endswith(".kernel"):
            for name, obj in vars(importlib.import_module(mod.name)).items():
                if name.endswith("_kernel") and hasattr(obj, "arg_names"):
                    yield name, obj, obj.arg_names


def test_comm_kernels_do_not_specialize_on_rank():
    with_rank = {name: fn for name, fn, args in _comm_kernels() if "rank" in args}
    assert len(with_rank) >= 8, sorted(with_rank)
    assert not [name for name, fn in with_rank.items() if "rank" not in _unspecialized(fn)]
