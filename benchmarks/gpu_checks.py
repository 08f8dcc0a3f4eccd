"""GPU evidence for sparkinfer.comm on 2 ranks (issues 2 and 3), one section at a time.

    python3 benchmarks/gpu_checks.py                          # every section, 2 GPUs (~2-3 min)
    python3 benchmarks/gpu_checks.py --only smoke,timeout     # a subset
    python3 benchmarks/gpu_checks.py --dry-run                # 2 CPU ranks, Triton interpreter, tiny sizes

Sections (each in fresh rank processes under a launcher timeout: a hang or a sticky
CUDA error fails that section only):
  smoke      all_reduce (every algorithm, auto), reduce_scatter, all_gather; bf16/fp16/fp32;
             1 element .. capacity, capacity + 1 (auto -> NCCL, explicit algorithms raise).
  graph      every op: eager -> capture -> replay -> new inputs -> replay -> eager -> replay; a
             graph of 3 collectives replayed 101 times (parity); eager on its channel (handoff).
  replay10k  22,000 (>= 10,000) interleaved replays of two 3-collective graphs on two streams and
             channels: 66,003 ops per channel, past the LL flag's 16-bit sequence wrap.
  timeout    rank 1 skips an all_reduce -> CollectiveTimeout naming rank 1 (timeout_s=2); size
             and op mismatches -> CollectiveMismatch.
  lifecycle  200 cycles of create / eager / capture / replay / throwaway + rollback / close:
             free device memory and IPC mappings return to their starting values.
  guard      (only with --only) capture a size whose launch key was warmed by another size.
Results are exact (integer payloads, outputs poisoned with NaN before each run). Prints
PASS/FAIL per section, appends JSON rows to --out; exit status 0 when all passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `import sparkinfer` without an install
from sparkinfer.bench.collectives import Collective, CountingBackend, Ctx, free_device_bytes, poison, read_epoch, step  # noqa: E402
from sparkinfer.bench.common import append_rows, metadata  # noqa: E402
from sparkinfer.bench.timing import Graph  # noqa: E402

SECTIONS = ("smoke", "graph", "replay10k", "timeout", "lifecycle")
EXTRA = ("guard",)  # run only when named in --only
# launcher backstops, seconds (first runs include Triton compiles; the sum stays under 10 minutes)
TIMEOUTS = {"smoke": 200, "graph": 120, "replay10k": 120, "timeout": 90, "lifecycle": 180, "guard": 90}


def options(dry: bool) -> dict:
    """Per-section sizes; the dry run shrinks everything to what the interpreter does in seconds."""
    return {"dry": dry, "smoke_cap": 4096 if dry else 1 << 20, "smoke_dtypes": ["bfloat16", "float16", "float32"],
            "smoke_sizes": [1, 2, 3, 17, 64, 1000] if dry else [1, 2, 3, 8, 15, 16, 17, 63, 64, 65, 255, 1000, 2048,
                                                                 2049, 4097, 65539],
            "graph_cap": 1 << 14 if dry else 1 << 21, "parity_replays": 5 if dry else 101,
            "replays": 20 if dry else 22_000, "cycles": 3 if dry else 200}


def _comm(opt, cap, **kw):
    from sparkinfer.comm import Communicator

    return Communicator(capacity_bytes=cap, timeout_s=kw.pop("timeout_s", 10.0), **kw)


# --------------------------------------------------------------------------- a. smoke
def sec_smoke(world, opt) -> dict:
    import torch

    from sparkinfer.comm import select_algorithm
    from sparkinfer.comm.topology import ALGORITHMS
    from sparkinfer.errors import CapacityError

    cap = opt["smoke_cap"]
    comm = _comm(opt, cap)
    ctx, W = Ctx(world, comm), world.world_size
    fails, checks, over = [], 0, {}

    def expect(c, label, seed=1):
        nonlocal checks
        checks += 1
        try:
            step(ctx, [c], seed, c.call, label, fails)
        except Exception as e:  # noqa: BLE001 - every failure is reported, the section goes on
            fails.append(f"{label} {c.name}: {type(e).__name__}: {e}")

    for di, dname in enumerate(opt["smoke_dtypes"]):
        dtype = getattr(torch, dname)
        cap_el = cap // dtype.itemsize
        sizes = opt["smoke_sizes"] if di == 0 else opt["smoke_sizes"][::3]
        sizes = sorted({n for n in sizes if n <= cap_el} | {cap_el - 1, cap_el})
        for alg in ALGORITHMS + ("auto",):
            for n in sizes:
                staged = n * dtype.itemsize * (2 if alg == "ll" and n * dtype.itemsize % 4 == 0 else 1)
                if staged <= cap:  # LL stages 2 bytes per byte
                    expect(Collective(comm, "ar", n, dtype, alg), "ar")
        for n in sorted({W * max(1, n // W) for n in sizes}):
            expect(Collective(comm, "rs", n, dtype), "rs")
        for m in sorted({max(1, n // W) for n in sizes}):
            expect(Collective(comm, "ag", m, dtype), "ag")
        # one element past the capacity: auto falls back to NCCL, explicit algorithms refuse
        c = Collective(comm, "ar", cap_el + 1, dtype, "auto")
        picked = select_algorithm(comm.caps, (cap_el + 1) * dtype.itemsize, dtype)
        if picked != "nccl":
            fails.append(f"auto at capacity+1 ({dname}) picked {picked}, not nccl")
        expect(c, "ar-over-capacity")
        for alg in [a for a in ALGORITHMS if a != "nccl"]:
            try:
                Collective(comm, "ar", cap_el + 1, dtype, alg).call()
                fails.append(f"{alg} at capacity+1 ({dname}) did not raise CapacityError")
            except CapacityError:
                pass
        for kind, n in (("rs", W * (cap_el // W) + W), ("ag", cap_el // W + 1)):
            c = Collective(comm, kind, n, dtype)
            try:
                step(ctx, [c], 1, c.call, f"{kind}-over-capacity", fails)
                over[f"{kind}:{dname}"] = "served (NCCL)"
            except CapacityError:
                over[f"{kind}:{dname}"] = "CapacityError"
    comm.synchronize()
    comm.close()
    return {"ok": not fails, "checks": checks, "capacity": cap, "rs_ag_over_capacity": over, "failures": fails[:20]}


# --------------------------------------------------------------------------- b. graph
GRAPH_CASES = (  # (channel id, kind, elements, algorithm)
    ("ar_ll", "ar", 10_000, "ll"),
    ("ar_oneshot", "ar", 10_000, "oneshot"),
    ("ar_twoshot", "ar", 300_001, "twoshot"),
    ("ar_nccl", "ar", 10_000, "nccl"),
    ("ar_auto_small", "ar", 4_097, "auto"),
    ("ar_auto_large", "ar", 500_000, "auto"),
    ("rs", "rs", 300_002, None),
    ("ag", "ag", 5_003, None),
)


def sec_graph(world, opt) -> dict:
    import torch

    cap = opt["graph_cap"]
    comm = _comm(opt, cap, channel_ids=[c[0] for c in GRAPH_CASES] + ["odd"])
    ctx, fails, per_op = Ctx(world, comm), [], {}
    scale = cap / (1 << 21)  # dry runs shrink the sizes with the capacity
    for cid, kind, n, alg in GRAPH_CASES:
        n = max(2, int(n * scale))
        n -= n % 2 if kind == "rs" else 0
        c = Collective(comm, kind, n, torch.bfloat16, alg or "auto")
        before = len(fails)
        try:
            s = ctx.stream()
            step(ctx, [c], 1, c.call, f"{cid} eager", fails)
            g = ctx.graph(c.call, s, cid)
            step(ctx, [c], 2, g.replay, f"{cid} replay", fails)
            step(ctx, [c], 3, g.replay, f"{cid} replay new inputs", fails)
            step(ctx, [c], 4, c.call, f"{cid} eager after replay", fails)
            on_channel = lambda s=s, cid=cid, c=c: ctx.eager_on_channel(s, cid, c.call)  # noqa: E731
            step(ctx, [c], 5, on_channel, f"{cid} eager on graph channel", fails)
            step(ctx, [c], 6, g.replay, f"{cid} replay after eager", fails)
            g.release()
        except Exception as e:  # noqa: BLE001
            fails.append(f"{cid}: {type(e).__name__}: {e}")
        per_op[cid] = "PASS" if len(fails) == before else "FAIL"

    # a graph with an odd number of collectives: slot parity must alternate on every replay
    n1, n2, n3 = (max(2, int(v * scale)) for v in (1_000, 100_001, 777))
    odd = [Collective(comm, "ar", n1, torch.bfloat16, "ll"), Collective(comm, "ar", n2, torch.bfloat16, "twoshot"),
           Collective(comm, "ag", n3, torch.bfloat16)]
    run_all = lambda: [c.call() for c in odd]  # noqa: E731
    before = len(fails)
    try:
        s = ctx.stream()
        step(ctx, odd, 10, run_all, "odd eager", fails)
        g = ctx.graph(run_all, s, "odd")
        for i in range(opt["parity_replays"]):
            step(ctx, odd, 100 + i, g.replay, f"odd replay {i}", fails)
        # handoff: one eager collective on the graph's channel flips the parity the graph sees next
        step(ctx, odd[:1], 7, lambda: ctx.eager_on_channel(s, "odd", odd[0].call), "odd handoff eager", fails)
        for i in range(5):
            step(ctx, odd, 300 + i, g.replay, f"odd replay after handoff {i}", fails)
        g.release()
    except Exception as e:  # noqa: BLE001
        fails.append(f"odd: {type(e).__name__}: {e}")
    per_op["odd_3_collectives"] = "PASS" if len(fails) == before else "FAIL"
    try:
        comm.synchronize()
    except Exception as e:  # noqa: BLE001
        fails.append(f"synchronize: {type(e).__name__}: {e}")
    comm.close()
    return {"ok": not fails, "per_op": per_op, "parity_replays": opt["parity_replays"], "failures": fails[:20]}


# --------------------------------------------------------------------------- c. replay10k
def sec_replay10k(world, opt) -> dict:
    import torch

    dry, bf = opt["dry"], torch.bfloat16
    comm = _comm(opt, 1 << 14 if dry else 2 << 20, channel_ids=("target", "draft"))
    ctx, fails = Ctx(world, comm), []
    d = 64 if dry else 1  # shrink for the interpreter
    sets = {
        "target": [Collective(comm, "ar", 4096 // d, bf), Collective(comm, "rs", 131072 // d, bf),
                   Collective(comm, "ar", 524288 // d, bf)],
        "draft": [Collective(comm, "ar", 1024 // d, bf), Collective(comm, "ag", 8192 // d, bf),
                  Collective(comm, "ar", 262144 // d, bf, "twoshot")],
    }
    streams = {cid: ctx.stream() for cid in sets}
    graphs, seed = {}, 1
    for cid, colls in sets.items():
        for c in colls:
            c.load(seed)
        graphs[cid] = ctx.graph(lambda colls=colls: [c.call() for c in colls], streams[cid], cid)
    ctx.sync()
    N, checks = opt["replays"], 0
    every = max(1, N // 10)
    t0 = time.perf_counter()
    for i in range(N):
        for cid in ("target", "draft"):
            with ctx.use(streams[cid]):
                graphs[cid].replay()
        if (i + 1) % every == 0:
            ctx.sync()
            checks += 1
            for colls in sets.values():
                for c in colls:
                    bad = c.mismatch(seed)
                    if bad:
                        fails.append(f"after {i + 1} replays: {bad}")
            seed += 1
            for colls in sets.values():
                for c in colls:
                    c.load(seed)
                    poison(c.out)
            ctx.sync()
    ctx.sync()
    secs = time.perf_counter() - t0
    try:
        comm.synchronize()
    except Exception as e:  # noqa: BLE001
        fails.append(f"synchronize: {type(e).__name__}: {e}")
    eager_runs = 1 if ctx.cuda else 2  # the warm-up (the CPU stand-in also runs fn at "capture")
    epochs = {}
    for cid in sets:
        got, want = read_epoch(comm.pool.get(cid)), 3 * (N + eager_runs)
        epochs[cid] = {"epoch": got, "expected": want}
        if got is not None and got != want:
            fails.append(f"channel {cid!r} epoch {got}, expected {want} (3 kernels x (warm-up + {N} replays))")
        rec = comm.pool.get(cid).error_record()
        if any(rec):
            fails.append(f"channel {cid!r} error record {rec}")
    for g in graphs.values():
        g.release()
    comm.close()
    return {"ok": not fails, "replays": N, "checks": checks, "seconds": round(secs, 3),
            "us_per_replay_pair": round(secs / N * 1e6, 2), "epochs": epochs, "failures": fails[:20]}


# --------------------------------------------------------------------------- d. timeout
def _expect_error(comm, call, kinds) -> tuple:
    """Run call() then comm.synchronize(); return (error or None, seconds). On CPU
    ranks the interpreted kernel is synchronous and the call itself raises."""
    t0 = time.perf_counter()
    err = None
    try:
        call()
        comm.synchronize()
    except kinds as e:
        err = e
    return err, time.perf_counter() - t0


def sec_timeout(world, opt) -> dict:
    import torch
    import torch.distributed as dist

    from sparkinfer.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout

    rank, fails, out, tmo, bf = world.rank, [], {}, 2.0, torch.bfloat16
    # 1. rank 1 skips one all_reduce, for each of our algorithms (fresh communicator each)
    for alg in ("ll", "oneshot", "twoshot"):
        comm = _comm(opt, 1 << 16, timeout_s=tmo)
        c = Collective(comm, "ar", 1024, bf, alg)
        step(Ctx(world, comm), [c], 1, c.call, f"{alg} warm-up", fails)
        comm.synchronize()
        if rank == 0:
            err, secs = _expect_error(comm, c.call, CollectiveError)
            out[f"timeout_{alg}"] = f"{secs:.2f}s {type(err).__name__} peer={getattr(err, 'peer', None)}"
            out[f"timeout_{alg}_message"] = str(err)[:300] if err else None
            if not isinstance(err, CollectiveTimeout) or err.peer != 1:
                fails.append(f"{alg}: rank 0 expected CollectiveTimeout naming peer 1, got {out[f'timeout_{alg}']}")
            elif not tmo * 0.5 <= secs <= tmo + 8:
                fails.append(f"{alg}: timeout raised after {secs:.2f} s, expected about {tmo} s")
            try:  # the channel stays broken: later calls raise at once instead of mixing data
                c.call()
                fails.append(f"{alg}: a call after the timeout did not raise")
            except CollectiveError:
                pass
        else:
            err, _ = _expect_error(comm, lambda: None, CollectiveError)
            out[f"skipper_{alg}"] = f"{type(err).__name__}: {err}"[:200] if err else None
        comm.close()
    # 2. size mismatch (N vs 2N; LL and one-shot) and op mismatch (all_reduce vs all_gather)
    for case in ("size_ll", "size_oneshot", "op"):
        comm = _comm(opt, 1 << 16, timeout_s=tmo)
        if case.startswith("size"):
            c = Collective(comm, "ar", 2048 * (1 + rank), bf, case.split("_")[1])
        else:
            c = Collective(comm, "ar", 2048, bf, "oneshot") if rank == 0 else Collective(comm, "ag", 1024, bf)
        err, secs = _expect_error(comm, c.call, CollectiveError)
        out[f"{case}_mismatch"] = f"{secs:.2f} s: {type(err).__name__}: {err}"[:300] if err else f"{secs:.2f} s: none"
        seen = [None, None]
        dist.all_gather_object(seen, isinstance(err, CollectiveMismatch))
        out[f"{case}_mismatch_ranks"] = [r for r, m in enumerate(seen) if m]
        if not any(seen):
            fails.append(f"{case} mismatch: no rank raised CollectiveMismatch (this rank: {out[f'{case}_mismatch']})")
        comm.close()
    return {"ok": not fails, **out, "failures": fails}


# --------------------------------------------------------------------------- e. lifecycle
def sec_lifecycle(world, opt) -> dict:
    import torch

    from sparkinfer.comm.memory import make_backend

    counter = CountingBackend(make_backend(world.device))
    fails, free, worst = [], [], (0, 0)
    cycles = opt["cycles"]
    cuda = world.backend == "cuda"
    t0 = time.perf_counter()
    free.append(free_device_bytes(cuda))  # before anything of this section exists
    for k in range(cycles):
        comm = _comm(opt, 1 << 16, channel_ids=("g",), backend=counter)
        ctx = Ctx(world, comm)
        c = Collective(comm, "ar", 3000, torch.bfloat16, "oneshot")
        step(ctx, [c], k, c.call, f"cycle {k} eager", fails)
        s = ctx.stream()
        g = ctx.graph(c.call, s, "g")
        step(ctx, [c], k + 1, g.replay, f"cycle {k} replay", fails)
        cp = comm.pool.checkpoint()
        comm.pool.prepare(["throwaway"])
        t = ctx.graph(c.call, ctx.stream(), "throwaway")
        step(ctx, [c], k + 2, t.replay, f"cycle {k} throwaway replay", fails)
        t.release()
        closed = comm.pool.rollback(cp)
        if closed != ["throwaway"] or "throwaway" in comm.pool.channel_ids:
            fails.append(f"cycle {k}: rollback closed {closed}, pool now has {comm.pool.channel_ids}")
        g.release()
        del g, t, c
        comm.close()
        worst = (max(worst[0], counter.slabs), max(worst[1], counter.mappings))
        if counter.slabs or counter.mappings:
            fails.append(f"cycle {k}: {counter.slabs} slabs and {counter.mappings} peer mappings still open "
                         "after close()")
        if k == 0 or k == cycles - 1 or k % 50 == 49:
            free.append(free_device_bytes(cuda))
        if len(fails) > 20:
            break
    out = {"cycles": cycles, "seconds": round(time.perf_counter() - t0, 2), "slabs_allocated": counter.allocated,
           "mappings_opened": counter.opened, "open_after_close_max": {"slabs": worst[0], "mappings": worst[1]}}
    if free[0] is not None:
        # free[1] is after the first cycle (Triton, NCCL and graph-pool setup included); growth
        # after it would be a per-cycle leak. 8 MiB is < 4 cycles' worth of slabs (2 MiB each).
        leak = free[1] - free[-1]
        out.update(free_bytes_trace=free, leak_bytes_after_first_cycle=leak, first_cycle_bytes=free[0] - free[1])
        if abs(leak) > 8 << 20:
            fails.append(f"device free memory fell by {leak} B over cycles 2..{cycles}")
    return {"ok": not fails, **out, "failures": fails[:20]}


# --------------------------------------------------------------------------- guard (extra)
def sec_guard(world, opt) -> dict:
    """Capture a size that never ran but shares a warmed size's launch key (op, dtype,
    config, n % 16 == 0). Triton also specializes the `fp` argument on fp % 16 == 0,
    so the cold size may need a compile during capture. By design: CaptureError."""
    import torch

    from sparkinfer.comm.dispatch import fingerprint
    from sparkinfer.comm.topology import grid_config
    from sparkinfer.errors import CaptureError

    comm = _comm(opt, 1 << 16, channel_ids=("guard",))
    ctx, fails, bf = Ctx(world, comm), [], torch.bfloat16
    fp16 = lambda n: fingerprint("all_reduce_oneshot", n, str(bf), grid_config(comm.caps, 2 * n).grid) % 16 == 0  # noqa: E731
    n0 = 4096  # find a size with n0's launch key (same config, n % 16 == 0) but the other fp % 16
    n1 = next((n for n in range(n0 - 16, 16, -16) if grid_config(comm.caps, 2 * n) == grid_config(comm.caps, 2 * n0)
               and fp16(n) != fp16(n0)), None)
    if n1 is None:
        return {"ok": True, "capture": "no size pair found; nothing to test", "failures": []}
    warm, cold = Collective(comm, "ar", n0, bf, "oneshot"), Collective(comm, "ar", n1, bf, "oneshot")
    out = {"fp_div16": {n0: fp16(n0), n1: fp16(n1)}, "config": str(grid_config(comm.caps, 2 * n0))}
    step(ctx, [warm], 1, warm.call, "warm eager", fails)
    s = ctx.stream()
    ctx.eager_on_channel(s, "guard", warm.call)
    try:
        g = Graph(cold.call, s, scope=lambda r: comm.pool.capture(s, "guard", reuse=True), cpu_streams=ctx.cpu_streams,
                  warmup=0)
        out["capture"] = "captured without a warm-up of this size"
        step(ctx, [cold], 2, g.replay, "cold replay", fails)
        g.release()
    except CaptureError as e:
        out["capture"] = f"CaptureError (guard works): {e}"[:300]
    except Exception as e:  # noqa: BLE001 - the evidence
        out["capture"] = f"{type(e).__name__}: {e}"[:600]
        fails.append(f"capture of an un-warmed specialization failed untyped: {out['capture']}")
    try:
        comm.synchronize()
        comm.close()
    except Exception as e:  # noqa: BLE001
        fails.append(f"teardown after the guard case: {type(e).__name__}: {e}")
    return {"ok": not fails, **out, "failures": fails}


# --------------------------------------------------------------------------- driver
def _worker(world, section: str, opt: dict) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames
    t0 = time.perf_counter()
    res = globals()[f"sec_{section}"](world, opt)
    res["rank_seconds"] = round(time.perf_counter() - t0, 2)
    return res


def _summary(section: str, res: dict) -> str:
    keys = {
        "smoke": ("checks", "rs_ag_over_capacity"),
        "graph": ("per_op",),
        "replay10k": ("replays", "us_per_replay_pair", "epochs"),
        "timeout": ("timeout_ll", "timeout_oneshot", "timeout_twoshot", "size_ll_mismatch_ranks",
                    "size_oneshot_mismatch_ranks", "op_mismatch_ranks"),
        "lifecycle": ("cycles", "leak_bytes_after_first_cycle", "mappings_opened", "open_after_close_max"),
        "guard": ("fp_div16", "capture"),
    }[section]
    return "; ".join(f"{k}={res[k]}" for k in keys if k in res)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS + EXTRA)}")
    p.add_argument("--out", default="benchmarks/results/gpu_checks_2xh200.json")
    p.add_argument("--dry-run", action="store_true", help="2 CPU ranks with the Triton interpreter, tiny sizes")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every section's launcher backstop")
    p.add_argument("--budget-s", type=float, default=560.0, help="whole run: later backstops shrink to fit (0: off)")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS + EXTRA]
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {SECTIONS + EXTRA}")
    from sparkinfer.errors import RankFailed
    from sparkinfer.runtime import run_ranks

    backend = "cpu" if args.dry_run else "cuda"
    out = args.out
    if args.dry_run and args.out == p.get_default("out"):
        out = os.path.join(tempfile.gettempdir(), "sparkinfer_bench", "gpu_checks_dry_run.json")
    meta = metadata()
    opt, summary = options(args.dry_run), []
    start = time.perf_counter()
    for sec in sections:
        t0 = time.perf_counter()
        tmo = TIMEOUTS[sec] * args.timeout_scale * (3 if args.dry_run else 1)
        left = args.budget_s - (t0 - start) if args.budget_s > 0 and not args.dry_run else tmo
        if left < 30:
            print(f"[SKIP] {sec:<10} only {left:.0f} s of --budget-s left", flush=True)
            summary.append((sec, "SKIP", 0.0))
            continue
        tmo = min(tmo, left)
        try:
            ranks = run_ranks(_worker, 2, backend=backend, args=(sec, opt), timeout_s=tmo)
            ok = all(r["ok"] for r in ranks)
            res = {**ranks[0], "failures": [f"rank {i}: {f}" for i, r in enumerate(ranks) for f in r["failures"]]}
            res["per_rank"] = [{k: v for k, v in r.items() if k != "failures"} for r in ranks[1:]]
        except RankFailed as e:
            ok, res = False, {"failures": [f"rank {e.rank} failed: {e.detail[-3000:]}"]}
        secs = time.perf_counter() - t0
        verdict = "PASS" if ok else "FAIL"
        row = {"section": sec, "backend": backend, "result": verdict, "seconds": round(secs, 1), "details": res}
        append_rows(out, [row], meta)
        print(f"[{verdict}] {sec:<10} {secs:6.1f} s  {_summary(sec, res)}", flush=True)
        for f in res.get("failures", [])[:8]:
            print(f"        {f[:600]}", flush=True)
        summary.append((sec, verdict, secs))
    print("\nsummary (" + meta.get("gpu", "?") + f", commit {str(meta.get('commit'))[:10]}): "
          + ", ".join(f"{s}={v} ({t:.0f}s)" for s, v, t in summary) + f"\nrows appended to {out}")
    return 0 if all(v == "PASS" for _, v, _ in summary) else 1  # a SKIP counts as not passed


if __name__ == "__main__":
    sys.exit(main())
