"""`sparkinfer.linear` split-K sweep (one GPU): the source of launch.py's SPLIT_* rule.

For the decode projections of Qwen3-30B-A3B, GLM-4.5-Air and Mixtral-8x7B at M 1
and 8: torch.mm, the planned launch (`linear(..., sync=)`: its error against a
float64 reference, a repeat bitwise, the semaphores zero after) and
linear_rows_kernel at BN 64 / BK 128 x stages {4, 6} x split {1..16}. Each timed
as one CUDA graph over 4-8 distinct weights (no L2 reuse), median of 5 x 10 replays.

    python3 benchmarks/sweeps/linear_sweep.py benchmarks/results/sweeps/linear_split_sweep_h200.json
"""

import json
import sys

import torch
import triton

from sparkinfer.bench.common import metadata
from sparkinfer.linear import linear, linear_sync
from sparkinfer.linear.kernel import linear_rows_kernel
from sparkinfer.linear.launch import tile_for

SHAPES = {"qwen3.qkv": (5120, 2048), "qwen3.o": (2048, 4096), "qwen3.router": (128, 2048),
          "glm.qkv": (14336, 4096), "glm.o": (4096, 12288), "glm.dense_gate_up": (21888, 4096),
          "glm.dense_down": (4096, 10944), "glm.shared_gate_up": (2816, 4096), "glm.shared_down": (4096, 1408),
          "mixtral.qkv": (6144, 4096), "mixtral.o": (4096, 4096), "mixtral.router": (8, 4096)}
SPLITS, STAGES, BN, BK = (1, 2, 3, 4, 6, 8, 12, 16), (4, 6), 64, 128


def graph_us(fn, reps: int = 10) -> float:
    """Median of 5 timings of `reps` replays of a graph of fn, per replay (us)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / reps)
    return sorted(ts)[2]


def forced(x, ws, outs, syncs, split: int, stages: int):
    """A call of every weight at a given split and pipeline depth (None: not a valid split)."""
    m, k = x.shape
    n = ws[0].shape[0]
    blocks, steps = triton.cdiv(n, BN), triton.cdiv(k, BK)
    ks = triton.cdiv(steps, split) * BK
    if split > steps or triton.cdiv(k, ks) != split:
        return None
    part = torch.empty((split, blocks * BN, 16), dtype=torch.float32, device=x.device)

    def call():
        for w, o, s in zip(ws, outs, syncs):
            linear_rows_kernel[(blocks, split)](
                x, w, w, o, part, s, m, n, k, ks, x.stride(0), w.stride(0), o.stride(0), BM=16, BN=BN, BK=BK,
                EVEN_K=k % BK == 0, SPLIT=split, HAS_BIAS=False, INTERPRET=False, num_warps=4, num_stages=stages)
    return call


def sweep_shape(name: str, n: int, k: int, sms: int) -> list[dict]:
    nw = 4 if n * k > 60e6 else 8
    ws = [(torch.randn(n, k, device="cuda") * k ** -0.5).bfloat16() for _ in range(nw)]
    syncs = [linear_sync(w) for w in ws]
    rows = []
    for m in (1, 8):
        x = torch.randn(m, k, device="cuda").bfloat16()
        ref = x.double() @ ws[0].double().t()
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
        base = dict(shape=name, N=n, K=k, M=m)
        us = graph_us(lambda: [torch.mm(x, w.t(), out=o) for w, o in zip(ws, outs)]) / nw  # noqa: B023
        rows.append(dict(base, impl="torch", us=us, gbs=n * k * 2 / us / 1e3))
        plan = tile_for(n, k, 2, sms)
        up = graph_us(lambda: [linear(x, w, out=o, sync=s) for w, o, s in zip(ws, outs, syncs)]) / nw  # noqa: B023
        err = ((outs[0].double() - ref).abs().max() / ref.abs().max()).item()
        first = outs[0].clone()
        linear(x, ws[0], out=outs[0], sync=syncs[0])
        repeat = torch.equal(first, outs[0]) and not any(bool(s.any()) for s in syncs)
        rows.append(dict(base, impl="planned", us=up, gbs=n * k * 2 / up / 1e3, max_err=err, repeat_ok=repeat,
                         split=plan["SPLIT"], stages=plan["num_stages"]))
        for st in STAGES:
            for split in SPLITS:
                call = forced(x, ws, outs, syncs, split, st)
                if call is None:
                    continue
                u = graph_us(call) / nw
                err = ((outs[0].double() - ref).abs().max() / ref.abs().max()).item()
                rows.append(dict(base, impl="sparkinfer", us=u, gbs=n * k * 2 / u / 1e3, max_err=err, split=split,
                                 stages=st, ctas=triton.cdiv(n, BN) * split))
        best = min((r for r in rows if r["M"] == m and r["impl"] == "sparkinfer"), key=lambda r: r["us"])
        print(f"{name:20s} M={m}: torch {us:6.2f} | planned {up:6.2f} (split {plan['SPLIT']}, err {err:.1e}, "
              f"repeat {repeat}) | best {best['us']:6.2f} split {best['split']} stages {best['stages']}", flush=True)
    return rows


def main(out: str) -> None:
    meta = metadata(None)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, (n, k) in SHAPES.items():
        rows += sweep_shape(name, n, k, sms)
        torch.cuda.empty_cache()
    json.dump([dict(meta, **r) for r in rows], open(out, "w"), indent=0)


if __name__ == "__main__":
    main(sys.argv[1])
