"""Kernel launches of one decode step, per preset: no count may grow.

A decode step is latency-bound: on an H200 (c1ec346, `sparkinfer bench decode
--profile`) a Qwen3-30B-A3B layer took 65 us against a 24 us floor, about 15 us
of it in six small kernels. Each launch here is one node of the step's CUDA
graph, so a change that adds one per layer fails this test (issue 28: decode at
the memory floor).

One greedy decode step (the engine's captured function: decoder forward +
sampling) of each tiny preset runs on the CPU inside `sparkinfer.bench.launches`'
counter: Triton launches by kernel name, torch operators that would launch a
GPU kernel by operator name. The step is warmed up once for real (the
interpreter runs its kernels: one-time plans and allocations happen there), then
counted with the launches recorded and not run (nothing in a step reads device
values on the host, so the kernels' outputs are not needed; recording takes
milliseconds where running takes a second). A host sync in the step fails too:
the step must stay capture-legal.

Per-layer counts are differences: the preset's 3-layer model against self-drafts
of its first 2 and 1 layers (the same weights and MoE layers). Layer 0 is dense in
Qwen3 and GLM, so both differences are one MoE layer and must be equal: the
counter cannot count nothing, or count something other than the layers, unseen.

On an H200 (at e57bcde with the engine's uncommitted work of the time) the same
eager step launched, per the torch profiler, exactly the kernels counted here:
35, 41 and 38, with `linear_preload_kernel` in place of the CPU's
`linear_stream_kernel` (`linear` picks its variant by machine), so the tables'
names are the CPU's and their totals hold on the GPU. Since 8875db0 (the top-k sum in
the norm after the layer, `RouteSum`) the totals are 33, 37 and 35: one launch fewer a
MoE layer, two for GLM (measured faster: docs/performance.md).
"""

import collections

import pytest
import torch
import triton
import triton.language as tl

from sparkinfer.bench.launches import LaunchCounter, count_launches, format_counts
from sparkinfer.engine import Engine, SamplingParams
from sparkinfer.models.build import build_decoder, self_draft
from sparkinfer.models.weights import Sharding

LAYERS = 3  # Qwen3 and GLM presets' own count (layer 0 dense); Mixtral's 2 raised to 3
L, N = "triton: linear_stream_kernel", "triton: add_rms_norm_kernel"
ATTN = {"triton: rope_qk_cache_kernel": 1, "triton: attention_kernel": 1}
# on one rank the top-k sum runs inside the residual add + RMSNorm after the layer (`RouteSum`:
# moe_reduce_kernel and one add_rms_norm_kernel, and GLM's torch add, folded into one launch)
MOE = {"triton: routing_kernel": 1, "triton: moe_fc1_kernel": 1, "triton: moe_fc2_kernel": 1,
       "triton: moe_reduce_norm_kernel": 1}
# The launches of one MoE layer, as of this commit: qkv, o and router projections, the norm
# after attention, rotary + cache write, attention, routing, the expert kernels and the top-k
# sum with the norm after the layer; GLM adds its shared expert's two projections.
LAYER = {
    "qwen3_moe-tiny": {L: 3, N: 1, **ATTN, **MOE},  # 10
    "glm4_moe-tiny": {L: 5, N: 1, **ATTN, **MOE},  # 12
    "mixtral-tiny": {L: 3, N: 1, **ATTN, **MOE},  # 10
}
# The launches of the whole step at LAYERS layers, as of this commit: the layers, the embedding
# lookup and its norm, the LM head, and the sampler's two (a row's chunks, then their argmax; one
# program a row took 69 us of a 795 us Qwen3-30B-A3B step on an H200).
SAMPLE = {"triton: _argmax_partials_kernel": 1, "triton: _gumbel_argmax_kernel": 1}
STEP = {
    # layer 0 dense: gate_up and down projections (silu applied as down loads its input)
    "qwen3_moe-tiny": {L: 11, N: 5, "triton: rope_qk_cache_kernel": 3, "triton: attention_kernel": 3,
                       **{k: 2 for k in MOE}, "torch: embedding": 1, **SAMPLE},  # 33
    "glm4_moe-tiny": {L: 15, N: 5, "triton: rope_qk_cache_kernel": 3, "triton: attention_kernel": 3,
                      **{k: 2 for k in MOE}, "torch: embedding": 1, **SAMPLE},  # 37
    "mixtral-tiny": {L: 10, N: 4, "triton: rope_qk_cache_kernel": 3, "triton: attention_kernel": 3,
                     **{k: 3 for k in MOE}, "torch: embedding": 1, **SAMPLE},  # 35
}
UPDATE = ("Update LAYER / STEP in tests/models/test_launch_count.py only with a measurement showing "
          "the step did not get slower (`sparkinfer bench decode` on a GPU, before and after).")


