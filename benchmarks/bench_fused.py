#!/usr/bin/env python3
"""Fused all-reduce + residual + RMSNorm and dcp_merge on 2 GPUs, against their peers.

Legend: T tokens, H hidden (fused norm) or heads (dcp), D head dim, W = 2 ranks.

One run, in 2 rank processes (sparkinfer.runtime.launch, backend "cuda"):
1. p2p copy bandwidth GPU 0 -> GPU 1 (one 256 MiB copy, rank 0): the link limit
   that `frac_p2p` divides by.
2. fused norm, per (H, T), impls: `fused` (ours, one kernel, algorithm "auto":
   the LL kernel where all_reduce picks LL), `fused_flag` (the flag-based kernel),
   `ar_auto` and `ar_oneshot` (our bare all-reduce of the same tensor: the
   target's yardstick), `ar+torch` (our all-reduce, torch add + F.rms_norm),
   `nccl+torch`.
3. dcp_merge, per (H, D, T, scatter), impls: `dcp_kernel` (ours) and `dcp_nccl`
   (all_gather through NCCL + torch merge).
Every config is first checked (outputs poisoned with NaN): eager vs the fp32
reference (with empty shards whose o is NaN for dcp), our kernels bitwise equal
across ranks, then a CUDA graph of N calls is captured (inside
comm.pool.capture(stream, "bench") after an eager warm-up on that stream),
replayed and compared bitwise with eager, inputs changed and replayed again
(vs the reference). Timing: median over replays of that graph / N.

Targets: fused <= 1.15x ar_auto of the same tensor; dcp_kernel >= 2x faster
than dcp_nccl at T <= 64. Writes JSON rows (GPU, driver, versions, commit,
date, command) to --out, a PNG beside it, and prints a table.

    python3 benchmarks/bench_fused.py --quick      # ~1-3 min with compilation
    python3 benchmarks/bench_fused.py              # full sweep
    python3 benchmarks/bench_fused.py --dry-run    # 2 CPU ranks, Triton interpreter, tiny shapes
    python3 benchmarks/bench_fused.py --sweep      # fused norm: candidate_configs vs ar_auto, best per (H, T)
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (imports nothing heavy)

EPS = 1e-6
TARGET_NORM_RATIO = 1.15
TARGET_DCP_SPEEDUP, TARGET_DCP_MAX_T = 2.0, 64
NORM_IMPLS = ("fused", "fused_flag", "ar_auto", "ar_oneshot", "ar+torch", "nccl+torch")
DCP_IMPLS = ("dcp_kernel", "dcp_nccl")
PRESETS = {  # fused (H, T) and dcp ((H, D), T) sweeps, graph size N, replays, budget
    "full": dict(hidden=(4096, 7168), norm_t=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                 heads=((16, 128), (32, 128), (64, 128), (128, 128), (16, 512), (128, 512)),
                 dcp_t=(1, 2, 4, 8, 16, 32, 64, 128, 256), iters=20, reps=15, budget_s=420.0, timeout_s=590),
    "quick": dict(hidden=(4096, 7168), norm_t=(1, 8, 64, 256), heads=((32, 128), (128, 128), (16, 512)),
                  dcp_t=(1, 16, 64, 256), iters=20, reps=9, budget_s=120.0, timeout_s=300),
    "dry": dict(hidden=(1024,), norm_t=(1, 3), heads=((4, 64),), dcp_t=(1, 3), iters=2, reps=2,
                budget_s=200.0, timeout_s=400),
    "sweep": dict(hidden=(4096, 7168), norm_t=(1, 8, 16, 64), iters=20, reps=9, budget_s=100.0, timeout_s=300),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes (about 1-3 minutes)")
    ap.add_argument("--dry-run", action="store_true", help="2 CPU ranks, Triton interpreter, tiny shapes")
    ap.add_argument("--sweep", action="store_true", help="fused norm launch shapes only, best per config (< 2 min)")
    ap.add_argument("--only", default="norm,dcp", help="comma list of: norm, dcp")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting configs after this many seconds")
    ap.add_argument("--out", default=None, help="JSON rows (default benchmarks/results/fused_2xh200[_sweep].json)")
    return ap.parse_args(argv)


def options(args) -> dict:
    preset = "dry" if args.dry_run else "sweep" if args.sweep else "quick" if args.quick else "full"
    opt = dict(PRESETS[preset], dry=args.dry_run, only=("sweep",) if args.sweep else tuple(args.only.split(",")))
    if args.budget_s:
        opt["budget_s"] = args.budget_s
    W, e = 2, 2  # ranks, bf16 bytes
    dcp_bytes = max((t * h * d * e + t * h * 4 + 16 for h, d in opt.get("heads", ()) for t in opt.get("dcp_t", ())), default=0)
    norm_bytes = max(t * h * e for h in opt["hidden"] for t in opt["norm_t"])
    opt["capacity"] = max(dcp_bytes, norm_bytes, 1 << 16)
    opt["world"] = W
    return opt


# --------------------------------------------------------------------------- per-rank plumbing
class Bench:
    """One rank: communicator, the "bench" capture stream, shared budget decisions."""

    def __init__(self, world, opt):
        import torch

        from sparkinfer.comm import Communicator

        self.torch, self.world, self.opt = torch, world, opt
        self.cuda = world.backend == "cuda"
        self.dev = world.device
        self.t0 = time.time()
        # 60 s device-side deadline: a peer may still be compiling its first launch
        self.comm = Communicator(capacity_bytes=opt["capacity"], timeout_s=60, channel_ids=("bench",))
        self.stream = torch.cuda.Stream() if self.cuda else "bench_stream"

    def go(self) -> bool:
        """Rank 0's budget verdict, shared: both ranks run exactly the same configs."""
        mine = time.time() - self.t0 < self.opt["budget_s"]
        return bool(self.comm.group.all_gather(mine)[0])

    def same_on_ranks(self, tensors) -> bool:
        h = hashlib.sha1()
        for t in tensors:
            h.update(t.detach().contiguous().view(self.torch.uint8).cpu().numpy().tobytes())
        return len(set(self.comm.group.all_gather(h.hexdigest()))) == 1

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def graph(self, fn):
        """A graph of opt["iters"] calls of fn; returns (graph, holder): holder[0] is the
        last call's outputs (on CUDA the captured tensors every replay rewrites; the CPU
        stand-in re-runs fn, which refills the holder)."""
        outs = []

        def body():
            for _ in range(self.opt["iters"]):
                outs[:] = [fn()]

        scope = lambda replaying: self.comm.pool.capture(self.stream, "bench", reuse=True)  # noqa: E731
        cpu = None if self.cuda else self.comm.streams
        g = _common.Graph(body, self.stream, scope=scope, cpu_streams=cpu)
        return g, outs

    def time_graph(self, g) -> float:
        """Seconds per call: median over replays of the N-call graph, / N."""
        g.replay()
        self.sync()
        ts = _common.time_calls(g.replay, self.opt["reps"], cuda=self.cuda)
        return _common.median(ts) / self.opt["iters"]


