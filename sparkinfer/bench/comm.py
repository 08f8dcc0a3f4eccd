"""Collective latency inside CUDA graphs on 2 GPUs: ours beside NCCL and torch SymmetricMemory.

    sparkinfer bench comm --quick          # 8 sizes, about 1-2 minutes
    sparkinfer bench comm                  # 2 KiB .. 64 MiB, every power of 2
    sparkinfer bench comm --dry-run        # 2 CPU ranks, Triton interpreter, tiny sizes

Method. For every (op, implementation, size): check the result once eagerly
(exact, rank-encoded integer payloads), capture `ops` back-to-back calls on fixed
buffers into one CUDA graph, replay it `replays` + 1 times with CUDA events around
each replay, drop the first; per-op latency = median replay time / ops, the larger
of the two ranks' medians. bf16 throughout. Sizes are bytes of the full tensor:
all_reduce input, reduce_scatter input, all_gather output.

Implementations. all_reduce: ours ll (up to 4 MiB) / oneshot / twoshot / auto (capacity =
the largest size, so auto never leaves our kernels), NCCL (torch.distributed in the graph),
torch SymmetricMemory one_shot_all_reduce_out and two_shot_all_reduce_ (recorded as
unavailable with the error if they fail). reduce_scatter, all_gather: ours vs NCCL.

Reported: latency (us), algorithm bandwidth (size / time), bus bandwidth
(x 2(W-1)/W for all_reduce, x (W-1)/W otherwise), fraction of the peer-copy
bandwidth measured in the same run (torch copy of 256 MiB cuda:0 -> cuda:1), ratio
to NCCL, and the latency targets for auto. JSON rows go to --out, a PNG beside it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

from sparkinfer.bench import common
from sparkinfer.bench.comm_report import merge, plot, print_tables

__all__ = ["add_arguments", "main"]

KiB, MiB = 1 << 10, 1 << 20
FULL_SIZES = [2 * KiB << i for i in range(16)]  # 2 KiB .. 64 MiB
QUICK_SIZES = [2 * KiB, 32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB, 8 * MiB, 32 * MiB, 64 * MiB]
WORLD = 2


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="8 sizes, shorter graphs (about 1-2 minutes)")
    p.add_argument("--sizes", default="", help="comma-separated sizes in KiB (overrides the size list)")
    p.add_argument("--out", default=None, help="JSON rows (default benchmarks/results/comm_<machine>.json)")
    p.add_argument("--dry-run", action="store_true", help="2 CPU ranks, Triton interpreter, tiny sizes")
    p.add_argument("--timeout", type=float, default=540.0, help="launcher backstop, seconds")


def plan(args) -> dict:
    """Sizes, graph lengths and replays for this run (everything the ranks need)."""
    if args.dry_run:
        return {"sizes": [4 * KiB], "ops": {}, "ops_default": 2, "replays": 2}
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.sizes:
        sizes = [int(float(s) * KiB) for s in args.sizes.split(",")]
    # ops per graph: long enough to hide launch gaps, short enough to keep big sizes cheap
    ops = {s: (20 if args.quick else 50) if s <= 1 * MiB else (20 if s <= 8 * MiB else 10) for s in sizes}
    return {"sizes": sizes, "ops": ops, "ops_default": 20, "replays": 10 if args.quick else 20}


def peer_copy_bw(nbytes: int = 256 * MiB, reps: int = 10) -> dict:
    """GB/s of torch copies cuda:0 -> cuda:1 (one direction) and both directions at once."""
    import torch

    a0 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b1 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    a1, b0 = torch.empty_like(b1), torch.empty_like(a0)

    def timed(fn):
        fn()
        for d in (0, 1):
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        for d in (0, 1):
            torch.cuda.synchronize(d)
        return time.perf_counter() - t0

    uni = nbytes * reps / timed(lambda: b1.copy_(a0, non_blocking=True)) / 1e9
    bidi = nbytes * reps / timed(lambda: (b1.copy_(a0, non_blocking=True), b0.copy_(a1, non_blocking=True))) / 1e9
    return {"op": "peer_copy", "bytes": nbytes, "uni_GBps": round(uni, 1), "bidi_per_direction_GBps": round(bidi, 1),
            "peer_access": torch.cuda.can_device_access_peer(0, 1)}


def _read_partial(path: str) -> list:
    import json

    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def main(args) -> int:
    from sparkinfer.bench.comm_ranks import bench_rank
    from sparkinfer.errors import RankFailed
    from sparkinfer.runtime import run_ranks

    cfg, meta = plan(args), common.metadata(args)
    out = Path(args.out) if args.out else common.default_out("comm", meta, WORLD, dry_run=args.dry_run)
    cfg["partial"] = os.path.join(tempfile.gettempdir(), f"sparkinfer_bench_comm_{os.getpid()}")
    t0 = time.perf_counter()
    failure = None
    try:
        per_rank = run_ranks(bench_rank, WORLD, backend="cpu" if args.dry_run else "cuda", args=(cfg,),
                             timeout_s=args.timeout)
    except RankFailed as e:  # keep what the ranks measured before it
        failure = f"rank {e.rank}: {e.detail[-3000:]}"
        per_rank = [_read_partial(f"{cfg['partial']}.rank{r}.jsonl") for r in range(WORLD)]
        k = min(len(x) for x in per_rank)
        per_rank = [x[:k] + [{"op": "rank_info", "seconds": None, "error": failure}] for x in per_rank]
        print(f"RUN FAILED (partial results kept): {failure}", flush=True)
    for r in range(WORLD):
        with contextlib.suppress(OSError):
            os.remove(f"{cfg['partial']}.rank{r}.jsonl")
    peer = None
    if not args.dry_run:
        try:
            peer = peer_copy_bw()
        except Exception as e:  # noqa: BLE001 - provenance of the bandwidth fraction only
            peer = {"op": "peer_copy", "error": f"{type(e).__name__}: {e}"}
    rows = merge(per_rank, WORLD, (peer or {}).get("uni_GBps"))
    rows += [peer] if peer else []
    for r in rows:
        r["bench"], r["mode"] = "comm", "dry-run" if args.dry_run else ("quick" if args.quick else "full")
    common.append_rows(out, rows, meta)
    print_tables(rows, f"{meta['gpu']} x{WORLD}, commit {str(meta.get('commit'))[:10]}")
    if peer:
        print(f"peer copy 256 MiB: {peer}")
    info = next(r for r in rows if r["op"] == "rank_info")
    bad = [f"{r['op']}:{r.get('impl')}:{r['size_bytes']}" for r in rows if r.get("correct") is False]
    errs = sorted({f"{r['op']}:{r.get('impl')}: {r['error'][:160]}" for r in rows if "error" in r})
    for e in errs[:12]:
        print(f"  not measured: {e}")
    png = plot(rows, out.with_suffix(".png"))
    print(f"{time.perf_counter() - t0:.0f} s (ranks {info['seconds']} s); wrong results: {bad or 'none'}; "
          f"rows appended to {out}" + (f", plot {png}" if png else ""))
    return 1 if bad or failure else 0
