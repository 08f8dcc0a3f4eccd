"""Fused all-reduce + residual + RMSNorm and dcp_merge on 2 GPUs, against their peers.

    sparkinfer bench fused --quick      # ~1-3 min with compilation
    sparkinfer bench fused              # full sweep
    sparkinfer bench fused --dry-run    # 2 CPU ranks, Triton interpreter, tiny shapes
    sparkinfer bench fused --sweep      # fused norm: candidate_configs vs ar_auto, best per (H, T)
    sparkinfer bench fused --only dcp --shared-gpu   # one GPU, 2 ranks (MPS): the checks, no timings

Legend: T tokens, H hidden (fused norm) or heads (dcp), D head dim, W = 2 ranks.

One run, in 2 rank processes:
1. fused norm, per (H, T), impls: `fused` (ours, one kernel, algorithm "auto":
   the LL kernel where all_reduce picks LL), `fused_flag` (the flag-based kernel),
   `ar_auto` and `ar_oneshot` (our bare all-reduce of the same tensor: the
   target's yardstick), `ar+torch` (our all-reduce, torch add + F.rms_norm),
   `nccl+torch`.
2. dcp_merge, per (H, D, T, scatter), impls: `dcp_kernel` (ours), `dcp_nccl`
   (all_gather of o and lse through NCCL + torch merge), `dcp_nccl_compiled`
   (the same gathers, the merge torch.compile'd) and `dcp_ag_rs` (the
   strongest composition, what serving engines run: all-gather of the lse only,
   one torch.compile'd correction kernel, reduce-scatter of the corrected
   outputs over heads, or all-reduce when every rank keeps every head).
3. p2p copy bandwidth GPU 0 -> GPU 1 (one 256 MiB copy, rank 0, after the
   communicator closed): the link limit that `frac_p2p` divides by.
Every config is first checked (outputs poisoned with NaN): eager vs the fp32
reference (with empty shards whose o is NaN for dcp), our kernels bitwise equal
across ranks, then a CUDA graph of N calls is captured (inside
comm.pool.capture(stream, "bench") after an eager warm-up on that stream),
replayed and compared bitwise with eager, inputs changed and replayed again
(vs the reference). Timing: median over replays of that graph / N; a row's
time is the slowest rank's (each rank's in us_per_rank), its ok every rank's.

Targets: fused <= 1.15x ar_auto of the same tensor; dcp_kernel >= 2x faster
than dcp_nccl at T <= 64.
"""

from __future__ import annotations

import faulthandler
import re
import sys
import time
from pathlib import Path

from sparkinfer.bench import common

__all__ = ["add_arguments", "main"]

WORLD = 2
PRESETS = {  # fused (H, T) and dcp ((H, D), T) sweeps, graph size N, replays, budget
    "full": dict(hidden=(4096, 7168), norm_t=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                 heads=((16, 128), (32, 128), (64, 128), (128, 128), (16, 512), (128, 512)),
                 dcp_t=(1, 2, 4, 8, 16, 32, 64, 128, 256), iters=20, reps=15, budget_s=420.0, timeout_s=590),
    "quick": dict(hidden=(4096, 7168), norm_t=(1, 8, 64, 256), heads=((32, 128), (128, 128), (16, 512)),
                  dcp_t=(1, 16, 64, 256), iters=20, reps=9, budget_s=120.0, timeout_s=300),
    "dry": dict(hidden=(1024,), norm_t=(1, 3), heads=((4, 64),), dcp_t=(3,), iters=2, reps=2,
                budget_s=200.0, timeout_s=400),
    "sweep": dict(hidden=(4096, 7168), norm_t=(1, 8, 16, 64), iters=20, reps=9, budget_s=100.0, timeout_s=300),
}


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="fewer shapes (about 1-3 minutes)")
    p.add_argument("--dry-run", action="store_true", help="2 CPU ranks, Triton interpreter, tiny shapes")
    p.add_argument("--sweep", action="store_true", help="fused norm launch shapes only, best per config (< 2 min)")
    p.add_argument("--only", default="norm,dcp", help="comma list of: norm, dcp")
    p.add_argument("--shared-gpu", action="store_true",
                   help="both ranks on one GPU (start MPS first): the checks only; timings are left out of the "
                        "rows (default out: results/fused_shared_<machine>.json)")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting configs after this many seconds")
    p.add_argument("--out", default=None,
                   help="JSON rows (default benchmarks/results/fused_<machine>.json; --sweep: results/sweeps/)")


