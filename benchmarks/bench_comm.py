"""Collective latency inside CUDA graphs on 2 GPUs: ours beside NCCL and torch SymmetricMemory.

    python3 benchmarks/bench_comm.py --quick          # 8 sizes, about 1-2 minutes
    python3 benchmarks/bench_comm.py                  # 2 KiB .. 64 MiB, every power of 2
    python3 benchmarks/bench_comm.py --sweep-grid     # + launch-configuration sweep of our kernels
    python3 benchmarks/bench_comm.py --dry-run        # 2 CPU ranks, Triton interpreter, tiny sizes

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
to NCCL, and the issue-3 targets for auto. JSON rows go to --out, a PNG beside it.

--sweep-grid calls the all_reduce op function with an explicit `config=` (a GridConfig,
sparkinfer/comm/all_reduce/launch.py) to time other per-block byte targets / grids / tiles
than topology.grid_config / ll_grid_config pick, for ll (<= 512 KiB), oneshot and twoshot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

from _common import Collective, Ctx, Graph, append_rows, ensure_repo_on_path, median, metadata, poison, time_calls

KiB, MiB = 1 << 10, 1 << 20
FULL_SIZES = [2 * KiB << i for i in range(16)]  # 2 KiB .. 64 MiB
QUICK_SIZES = [2 * KiB, 32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB, 8 * MiB, 32 * MiB, 64 * MiB]
# issue 3: targets for auto on 2x H200, microseconds, by size (<= 4 us for everything up to 32 KiB)
TARGET_US = {128 * KiB: 5.0, 512 * KiB: 6.5, 2 * MiB: 10.0, 8 * MiB: 26.0, 32 * MiB: 95.0}
# --sweep-grid, around topology's defaults: grid variants (per-block byte target of the staged
# bytes; None: the default grid, "max": one block per SM) with the default tile, then tile
# variants (BLOCK, num_warps; LL tiles count int32 words) with the default grid
SWEEP_GRIDS = [("default", None), ("pb1K", 1 * KiB), ("pb2K", 2 * KiB), ("pb4K", 4 * KiB), ("pb8K", 8 * KiB),
               ("pb32K", 32 * KiB), ("maxgrid", "max")]
SWEEP_TILES = {"ll": [(512, 4), (1024, 4), (1024, 8), (2048, 8)], "std": [(2048, 8), (4096, 8), (4096, 4), (8192, 16)]}
SWEEP_SIZES = [8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB, 8 * MiB, 32 * MiB]
LL_MAX_BENCH = 4 * MiB  # LL stages 2 bytes per byte and is meant for small sizes: timed up to here


def target_us(size: int) -> float | None:
    return 4.0 if size <= 32 * KiB else TARGET_US.get(size)


def plan(args) -> dict:
    """Sizes, graph lengths and replays for this run (everything the ranks need)."""
    if args.dry_run:
        return {"sizes": [2 * KiB, 8 * KiB], "ops": {}, "ops_default": 2, "replays": 2, "dry": True,
                "sweep_sizes": [8 * KiB] if args.sweep_grid else [], "sweep_grids": SWEEP_GRIDS[:3], "sweep_tiles": 1}
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.sizes:
        sizes = [int(float(s) * KiB) for s in args.sizes.split(",")]
    # ops per graph: long enough to hide launch gaps, short enough to keep big sizes cheap
    ops = {s: (20 if args.quick else 50) if s <= 1 * MiB else (20 if s <= 8 * MiB else 10) for s in sizes + SWEEP_SIZES}
    sweep_sizes = ([32 * KiB, 512 * KiB, 8 * MiB] if args.quick else SWEEP_SIZES) if args.sweep_grid else []
    return {"sizes": sizes, "ops": ops, "ops_default": 20, "replays": 10 if args.quick else 20, "dry": False,
            "sweep_sizes": [s for s in sweep_sizes if s <= max(sizes)], "sweep_grids": SWEEP_GRIDS, "sweep_tiles": 4}


class Impl:
    """One implementation of one op at one size, on `coll`'s buffers.

    load(seed) writes the inputs; call() is one op (captured `ops` times);
    result() is the tensor to compare with coll.expected(seed); reset() makes the
    buffers safe to reduce repeatedly (in-place implementations)."""

    def __init__(self, name, coll, call, *, load=None, result=None, reset=None, ours=False):
        self.name, self.coll, self.call, self.ours = name, coll, call, ours
        self.load = load or (lambda seed: (coll.load(seed), poison(coll.out)))
        self.result = result or (lambda: coll.out)
        self.reset = reset or (lambda: None)


_SYMM_KEEP: list = []


def make_impls(comm, op: str, size: int, symm) -> list:
    """The implementations of `op` ("all_reduce", "reduce_scatter", "all_gather", or "symm" for
    torch SymmetricMemory's all_reduce) at `size` bytes (bf16)."""
    import torch
    import torch.distributed as dist

    bf, n, W = torch.bfloat16, size // 2, comm.world_size
    if op == "reduce_scatter":
        c = Collective(comm, "rs", n, bf)
        return [Impl("ours", c, c.call, ours=True), Impl("nccl", c, lambda: dist.reduce_scatter_tensor(c.out, c.x))]
    if op == "all_gather":
        c = Collective(comm, "ag", n // W, bf)
        return [Impl("ours", c, c.call, ours=True), Impl("nccl", c, lambda: dist.all_gather_into_tensor(c.out, c.x))]
    if op == "all_reduce":
        from sparkinfer.comm.topology import ALGORITHMS

        algs = [a for a in ALGORITHMS if a != "nccl" and (a != "ll" or size <= LL_MAX_BENCH)] + ["auto"]
        out = [Impl(alg, c, c.call, ours=True) for alg in algs for c in [Collective(comm, "ar", n, bf, alg)]]
        c = Collective(comm, "ar", n, bf)
        return out + [Impl("nccl", c, lambda: dist.all_reduce(c.out), load=lambda seed: (c.load(seed), c.out.copy_(c.x)),
                           reset=lambda: c.out.zero_())]
    assert op == "symm", op  # torch SymmetricMemory all_reduce; a string says why it is unavailable
    if isinstance(symm, str):
        return [symm, symm]
    mod, gname = symm
    try:
        buf = mod.empty(n, dtype=bf, device=comm.device)
        mod.rendezvous(buf, gname)
        _SYMM_KEEP.append(buf)  # never freed while a peer may still map it
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return [f"rendezvous: {type(e).__name__}: {e}"] * 2
    ops, out = torch.ops.symm_mem, []
    c1 = Collective(comm, "ar", n, bf)
    load1 = lambda seed: (c1.load(seed), buf.copy_(c1.x), poison(c1.out))  # noqa: E731
    out.append(Impl("symm_one_shot", c1, lambda: ops.one_shot_all_reduce_out(buf, "sum", gname, c1.out), load=load1))
    c2 = Collective(comm, "ar", n, bf)
    out.append(Impl("symm_two_shot", c2, lambda: ops.two_shot_all_reduce_(buf, "sum", gname),
                    load=lambda seed: (c2.load(seed), buf.copy_(c2.x)), result=lambda: buf, reset=lambda: buf.zero_()))
    return out


def measure(ctx, impl, ops: int, replays: int, channel: str = "bench") -> dict:
    """Exact check once eagerly, then the graph timing. Returns row fields."""
    import torch

    row = {}
    impl.load(1)
    impl.call()
    ctx.sync()
    want = impl.coll.expected(1)
    row["correct"] = bool(torch.equal(impl.result(), want))
    impl.reset()
    s = ctx.stream()
    scope = (lambda r: ctx.comm.pool.capture(s, channel, reuse=True)) if impl.ours else None
    g = Graph(lambda: [impl.call() for _ in range(ops)], s, scope=scope, cpu_streams=ctx.cpu_streams, warmup=1)
    g.replay()  # upload / first-launch cost stays out of the timings
    ctx.sync()
    ts = time_calls(g.replay, replays + 1, cuda=ctx.cuda)[1:]
    g.release()
    row["us"] = median(ts) / ops * 1e6
    row["us_min"] = min(ts) / ops * 1e6
    return row


def _symm_setup(world):
    """(torch symmetric-memory module, group name), or why it is unavailable."""
    if world.backend != "cuda":
        return "unavailable: CPU dry run"
    try:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        gname = dist.group.WORLD.group_name
        with warnings.catch_warnings(), contextlib.suppress(Exception):
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(gname)  # required by older torch, a deprecated no-op later
        return symm_mem, gname
    except Exception as e:  # noqa: BLE001
        return f"unavailable: {type(e).__name__}: {e}"


def _bench_rank(world, cfg: dict) -> list:
    ensure_repo_on_path()
    warnings.filterwarnings("ignore", category=FutureWarning)
    import dataclasses

    import torch
    import torch.distributed as dist

    from sparkinfer.comm import Communicator, grid_config, select_algorithm
    from sparkinfer.comm.topology import ll_grid_config
    from sparkinfer.comm.all_reduce.launch import all_reduce, twoshot_chunk
    from sparkinfer.comm.channel import MAX_BLOCKS

    sizes = cfg["sizes"]
    cap = max(sizes + cfg["sweep_sizes"] + [2 * s for s in sizes + cfg["sweep_sizes"] if s <= LL_MAX_BENCH])
    comm = Communicator(capacity_bytes=cap, timeout_s=10.0, channel_ids=("bench",))
    ctx, symm, rows = Ctx(world, comm), _symm_setup(world), []
    t_start = time.perf_counter()

    def emit(row):  # rows also stream to disk: a rank that dies loses only what follows
        rows.append(row)
        with open(f"{cfg['partial']}.rank{world.rank}.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def run(op, impl, size, ops, extra):
        row = {"op": op, "size_bytes": size, "dtype": "bfloat16", "ops_per_graph": ops, "replays": cfg["replays"], **extra}
        if isinstance(impl, str):  # an unavailable implementation: `impl` says why
            return emit({**row, "error": impl[:400]})
        row["impl"] = impl.name
        try:
            row.update(measure(ctx, impl, ops, cfg["replays"]))
        except Exception as e:  # noqa: BLE001 - symmetric on both ranks; recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        emit(row)

    def shape(alg, nbytes, pb, tile):
        """The launch config of one sweep point, built on topology's default for `alg`."""
        if alg == "ll":
            base, staged = ll_grid_config(comm.caps, nbytes), 2 * nbytes
        else:
            base, staged = grid_config(comm.caps, nbytes), nbytes
        most = min(comm.caps.num_sms, MAX_BLOCKS)
        grid = base.grid if pb is None else most if pb == "max" else max(1, min(most, -(-staged // pb)))
        if comm.caps.interpret:
            return dataclasses.replace(base, grid=min(grid, 2))
        return dataclasses.replace(base, grid=grid, **({} if tile is None else {"block": tile[0], "num_warps": tile[1]}))

    def sweep(size, ops):  # launch-configuration sweep of our all_reduce kernels
        for alg in ("ll", "oneshot", "twoshot") if size <= 512 * KiB else ("oneshot", "twoshot"):
            tiles = SWEEP_TILES["ll" if alg == "ll" else "std"][:cfg["sweep_tiles"]]
            points = [(name, pb, None) for name, pb in cfg["sweep_grids"]] + [(f"b{b}w{w}", None, (b, w)) for b, w in tiles]
            # the bytes each algorithm sizes its grid by (bf16): a rank's share for twoshot
            asked = 2 * twoshot_chunk(size // 2, comm.world_size) if alg == "twoshot" else size
            for name, pb, tile in points:
                grid = shape(alg, asked, pb, tile)
                c = Collective(comm, "ar", size // 2, torch.bfloat16, alg)
                call = lambda c=c, alg=alg, grid=grid: all_reduce(comm.context, c.x, c.out, algorithm=alg, config=grid)  # noqa: E731
                run("all_reduce_sweep", Impl(f"{alg}:{name}", c, call, ours=True), size, ops,
                    {"config": dataclasses.asdict(grid), "algorithm": alg, "sweep": name})

    # ours and NCCL first, torch SymmetricMemory last: a crash there cannot take our rows with it
    for op in ("all_reduce", "reduce_scatter", "all_gather", "sweep", "symm"):
        for size in cfg["sweep_sizes"] if op == "sweep" else sizes:
            ops = cfg["ops"].get(size, cfg["ops_default"])
            if op == "sweep":
                sweep(size, ops)
                continue
            for i, impl in enumerate(make_impls(comm, op, size, symm)):
                extra = {"impl": ("symm_one_shot", "symm_two_shot")[i]} if op == "symm" else {}
                if not isinstance(impl, str) and impl.name == "auto":
                    extra["algorithm"] = select_algorithm(comm.caps, size, None)
                run("all_reduce" if op == "symm" else op, impl, size, ops, extra)

    comm.synchronize()
    comm.close()
    dist.barrier()
    rows.append({"op": "rank_info", "seconds": round(time.perf_counter() - t_start, 1), "num_sms": comm.caps.num_sms,
                 "capacity": comm.caps.capacity, "link": comm.caps.link})
    return rows


# --------------------------------------------------------------------------- parent side
def peer_copy_bw(nbytes: int = 256 * MiB, reps: int = 10) -> dict:
    """GB/s of torch copies cuda:0 -> cuda:1 (one direction) and both directions at once."""
    import torch

    a0, b1 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0"), torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
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


def merge(per_rank: list, world_size: int, peak_GBps: float | None) -> list:
    """One row per measurement: the slower rank's latency, bandwidths, ratio to NCCL, target."""
    rows = []
    for rs in zip(*per_rank):
        row = dict(rs[0])
        if "us" in row:
            row["us_per_rank"] = [round(r.get("us", float("nan")), 3) for r in rs]
            row["us"] = max(r["us"] for r in rs if "us" in r)
            row["correct"] = all(r.get("correct", False) for r in rs)
            algbw = row["size_bytes"] / (row["us"] * 1e-6) / 1e9
            factor = 2 * (world_size - 1) / world_size if row["op"].startswith("all_reduce") else (world_size - 1) / world_size
            row.update(algbw_GBps=round(algbw, 2), busbw_GBps=round(algbw * factor, 2))
            if peak_GBps:
                row["frac_of_peer_copy"] = round(algbw * factor / peak_GBps, 3)
        rows.append(row)
    nccl = {(r["op"], r["size_bytes"]): r["us"] for r in rows if r.get("impl") == "nccl" and "us" in r}
    for r in rows:
        ref = nccl.get(("all_reduce" if r["op"] == "all_reduce_sweep" else r["op"], r.get("size_bytes")))
        if "us" in r and ref:
            r["ratio_vs_nccl"] = round(r["us"] / ref, 3)
        if r["op"] == "all_reduce" and r.get("impl") == "auto" and "us" in r:
            t = target_us(r["size_bytes"])
            r["target_us"] = t
            r["meets_target"] = (t is None or r["us"] <= t) and r.get("ratio_vs_nccl", 0) <= 1.0
    return rows


def _read_partial(path: str) -> list:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _fmt_size(b: int) -> str:
    return f"{b // MiB}M" if b >= MiB else f"{b // KiB}K"


def print_tables(rows: list) -> None:
    def cell(op, impl, size):
        r = next((r for r in rows if r["op"] == op and r.get("impl") == impl and r.get("size_bytes") == size), None)
        if r is None or "us" not in r:
            return "n/a" if r is None else "err"
        return f"{r['us']:.2f}" + ("" if r.get("correct", True) else "!")

    sizes = sorted({r["size_bytes"] for r in rows if r["op"] == "all_reduce"})
    impls = ["ll", "oneshot", "twoshot", "auto", "nccl", "symm_one_shot", "symm_two_shot"]
    print("\nall_reduce bf16, us per op in a CUDA graph (max over ranks; ! = wrong result)")
    print(f"{'size':>6} " + " ".join(f"{i[:13]:>13}" for i in impls) + f" {'auto/nccl':>9} {'auto GB/s':>9} {'target':>7}")
    for s in sizes:
        a = next((r for r in rows if r["op"] == "all_reduce" and r.get("impl") == "auto" and r["size_bytes"] == s), {})
        tgt = a.get("target_us")
        mark = "" if "meets_target" not in a else (" ok" if a["meets_target"] else " MISS")
        print(f"{_fmt_size(s):>6} " + " ".join(f"{cell('all_reduce', i, s):>13}" for i in impls)
              + f" {a.get('ratio_vs_nccl', float('nan')):>9.3f} {a.get('busbw_GBps', float('nan')):>9.1f}"
              + f" {(str(tgt) if tgt else '-'):>7}{mark}")
    for op in ("reduce_scatter", "all_gather"):
        print(f"\n{op} bf16 (size = {'input' if op == 'reduce_scatter' else 'output'} bytes): us ours / nccl, ratio")
        for s in sizes:
            r = next((r for r in rows if r["op"] == op and r.get("impl") == "ours" and r["size_bytes"] == s), {})
            print(f"{_fmt_size(s):>6} {cell(op, 'ours', s):>9} {cell(op, 'nccl', s):>9} {r.get('ratio_vs_nccl', float('nan')):>7.3f}")
    sweep = [r for r in rows if r["op"] == "all_reduce_sweep" and "us" in r]
    if sweep:
        print("\nlaunch-config sweep (all_reduce): best per size and algorithm vs topology's default")
        for s in sorted({r["size_bytes"] for r in sweep}):
            for alg in ("ll", "oneshot", "twoshot"):
                cand = [r for r in sweep if r["size_bytes"] == s and r["algorithm"] == alg]
                if cand:
                    best = min(cand, key=lambda r: r["us"])
                    dflt = next((r for r in cand if r["sweep"] == "default"), best)
                    c = best["config"]
                    print(f"{_fmt_size(s):>6} {alg:>8} best {best['sweep']:<9} {best['us']:8.2f} us (grid {c['grid']} "
                          f"b{c['block']} w{c['num_warps']}), default {dflt['us']:8.2f} us (grid {dflt['config']['grid']})")


def plot(rows: list, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as e:
        return f"no plot ({e})"
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, ops in ((axes[0], ("all_reduce",)), (axes[1], ("reduce_scatter", "all_gather"))):
        for op in ops:
            for impl in sorted({r["impl"] for r in rows if r["op"] == op and "us" in r}):
                pts = sorted((r["size_bytes"], r["us"]) for r in rows if r["op"] == op and r.get("impl") == impl and "us" in r)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                        label=impl if len(ops) == 1 else f"{op}:{impl}")
        if ops == ("all_reduce",):
            tg = sorted((s, target_us(s)) for s in {r["size_bytes"] for r in rows if r["op"] == "all_reduce"} if target_us(s))
            ax.scatter([t[0] for t in tg], [t[1] for t in tg], marker="_", s=200, c="k", label="issue-3 target (auto)")
        xs = sorted({r["size_bytes"] for r in rows if r["op"] in ops and "us" in r})
        ax.set_xscale("log")
        ax.set_xticks(xs, [_fmt_size(x) for x in xs], rotation=45, fontsize=7)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set(yscale="log", xlabel="bytes", ylabel="us per op (CUDA graph)", title=" / ".join(ops) + " bf16, 2 ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 sizes, shorter graphs (about 1-2 minutes)")
    p.add_argument("--sweep-grid", action="store_true", help="also time other launch configurations of our kernels")
    p.add_argument("--sizes", default="", help="comma-separated sizes in KiB (overrides the size list)")
    p.add_argument("--out", default="benchmarks/results/comm_2xh200.json")
    p.add_argument("--dry-run", "--cpu", dest="dry_run", action="store_true", help="2 CPU ranks, Triton interpreter")
    p.add_argument("--timeout", type=float, default=540.0, help="launcher backstop, seconds")
    args = p.parse_args(argv)
    ensure_repo_on_path()
    from sparkinfer.errors import RankFailed
    from sparkinfer.runtime import run_ranks

    out = Path("/tmp/sparkinfer_comm_dryrun.json" if args.dry_run and args.out == p.get_default("out") else args.out)
    cfg, meta = plan(args), metadata()
    t0 = time.perf_counter()
    cfg["partial"] = f"/tmp/sparkinfer_bench_comm_{os.getpid()}"
    failure = None
    try:
        per_rank = run_ranks(_bench_rank, 2, backend="cpu" if args.dry_run else "cuda", args=(cfg,), timeout_s=args.timeout)
    except RankFailed as e:  # keep what the ranks measured before it
        failure = f"rank {e.rank}: {e.detail[-3000:]}"
        per_rank = [_read_partial(f"{cfg['partial']}.rank{r}.jsonl") for r in range(2)]
        k = min(len(x) for x in per_rank)
        per_rank = [x[:k] + [{"op": "rank_info", "seconds": None, "error": failure}] for x in per_rank]
        print(f"RUN FAILED (partial results kept): {failure}", flush=True)
    for r in range(2):
        with contextlib.suppress(OSError):
            os.remove(f"{cfg['partial']}.rank{r}.jsonl")
    peer = None
    if not args.dry_run:
        try:
            peer = peer_copy_bw()
        except Exception as e:  # noqa: BLE001
            peer = {"op": "peer_copy", "error": f"{type(e).__name__}: {e}"}
    rows = merge(per_rank, 2, (peer or {}).get("uni_GBps"))
    rows += [peer] if peer else []
    for r in rows:
        r["bench"], r["mode"] = "comm", "dry-run" if args.dry_run else ("quick" if args.quick else "full")
    append_rows(out, rows, meta)
    print_tables(rows)
    if peer:
        print(f"\npeer copy 256 MiB: {peer}")
    info = next(r for r in rows if r["op"] == "rank_info")
    bad = [f"{r['op']}:{r.get('impl')}:{r['size_bytes']}" for r in rows if r.get("correct") is False]
    errs = [f"{r['op']}:{r.get('impl')}:{r.get('size_bytes')}: {r['error'][:160]}" for r in rows if "error" in r]
    print(f"\n{meta['gpu']} x2, commit {str(meta.get('commit'))[:10]}, {time.perf_counter() - t0:.0f} s "
          f"(ranks {info['seconds']} s); wrong results: {bad or 'none'}")
    for e in sorted(set(errs))[:12]:
        print(f"  error {e}")
    print(f"rows appended to {out}; plot: {plot(rows, out.with_suffix('.png'))}")
    return 1 if bad or failure else 0


if __name__ == "__main__":
    sys.exit(main())
