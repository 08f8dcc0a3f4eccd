"""Kernel launches of one decode step, per preset: the count must not grow.

A decode step is latency-bound: on an H200 (c1ec346, `sparkinfer bench decode
--profile`) a Qwen3-30B-A3B layer took 65 us against a 24 us floor, about 15 us
of it in six small kernels. Each launch here is one node of the step's CUDA
graph, so a change that adds one per layer fails this test; one that removes
some should lower the budget.

One greedy decode step of B = 2 rows (the engine's captured function: decoder
forward + sampling) of each tiny preset runs on the CPU with every Triton launch
recorded and not executed (the launch path and its planning run; nothing in a
step reads device values on the host, so the kernels' outputs are not needed),
and every torch operator that would launch a GPU kernel counted through a
dispatch mode (views and allocations launch none). A host sync in the step
(`.item()`, `.tolist()`) fails the test too: the step must stay capture-legal.
"""

import collections
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparkinfer.engine import Engine, SamplingParams
from sparkinfer.models.build import build_decoder
from sparkinfer.models.weights import Sharding

# preset -> launches of one decode step at B = 2 (layers: Qwen3 3 with one dense,
# GLM 3 with one dense and a shared expert, Mixtral 2), as of this commit
# (the per-row sampler is two launches: a row's chunks, then their argmax; one program a
# row took 69 us of a 795 us Qwen3-30B-A3B step on an H200)
BUDGET = {"qwen3_moe-tiny": 35, "glm4_moe-tiny": 41, "mixtral-tiny": 27}
# aten operators that allocate or alias and launch no kernel
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
         "lift_fresh", "set_", "resize_"}
_SYNCS = {"_local_scalar_dense", "item", "equal", "is_nonzero"}


class _TorchLaunches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _FREE:
            self.ops[("sync: " if name in _SYNCS else "torch: ") + name] += 1
        return func(*args, **(kwargs or {}))


def step_launches(dec, rows: int = 2) -> collections.Counter:
    """Launches of one greedy decode step of `rows` rows (Triton kernels by name, torch
    operators by name, host syncs marked)."""
    from triton.runtime.interpreter import InterpretedFunction

    engine = Engine(dec, max_batch=rows, graphs=False)
    params = SamplingParams()
    bufs, _ = engine._graph_step(engine.bucket(rows), 1, False)
    bufs.fill([3] * rows, [4] * rows, list(range(rows)), [params] * rows, engine.pad_slot)
    counts = collections.Counter()

    def record(self, *args, grid, warmup, **kwargs):
        counts["triton: " + self.fn.__name__] += 1

    mode = _TorchLaunches()
    with torch.no_grad(), mock.patch.object(InterpretedFunction, "run", record), mode:
        engine._eager_step(bufs, False)
    return counts + mode.ops


@pytest.mark.parametrize("preset", list(BUDGET))
def test_decode_step_launches_do_not_grow(ckpt_dir, preset):
    dec = build_decoder(ckpt_dir(preset), Sharding(), device="cpu", max_batch=2, max_len=16)
    counts = step_launches(dec)
    total = sum(counts.values())
    table = "\n".join(f"  {n:5d}  {k}" for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    assert not any(k.startswith("sync: ") for k in counts), f"host sync in a decode step:\n{table}"
    assert total <= BUDGET[preset], f"{preset}: {total} launches per decode step > budget {BUDGET[preset]}:\n{table}"
    print(f"{preset}: {total} launches\n{table}")