def options(args) -> dict:
    preset = "dry" if args.dry_run else "sweep" if args.sweep else "quick" if args.quick else "full"
    opt = dict(PRESETS[preset], dry=args.dry_run, only=("sweep",) if args.sweep else tuple(args.only.split(",")))
    if args.budget_s:  # the ranks' deadline follows: a config started at the budget still finishes
        opt["budget_s"] = args.budget_s
        opt["timeout_s"] = max(opt["timeout_s"], int(args.budget_s) + 180)
    e = 2  # bf16 bytes
    dcp_bytes = max((t * h * d * e + t * h * 4 + 16 for h, d in opt.get("heads", ()) for t in opt.get("dcp_t", ())),
                    default=0)
    norm_bytes = max(t * h * e for h in opt["hidden"] for t in opt["norm_t"])
    opt["capacity"] = max(dcp_bytes, norm_bytes, 1 << 16)
    return opt


def p2p_gbs(b):
    """GPU 0 -> GPU 1 copy bandwidth (GB/s), rank 0 only; None on CPU or one visible GPU."""
    from sparkinfer.bench.timing import median, time_calls

    torch = b.torch
    if not b.cuda or b.world.rank != 0 or torch.cuda.device_count() < 2:
        return None
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    dst.copy_(src)
    torch.cuda.synchronize("cuda:1")
    ts = time_calls(lambda: dst.copy_(src), 5, cuda=True)
    torch.cuda.synchronize("cuda:1")
    return n / median(ts) / 1e9


def _worker(world, opt):
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed's renames, once per call
    from sparkinfer.bench.fused_cases import Bench, bench_dcp, bench_norm, sweep_norm
    from sparkinfer.bench.report import progress

    b = Bench(world, opt)
    norm = [(H, T) for H in opt["hidden"] for T in opt["norm_t"]] if {"norm", "sweep"} & set(opt["only"]) else []
    dcp = [(H, D, T, sc) for H, D in opt["heads"] for T in opt["dcp_t"] for sc in (False, True)] \
        if "dcp" in opt["only"] else []
    rows = []
    try:
        with progress(len(norm) + len(dcp), "fused", enabled=world.rank == 0) as advance:
            for H, T in norm:
                rows += (sweep_norm if "sweep" in opt["only"] else bench_norm)(b, H, T)
                advance(f"norm H={H} T={T}")
            for H, D, T, scatter in dcp:
                rows += bench_dcp(b, H, D, T, scatter)
                advance(f"dcp H={H} D={D} T={T}{' scatter' if scatter else ''}")
        b.comm.synchronize()
    finally:
        b.comm.close()
    # after close: the copy enables peer access in this process, which the slab mappings must not meet
    return [dict(kind="device", p2p_copy_gbs=p2p_gbs(b), capacity=opt["capacity"], world_size=world.world_size)] + rows


def merge_ranks(ranks: list) -> list:
    """One row per measurement from every rank's rows (same configs, same order:
    the ranks share the budget verdict): the slowest rank's time (us; each rank's
    in us_per_rank) and ok only when every rank's check passed. Other rows are
    rank 0's (the device row holds rank 0's p2p copy)."""
    if any(len(r) != len(ranks[0]) for r in ranks):
        raise RuntimeError(f"ranks returned {[len(r) for r in ranks]} rows; they must run the same configs")
    rows = []
    for rs in zip(*ranks):
        row = dict(rs[0])
        if "us" in row:
            row["us_per_rank"] = [r.get("us") for r in rs]
            row["us"] = max(r["us"] for r in rs if "us" in r)
        if "ok" in row:
            row["ok"] = all(r.get("ok", False) for r in rs)
        rows.append(row)
    return rows