def _diff(a, b) -> dict:
    """a - b per key, negatives kept (Counter subtraction drops them)."""
    return {k: a.get(k, 0) - b.get(k, 0) for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)}


def _check(what: str, measured, budget: dict):
    """Fail when any count differs from the budget: a growth names the kernels that grew; a
    drop asks for the table to be lowered (slack would hide a later regression)."""
    delta = _diff(measured, budget)
    lines = "\n".join(f"  {k}: {budget.get(k, 0)} -> {measured.get(k, 0)} ({d:+d})" for k, d in delta.items())
    total, allowed = sum(measured.values()), sum(budget.values())
    grew = {k: d for k, d in delta.items() if d > 0}
    assert not grew, (f"{what}: launches grew ({allowed} -> {total}); kernels that grew:\n{lines}\n{UPDATE}\n"
                      f"measured:\n{format_counts(measured)}")
    assert not delta, (f"{what}: fewer launches than the table ({allowed} -> {total}):\n{lines}\n"
                       "Lower LAYER / STEP to these counts, so a later regression cannot hide in the slack.")


def _step_launches(dec, rows: int) -> collections.Counter:
    """Launches of one greedy decode step of `rows` rows at Q = 1 (warmed up once)."""
    engine = Engine(dec, max_batch=2, graphs=False)
    inputs, run = engine._graph_step(engine.bucket(rows), 1, False)  # run: what a CUDA graph captures
    inputs.fill([3] * rows, [4] * rows, list(range(rows)), [SamplingParams()] * rows, engine.pad_slot)
    with torch.no_grad():
        counter = count_launches(run, warmup=1, execute=False)
    assert not counter.syncs, f"host sync in a decode step:\n{counter.table()}"
    return counter.counts


@pytest.mark.parametrize("preset", list(LAYER))
def test_decode_step_launches_do_not_grow(ckpt_dir, preset):
    path = ckpt_dir(preset) if preset != "mixtral-tiny" else ckpt_dir(preset, layers=LAYERS)
    dec = build_decoder(path, Sharding(), device="cpu", max_batch=2, max_len=16)
    assert len(dec.w.layers) == LAYERS
    by_layers = {k: _step_launches(self_draft(dec, k, max_batch=2, max_len=16), 1) for k in range(1, LAYERS)}
    step = by_layers[LAYERS] = _step_launches(dec, 1)
    layer, before = _diff(by_layers[3], by_layers[2]), _diff(by_layers[2], by_layers[1])
    print(f"{preset}: {sum(step.values())} launches a step, {sum(layer.values())} a MoE layer\n"
          f"step:\n{format_counts(step)}\nlayer:\n{format_counts(layer)}")

    assert sum(by_layers[1].values()) > 0 and sum(layer.values()) > 0, "the counter saw no launches"
    assert layer == before, f"{preset}: MoE layers 1 and 2 launch differently: {before} vs {layer}"
    _check(f"{preset}, one MoE layer", layer, LAYER[preset])
    _check(f"{preset}, one decode step of {LAYERS} layers", step, STEP[preset])
    # a launch per row would pass at one row: the step's launches may not depend on the batch
    assert _step_launches(dec, 2) == step, f"{preset}: a step of 2 rows launches differently from one of 1"


@triton.jit
def _copy_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)


def _launch_copy(x, y):
    _copy_kernel[(1,)](x, y, x.numel(), BLOCK=8)


def test_counter_counts_launches_not_views_and_restores():
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run
    x, y = torch.arange(8.0), torch.zeros(8)
    with LaunchCounter() as c:
        _launch_copy(x, y)
        _copy_kernel.warmup(x, y, 8, BLOCK=8, grid=(1,))  # compiles only: not a launch
        z = (x.view(2, 4).t() + 1).sum()  # two kernels; the view and transpose launch none
        torch.empty(4)
        z.item()
    assert torch.equal(y, x)  # executed
    assert dict(c.counts) == {"triton: _copy_kernel": 1, "torch: add": 1, "torch: sum": 1,
                              "sync: _local_scalar_dense": 1}, c.table()
    assert c.total == 3 and c.syncs == {"sync: _local_scalar_dense": 1}
    assert InterpretedFunction.run is original  # restored on exit
    _launch_copy(x, y)
    assert c.total == 3  # nothing counted after exit

    y.zero_()
    with LaunchCounter(execute=False) as rec:
        _launch_copy(x, y)
    assert rec.counts == {"triton: _copy_kernel": 1} and not y.any()  # recorded, not run