def close_err(actual, ref, eps) -> float:
    """Largest |a - r| / (|r| + 0.05 max|r|), in units of eps; inf where a is not
    finite (unless it equals r, as -inf lse rows do)."""
    a, r = actual.float(), ref.float()
    if bool((~(a.isfinite() | (a == r))).any()):
        return float("inf")
    fin = r.isfinite()
    if not bool(fin.any()):
        return 0.0
    a, r = a[fin], r[fin]
    floor = 0.05 * float(r.abs().max()) + 1e-30
    return float(((a - r).abs() / (r.abs() + floor)).max()) / eps


def run_config(b, base: dict, impls: dict, load, reference, tol: dict) -> list[dict]:
    """Check then time every impl of one config. impls: name -> call() returning outputs;
    load(seed) writes inputs in place; reference(name) -> expected outputs (None = skip)."""
    torch = b.torch
    rows = []
    for name, call in impls.items():
        if not b.go():
            print(f"budget: skipping {base} {name}", flush=True)
            continue
        row = dict(base, impl=name)
        try:
            load(1)
            _common.poison(*call())
            outs = call()
            b.sync()
            eager = [o.clone() for o in outs]
            exp = reference(name)
            eps = torch.finfo(outs[0].dtype).eps
            err = max(close_err(o, e, eps) for o, e in zip(outs, exp))
            ranks_equal = b.same_on_ranks(outs) if name in tol["bitwise"] else None
            g, held = b.graph(call)
            _common.poison(*held[0])
            g.replay()
            b.sync()
            replay_ok = all(torch.equal(o.view(torch.uint8), e.view(torch.uint8)) for o, e in zip(held[0], eager))
            load(2)
            _common.poison(*held[0])
            g.replay()
            b.sync()
            err2 = max(close_err(o, e, eps) for o, e in zip(held[0], reference(name)))
            ok = max(err, err2) <= tol[name] and replay_ok and ranks_equal is not False
            row.update(err_eps=max(err, err2), ranks_bitwise=ranks_equal, replay_bitwise=replay_ok, ok=ok)
            row.update(us=b.time_graph(g) * 1e6, mode="graph" if b.cuda else "cpu", iters=b.opt["iters"])
            g.release()
            del g, held
        except Exception as exc:  # noqa: BLE001 - recorded as a failed row; CUDA errors end the run
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
            if "CUDA error" in str(exc) or "Collective" in type(exc).__name__:
                rows.append(row)
                raise
        rows.append(row)
        if b.world.rank == 0:
            shown = f"{row['us']:9.2f} us" if "us" in row else row.get("error", "")
            print(f"{'OK  ' if row['ok'] else 'FAIL'} {base} {name:11s} {shown} err={row.get('err_eps', '-')}",
                  flush=True)
    return rows