# Row keys that are timings or derived from them: two ranks time-sliced on one GPU
# measure the sharing, not the op, so --shared-gpu rows keep only their checks.
_TIMING_KEYS = re.compile(r"^us|_us$|speedup|frac|gbs|tflops|ratio")


def checks_only(rows: list) -> list:
    """rows without their timings (see _TIMING_KEYS), marked as such."""
    return [{k: v for k, v in r.items() if not _TIMING_KEYS.search(k)} | {"timing": "not recorded (one GPU shared)"}
            for r in rows if r.get("kind") != "device"]


def main(args) -> int:
    from sparkinfer.bench.fused_report import add_fractions, plot, print_tables, sweep_table, verdicts
    from sparkinfer.errors import RankFailed
    from sparkinfer.runtime import run_ranks

    opt, meta = options(args), common.metadata(args)
    shared = args.shared_gpu and not args.dry_run
    out = Path(args.out) if args.out else common.default_out("fused_shared" if shared else "fused", meta,
                                                              1 if shared else WORLD, dry_run=args.dry_run,
                                                              sweep=args.sweep)
    # never hang, even if run_ranks() did
    faulthandler.dump_traceback_later(opt["timeout_s"] + 60, exit=True, file=sys.__stderr__)
    t0 = time.time()
    try:
        ranks = run_ranks(_worker, WORLD, backend="cpu" if args.dry_run else "cuda_shared" if shared else "cuda",
                          args=(opt,), timeout_s=opt["timeout_s"])
        rows, failed = merge_ranks(ranks), None
    except RankFailed as e:
        rows, failed = [], f"rank {e.rank}: {e.detail[-4000:]}"
        print(f"FAILED: {failed}", flush=True)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if shared:
        return _report_checks(checks_only(rows), failed, out, {**meta, "capacity": opt["capacity"]}, t0)
    gbs = rows[0]["p2p_copy_gbs"] if rows else None
    add_fractions(rows, gbs)
    rows += verdicts(rows) + sweep_table(rows)
    if failed:
        rows.append(dict(kind="failure", detail=failed))
    for r in rows:
        r["bench"] = "fused"
    common.append_rows(out, rows, {**meta, "capacity": opt["capacity"], "iters": opt["iters"]})
    print_tables(rows, f"{meta['gpu']} x{WORLD}, commit {str(meta.get('commit'))[:10]}")
    png = plot(rows, out.with_suffix(".png")) if rows and not args.sweep else None
    bad = [r for r in rows if r.get("ok") is False]
    print(f"p2p copy {gbs and round(gbs)} GB/s; checks failed: {len(bad)}; {time.time() - t0:.0f} s; "
          f"rows appended to {out}" + (f", plot {png}" if png else ""), flush=True)
    return 1 if bad or failed else 0


def _report_checks(rows: list, failed, out: Path, meta: dict, t0: float) -> int:
    """--shared-gpu: write the check rows and print how many passed, per op and implementation."""
    if failed:
        rows.append(dict(kind="failure", detail=failed))
    for r in rows:
        r["bench"] = "fused_shared"
    common.append_rows(out, rows, meta)
    checked = [r for r in rows if "ok" in r and "impl" in r]
    for key in sorted({(r["op"], r["impl"]) for r in checked}):
        group = [r for r in checked if (r["op"], r["impl"]) == key]
        print(f"{key[0]:10s} {key[1]:18s} checks passed {sum(r['ok'] for r in group)} of {len(group)}")
    bad = [r for r in checked if not r["ok"]]
    print(f"checks failed: {len(bad)}; {time.time() - t0:.0f} s; rows appended to {out}", flush=True)
    return 1 if bad or failed else 0