# --------------------------------------------------------------------------- fused norm
def norm_inputs(b, H: int, T: int):
    """(x, residual, weight): [T, H], [T, H], [H] bf16; (load(seed): refill in place, reference(impl))."""
    torch, comm, W, dev = b.torch, b.comm, b.comm.world_size, b.dev
    from sparkinfer.comm.fused_norm.reference import add_rms_norm

    x, res, w = (torch.empty(shape, dtype=torch.bfloat16, device=dev) for shape in ((T, H), (T, H), (H,)))
    state = {}

    def load(seed):
        g = torch.Generator(device=dev).manual_seed(1000 * seed + T + H)
        xs = [torch.randn(T, H, generator=g, device=dev).bfloat16() for _ in range(W)]
        x.copy_(xs[comm.rank])
        res.copy_(2 * torch.randn(T, H, generator=g, device=dev))
        w.copy_(1 + 0.5 * torch.randn(H, generator=g, device=dev))
        total = sum(t.float() for t in xs)
        state.update(sum=total, norm=add_rms_norm(total, res, w, EPS))

    def reference(name):  # ar_*: the sum; fused: (out, residual_out)
        return (state["sum"],) if name.startswith("ar_") else state["norm"]
    return (x, res, w), (load, reference)


def bench_norm(b, H: int, T: int) -> list[dict]:
    torch, comm, W, dev = b.torch, b.comm, b.comm.world_size, b.dev
    import torch.nn.functional as F

    (x, res, w), (load, reference) = norm_inputs(b, H, T)
    bufs = {k: torch.empty(T, H, dtype=torch.bfloat16, device=dev) for k in ("o", "r", "o2", "r2", "s1", "s2", "s3", "s4")}

    def torch_norm(s):
        r = s + res
        return F.rms_norm(r, (H,), w, EPS), r

    impls = {
        "fused": lambda: comm.all_reduce_add_rms_norm(x, res, w, EPS, out=bufs["o"], residual_out=bufs["r"]),
        "fused_flag": lambda: comm.all_reduce_add_rms_norm(x, res, w, EPS, out=bufs["o2"], residual_out=bufs["r2"],
                                                           algorithm="fused"),
        "ar_auto": lambda: (comm.all_reduce(x, bufs["s1"]),),
        "ar_oneshot": lambda: (comm.all_reduce(x, bufs["s2"], algorithm="oneshot"),),
        "ar+torch": lambda: torch_norm(comm.all_reduce(x, bufs["s3"])),
        "nccl+torch": lambda: torch_norm(comm.all_reduce(x, bufs["s4"], algorithm="nccl")),
    }

    tol = {"fused": 4, "fused_flag": 4, "ar_auto": 2, "ar_oneshot": 2, "ar+torch": 16, "nccl+torch": 16,
           "bitwise": ("fused", "fused_flag", "ar_auto", "ar_oneshot")}
    from sparkinfer.comm.topology import select_algorithm

    nbytes = T * H * 2
    base = dict(op="fused_norm", H=H, T=T, dtype="bfloat16", nbytes=nbytes,
                ar_auto_algorithm=select_algorithm(comm.caps, nbytes))
    rows = run_config(b, base, impls, load, reference, tol)
    per_alg = {"ll": 2 * (W - 1), "oneshot": W - 1, "twoshot": 2 * (W - 1) / W, "nccl": 2 * (W - 1) / W}
    auto = base["ar_auto_algorithm"]
    alg = {"fused": "ll" if auto == "ll" else "oneshot", "fused_flag": "oneshot", "ar_oneshot": "oneshot",
           "ar_auto": auto, "ar+torch": auto, "nccl+torch": "nccl"}
    for r in rows:  # bytes this rank writes to its peers (LL words carry 4 payload bytes in 8)
        r["link_bytes"] = int(nbytes * per_alg[alg[r["impl"]]])
    return rows


def sweep_norm(b, H: int, T: int) -> list[dict]:
    """Check and time fused_norm.launch.candidate_configs for [T, H] bf16, and ar_auto."""
    from sparkinfer.comm.fused_norm.launch import candidate_configs

    torch, comm = b.torch, b.comm
    (x, res, w), (load, reference) = norm_inputs(b, H, T)
    o, r, s1 = (torch.empty(T, H, dtype=torch.bfloat16, device=b.dev) for _ in range(3))
    cands = candidate_configs(comm.caps, T, H, 2, ll_max_bytes=comm.pool.layout.ll_lane_bytes // 2)
    call = lambda a, c: comm.all_reduce_add_rms_norm(x, res, w, EPS, out=o, residual_out=r, algorithm=a, config=c)  # noqa: E731
    impls = {name: (lambda a=alg, c=cfg: call(a, c)) for name, (alg, cfg) in cands.items()}
    impls["ar_auto"] = lambda: (comm.all_reduce(x, s1),)
    rows = run_config(b, dict(op="fused_norm_sweep", H=H, T=T, dtype="bfloat16", nbytes=T * H * 2), impls, load,
                      reference, {**{name: 4 for name in cands}, "ar_auto": 2, "bitwise": tuple(impls)})
    for row in (row for row in rows if row["impl"] in cands):
        row.update(algorithm=cands[row["impl"]][0], **dataclasses.asdict(cands[row["impl"]][1]))
    return rows


def sweep_table(rows) -> list[dict]:
    """Per (H, T): every shape's us, fastest first, and the best / auto over ar_auto; kind="sweep_best" rows."""
    out, rows = [], [r for r in rows if r.get("op") == "fused_norm_sweep" and "us" in r]
    for H, T in sorted({(r["H"], r["T"]) for r in rows}):
        ranked = sorted((r for r in rows if (r["H"], r["T"]) == (H, T)), key=lambda r: r["us"])
        ar = next((r["us"] for r in ranked if r["impl"] == "ar_auto"), float("nan"))
        fused = [r for r in ranked if r["impl"] != "ar_auto"] or [dict(impl="-", us=float("nan"))]
        best, auto = fused[0], next((r for r in fused if r["impl"].startswith("auto")), fused[0])
        out.append(dict(kind="sweep_best", H=H, T=T, ar_auto_us=ar, best=best["impl"], best_us=best["us"],
                        best_over_ar_auto=best["us"] / ar, auto=auto["impl"], auto_over_ar_auto=auto["us"] / ar,
                        best_config={k: best.get(k) for k in ("algorithm", "grid", "pieces", "per", "num_warps")}))
        print(f"sweep H={H:<5} T={T:<4} " + " | ".join(f"{r['impl']} {r['us']:.2f}" for r in ranked) +
              f" || best {best['impl']} {out[-1]['best_config']} = {best['us'] / ar:.2f}x ar_auto "
              f"({'MEETS' if best['us'] / ar <= TARGET_NORM_RATIO else 'MISSES'} <= {TARGET_NORM_RATIO}); "
              f"auto {auto['us'] / ar:.2f}x", flush=True)
    return out


# --------------------------------------------------------------------------- dcp merge
def bench_dcp(b, H: int, D: int, T: int, scatter: bool) -> list[dict]:
    torch, comm, W, dev = b.torch, b.comm, b.comm.world_size, b.dev
    from sparkinfer.comm.dcp.reference import merge_partials

    o = torch.empty(T, H, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    Hs = H // W if scatter else H
    o_out = torch.empty(T, Hs, D, dtype=torch.bfloat16, device=dev)
    l_out = torch.empty(T, Hs, dtype=torch.float32, device=dev)
    state = {}

    def load(seed):
        g = torch.Generator(device=dev).manual_seed(1000 * seed + T * 7 + H * 3 + D)
        os_ = torch.randn(W, T, H, D, generator=g, device=dev).bfloat16()
        ls = torch.randn(W, T, H, generator=g, device=dev) * 4 + 10
        gone = torch.rand(W, T, H, generator=g, device=dev) < 0.25  # empty shards: lse -inf, o NaN
        ls[gone] = float("-inf")
        os_[gone] = float("nan")
        o.copy_(os_[comm.rank])
        lse.copy_(ls[comm.rank])
        heads = slice(comm.rank * Hs, (comm.rank + 1) * Hs) if scatter else slice(None)
        ref_o, ref_l = merge_partials(os_[:, :, heads], ls[:, :, heads])
        state["ref"] = (ref_o.bfloat16(), ref_l)

    kw = dict(scatter_heads=scatter, return_lse=True)
    impls = {
        "dcp_kernel": lambda: comm.dcp_merge(o, lse, out=o_out, lse_out=l_out, **kw),
        "dcp_nccl": lambda: comm.dcp_merge(o, lse, algorithm="nccl", **kw),
    }
    tol = {"dcp_kernel": 4, "dcp_nccl": 4, "bitwise": ("dcp_kernel",) if not scatter else ()}
    base = dict(op="dcp_merge", H=H, D=D, T=T, scatter=scatter, dtype="bfloat16")
    rows = run_config(b, base, impls, load, lambda name: state["ref"], tol)
    per_row = D * 2 + 4
    for r in rows:
        sent = Hs if r["impl"] == "dcp_kernel" else H
        r["link_bytes"] = (W - 1) * T * sent * per_row
    return rows


# --------------------------------------------------------------------------- worker and report
def p2p_gbs(b):
    """GPU 0 -> GPU 1 copy bandwidth (GB/s), rank 0 only; None on CPU or one visible GPU."""
    torch = b.torch
    if not b.cuda or b.world.rank != 0 or torch.cuda.device_count() < 2:
        return None
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    dst.copy_(src)
    torch.cuda.synchronize("cuda:1")
    ts = _common.time_calls(lambda: dst.copy_(src), 5, cuda=True)
    torch.cuda.synchronize("cuda:1")
    return n / _common.median(ts) / 1e9


def _worker(world, opt):
    b = Bench(world, opt)
    rows = []
    try:
        for H in opt["hidden"] if {"norm", "sweep"} & set(opt["only"]) else ():
            for T in opt["norm_t"]:
                rows += (sweep_norm if "sweep" in opt["only"] else bench_norm)(b, H, T)
        if "dcp" in opt["only"]:
            for H, D in opt["heads"]:
                for T in opt["dcp_t"]:
                    for scatter in (False, True):
                        rows += bench_dcp(b, H, D, T, scatter)
        b.comm.synchronize()
    finally:
        b.comm.close()
    # after close: the copy enables peer access in this process, which the slab mappings must not meet
    return [dict(kind="device", p2p_copy_gbs=p2p_gbs(b), capacity=opt["capacity"], world_size=world.world_size)] + rows


def summarize(rows) -> list[dict]:
    """Target verdicts: fused / ar_auto per (H, T); dcp_nccl / dcp_kernel per config."""
    t = {}
    for r in rows:
        if "us" in r:
            key = (r["op"], r.get("H"), r.get("D"), r["T"], r.get("scatter"))
            t.setdefault(key, {})[r["impl"]] = r["us"]
    out = []
    for (op, H, D, T, scatter), us in sorted(t.items(), key=str):
        if op == "fused_norm" and "fused" in us and "ar_auto" in us:
            ratio = us["fused"] / us["ar_auto"]
            out.append(dict(kind="summary", op=op, H=H, T=T, fused_over_ar_auto=ratio,
                            fused_over_ar_oneshot=us["fused"] / us.get("ar_oneshot", float("nan")),
                            fused_flag_over_ar_oneshot=us.get("fused_flag", float("nan")) / us.get("ar_oneshot", float("nan")),
                            speedup_vs_nccl_torch=us.get("nccl+torch", float("nan")) / us["fused"],
                            speedup_vs_ar_torch=us.get("ar+torch", float("nan")) / us["fused"],
                            target=f"<= {TARGET_NORM_RATIO}", meets_target=ratio <= TARGET_NORM_RATIO))
        if op == "dcp_merge" and "dcp_kernel" in us and "dcp_nccl" in us:
            sp = us["dcp_nccl"] / us["dcp_kernel"]
            out.append(dict(kind="summary", op=op, H=H, D=D, T=T, scatter=scatter, speedup_vs_nccl=sp,
                            target=f">= {TARGET_DCP_SPEEDUP} at T <= {TARGET_DCP_MAX_T}",
                            meets_target=sp >= TARGET_DCP_SPEEDUP if T <= TARGET_DCP_MAX_T else None))
    return out


def add_fractions(rows, gbs):
    for r in rows:
        if "us" in r and r.get("link_bytes"):
            r["link_gbs"] = r["link_bytes"] / (r["us"] * 1e-6) / 1e9
            r["frac_p2p"] = r["link_gbs"] / gbs if gbs else None


def table(rows):
    for r in (r for r in rows if r.get("kind") == "summary"):
        if r["op"] == "fused_norm":
            print(f"fused_norm H={r['H']:<5} T={r['T']:<4} fused/ar_auto={r['fused_over_ar_auto']:5.2f} "
                  f"fused/ar_oneshot={r['fused_over_ar_oneshot']:5.2f} flag/oneshot={r['fused_flag_over_ar_oneshot']:5.2f} vs nccl+torch x{r['speedup_vs_nccl_torch']:5.2f} "
                  f"vs ar+torch x{r['speedup_vs_ar_torch']:5.2f} {'MEETS' if r['meets_target'] else 'MISSES'} {r['target']}")
        else:
            v = {True: "MEETS", False: "MISSES", None: "-"}[r["meets_target"]]
            print(f"dcp_merge  H={r['H']:<4} D={r['D']:<4} T={r['T']:<4} scatter={r['scatter']!s:5} "
                  f"nccl/kernel x{r['speedup_vs_nccl']:6.2f} {v}")


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (the JSON rows hold every number)", flush=True)
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    norm = [r for r in rows if r.get("op") == "fused_norm" and "us" in r]
    for H in sorted({r["H"] for r in norm}):
        for impl, style in zip(NORM_IMPLS, ("-o", "-^", "--", ":", "-.", "-s")):
            pts = sorted((r["T"], r["us"]) for r in norm if r["H"] == H and r["impl"] == impl)
            if pts:
                axes[0].plot(*zip(*pts), style, label=f"{impl} H={H}")
    axes[0].set(xscale="log", yscale="log", xlabel="T", ylabel="us per op", title="all-reduce + residual + RMSNorm")
    summ = [r for r in rows if r.get("kind") == "summary"]
    for H in sorted({r["H"] for r in summ if r["op"] == "fused_norm"}):
        pts = sorted((r["T"], r["fused_over_ar_auto"]) for r in summ if r["op"] == "fused_norm" and r["H"] == H)
        axes[1].plot(*zip(*pts), "-o", label=f"fused / ar_auto, H={H}")
    axes[1].axhline(TARGET_NORM_RATIO, color="gray", ls="--", label="target 1.15")
    axes[1].set(xscale="log", xlabel="T", ylabel="ratio", title="fused norm cost over bare all-reduce")
    dcp = [r for r in summ if r["op"] == "dcp_merge"]
    for key in sorted({(r["H"], r["D"], r["scatter"]) for r in dcp}):
        pts = sorted((r["T"], r["speedup_vs_nccl"]) for r in dcp if (r["H"], r["D"], r["scatter"]) == key)
        axes[2].plot(*zip(*pts), "-o" if key[2] else "--o", label=f"H={key[0]} D={key[1]}{' scatter' if key[2] else ''}")
    axes[2].axhline(TARGET_DCP_SPEEDUP, color="gray", ls="--", label="target 2x (T <= 64)")
    axes[2].set(xscale="log", xlabel="T", ylabel="NCCL composition / ours", title="dcp_merge speedup")
    for ax in axes:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    _common.ensure_repo_on_path()
    from sparkinfer.errors import RankFailed
    from sparkinfer.runtime import run_ranks

    opt = options(args)
    out = args.out or (os.path.join(tempfile.gettempdir(), "bench_fused_dry_run.json") if args.dry_run
                       else f"benchmarks/results/fused_2xh200{'_sweep' if args.sweep else ''}.json")
    faulthandler.dump_traceback_later(opt["timeout_s"] + 60, exit=True)  # never hang, even if run_ranks() did
    meta = _common.metadata(sys.argv if argv is None else ["benchmarks/bench_fused.py", *argv])
    t0 = time.time()
    try:
        ranks = run_ranks(_worker, opt["world"], backend="cpu" if args.dry_run else "cuda", args=(opt,),
                       timeout_s=opt["timeout_s"])
        rows, failed = ranks[0], None
    except RankFailed as e:
        rows, failed = [], f"rank {e.rank}: {e.detail[-4000:]}"
        print(f"FAILED: {failed}", flush=True)
    gbs = rows[0]["p2p_copy_gbs"] if rows else None
    add_fractions(rows, gbs)
    rows += summarize(rows) + sweep_table(rows)
    if failed:
        rows.append(dict(kind="failure", detail=failed))
    _common.append_rows(out, rows, {**meta, "capacity": opt["capacity"], "iters": opt["iters"]})
    try:
        png = plot(rows, str(Path(out).with_suffix(".png"))) if rows and not args.sweep else None
    except Exception as exc:  # noqa: BLE001 - a plotting problem must not lose the measured rows
        png = None
        print(f"plot failed ({type(exc).__name__}: {exc}); the JSON rows hold every number", flush=True)
    table(rows)
    bad = [r for r in rows if r.get("ok") is False]
    print(f"\nwrote {out}" + (f" and {png}" if png else "") + f"; p2p copy {gbs and round(gbs)} GB/s; "
          f"checks failed: {len(bad)}; {time.time() - t0:.0f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
