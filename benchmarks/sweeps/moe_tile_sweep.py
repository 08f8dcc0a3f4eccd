#!/usr/bin/env python3
"""MoE `grouped` tiles at large batches: time launch configs against the plan's.

Legend: M (= T) tokens, E experts, K top-k, H hidden, I intermediate, R = M*K
routes, BM routed rows per tile, BN1 / BN2 weight rows per FC1 / FC2 program,
BK reduction elements per step (the plan's chunk).

For M in --m (default 1024, 4096), the four bench_moe shapes and --formats
(default bf16), times the planned config and `tuning.tile_candidates` (at most
12 per shape and M: BM 64/128/256, BN1 64/128, BN2 128/256, 4 or 8 warps,
stages 2..4, BK 64 or 128; every one compiles for sm_90 without spills, see
--sm90). Each config: its output on the first routing (poisoned first), eagerly
and from the timed graph (poisoned after the timing, replayed once more), against
the fp32 reference with `sparkinfer.moe.reference.compare_to_reference` (cosine,
relative error norm and worst element, the format's bounds in `TOLERANCES`; a
cosine alone would pass a scaled output), and bitwise against the planned config;
a CUDA-graph median over G routings (bench_moe's routings and weights); an
eager per-kernel split (CUDA events around FC1 and FC2; the rest is sort and
top-k reduce); TFLOP/s of the active FLOPs and the fraction of the bf16 rate
measured here (8192^3 torch matmul) and of the HBM floor (active experts'
weight bytes at the measured copy bandwidth); the share of padded rows that
hold routes ("row_util"). Routing is not timed.

Writes JSON rows (GPU, driver, versions, commit, date, command: `sparkinfer.bench.common.metadata`)
to --out and prints a table per shape and M. --budget-s: no new timing starts
after it. --sm90: no GPU; compiles every candidate's FC1 and FC2 for sm_90 on
the CPU (ptxas -v) and prints registers, spills, shared memory, the wgmma shape
and programs per SM. --dry-run: tiny shapes through the Triton interpreter on
the CPU, to check this script's logic.

    python3 benchmarks/sweeps/moe_tile_sweep.py --shapes dsv3,qwen3
    python3 benchmarks/sweeps/moe_tile_sweep.py --sm90 --m 4096 --shapes qwen3
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import re
import sys
import tempfile
import time
import types
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # sparkinfer and tests/ without an install
from sparkinfer.bench import common  # noqa: E402  (imports nothing heavy)
from sparkinfer.bench.timing import median  # noqa: E402

DRY_SHAPES = {"tiny": dict(num_experts=8, top_k=2, hidden=256, intermediate=128)}
DRY_M = (40, 256)  # planned BM 16 (TILES_SMALL) and BM 64 (TILES_LARGE)
SMEM_PER_SM = 233472  # sm_90: 228 KiB per SM, 1 KiB of it reserved per program
REGS_PER_SM = 65536


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1024,4096", help="comma list of token counts")
    ap.add_argument("--shapes", default=None, help="comma list of bench_moe shapes (default all)")
    ap.add_argument("--formats", default="bf16", help="bf16, fp8_block and/or nvfp4")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="start no timing after this many seconds (default 240)")
    ap.add_argument("--reps", type=int, default=5, help="timed graph replays (median)")
    ap.add_argument("--orders", default=None, help="comma list of group_m values: time the "
                    "planned tiles in those grouped program orders and with TMA loads "
                    "(tuning.order_candidates) instead of the tile table")
    ap.add_argument("--tiles", default=None, help="comma list of candidate names (tuning's tile "
                    "tables): time only those beside the planned config ('none': the planned alone)")
    ap.add_argument("--small-tiles", action="store_true", help="time tuning.TILES_SMALL (BM <= 32 and a few "
                    "BM 64) whatever BM the plan chose")
    ap.add_argument("--sm90", action="store_true", help="CPU only: compile every candidate for "
                    "sm_90 and report registers, spills, shared memory, wgmma shapes")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes")
    ap.add_argument("--out", default=None, help="default benchmarks/results/sweeps/"
                    "moe_tile_sweep_h200.json (--sm90: moe_tile_sweep_sm90.json; --dry-run: the "
                    "temporary directory)")
    args = ap.parse_args(argv)
    default = (os.path.join(tempfile.gettempdir(), "sparkinfer_bench", "moe_tile_sweep_dry_run.json")
               if args.dry_run else "benchmarks/results/sweeps/moe_tile_sweep_sm90.json" if args.sm90 else
               "benchmarks/results/sweeps/moe_tile_sweep_h200.json")
    args.out = args.out or default
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (the checks below import it)
    elif args.sm90:
        os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels cannot be compiled
    from sparkinfer.bench.moe import SHAPES

    if args.shapes and set(args.shapes.split(",")) - set(SHAPES) - set(DRY_SHAPES):
        ap.error(f"--shapes {args.shapes}: choose from {', '.join(sorted(SHAPES))}")
    if set(args.formats.split(",")) - {"bf16", "fp8_block", "nvfp4"}:
        ap.error(f"--formats {args.formats}: choose from bf16, fp8_block, nvfp4")
    if args.tiles:
        unknown = sorted(set(args.tiles.split(",")) - tile_names() - {"none"})
        if unknown:  # an unknown name would time the planned config alone, silently
            ap.error(f"--tiles {','.join(unknown)}: not in tuning's tile tables; known: "
                     f"{', '.join(sorted(tile_names()))} (the NVFP4 dequantized path against its kernels: "
                     "`sparkinfer bench moe --sweep`)")
    return args


def tile_names() -> set[str]:
    """Every candidate name of tuning's tile tables (--tiles)."""
    from sparkinfer.moe import tuning

    return {c[0] for t in (tuning.TILES_SMALL, tuning.TILES_LARGE, tuning.TILES_NVFP4, tuning.TILES_FP8) for c in t}


def gemm_flops(caps, spec, m: int) -> tuple[float, float]:
    """Active FLOPs of FC1 and FC2 at M tokens."""
    r = m * caps.top_k
    n1 = (2 if spec.gated else 1) * caps.intermediate
    return 2.0 * r * caps.hidden * n1, 2.0 * r * caps.intermediate * caps.hidden


def row_util(torch, ids, num_experts: int, block_m: int) -> float:
    """Routes / rows of the tiles that serve them (the rest is padding BM makes)."""
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=num_experts)
    padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    return ids.numel() / max(1, padded)


def weights_for(w0, p):
    """Prepared weights for plan p: the same tensors under p's chunk (bf16 rows
    are plain row-major, so BK is only the kernels' step)."""
    from sparkinfer.moe import MoEWeights

    if w0.chunk == p.chunk:
        return w0
    assert w0.weight_format == "bf16", "only bf16 candidates change BK"
    return MoEWeights("bf16", p.chunk, w0.w1, w0.w2)


def breakdown(ctx, call, reps: int) -> dict:
    """Eager seconds of one call's FC1, FC2 and everything (medians of reps):
    CUDA events (perf_counter on the CPU) around each kernel launch."""
    import sparkinfer.moe.runner as moe_run

    torch = ctx.torch
    marks = []

    def clock():
        if not ctx.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    class Timed:
        def __init__(self, fn, name):
            self.fn, self.name = fn, name

        def __getitem__(self, grid):
            launch = self.fn[grid]

            def go(*a, **k):
                t0 = clock()
                launch(*a, **k)
                marks.append((self.name, t0, clock()))
            return go

    with mock.patch.object(moe_run, "moe_fc1_kernel", Timed(moe_run.moe_fc1_kernel, "fc1")), \
            mock.patch.object(moe_run, "moe_fc2_kernel", Timed(moe_run.moe_fc2_kernel, "fc2")):
        for _ in range(reps):
            t0 = clock()
            call()
            marks.append(("all", t0, clock()))
    if ctx.cuda:
        torch.cuda.synchronize()

    def sec(a, b):
        return a.elapsed_time(b) * 1e-3 if ctx.cuda else b - a

    return {n: median([sec(a, b) for m, a, b in marks if m == n])
            for n in ("fc1", "fc2", "all")}


def candidates(p0, m: int, orders=None, small=False, tiles=None) -> list:
    """(name, plan) to compile or time at M = m: tuning's order candidates (orders) or tile
    table, only the names in tiles beside "planned" when tiles is given."""
    from sparkinfer.moe.tuning import order_candidates, tile_candidates

    cands = order_candidates(p0, m, orders) if orders else tile_candidates(p0, m, small)
    return [(n, p) for n, p in cands if tiles is None or n == "planned" or n in tiles]


def time_shape(ctx, layer, fmt, ms, lim, orders=None, small=False, tiles=None) -> list[dict]:
    """Rows of every candidate of one shape and format at each M (tiles: only these names
    beside "planned")."""
    torch = ctx.torch
    from sparkinfer.moe import allocate_scratch, bind, moe_reference, run
    from sparkinfer.moe.reference import compare_to_reference

    p0, w0, _, src = layer.build(fmt)
    rows = []
    for m in ms:
        g_calls = ctx.calls_per_graph(m)
        x = torch.randn(m, layer.h, device=ctx.dev).bfloat16()
        routings = [layer.routing(m, 1000 * m + s) for s in range(g_calls)]
        active = sum(torch.unique(ids).numel() for ids, _ in routings) / g_calls
        ref = moe_reference(x, src, routings[0], spec=p0.spec)
        f1, f2 = gemm_flops(p0.caps, p0.spec, m)
        planned_out, planned_us = None, None
        cands = candidates(p0, m, orders, small, tiles)
        for name, p in cands:
            if ctx.over_budget():
                print(f"budget: skipping {layer.name} {fmt} M={m} {name}", flush=True)
                continue
            cfg = p.config_for(m)
            head = dict(kind="time", shape=layer.name, format=fmt, M=m, name=name,
                        chunk=p.chunk, **dataclasses.asdict(cfg), E=layer.e, K=layer.k,
                        H=layer.h, I=layer.i)
            try:
                w = weights_for(w0, p)
                scratch = allocate_scratch(p, ctx.dev)
                outs = [torch.full((m, layer.h), float("nan"), dtype=torch.bfloat16,
                                   device=ctx.dev) for _ in range(g_calls)]
                binds = [bind(p, scratch, w, x=x, out=o, topk_ids=ids, topk_weights=tw)
                         for o, (ids, tw) in zip(outs, routings)]
                t0 = time.time()
                run(binds[0])  # compiles
                if ctx.cuda:
                    torch.cuda.synchronize()
                compile_s = time.time() - t0
                first = outs[0].clone()
                if planned_out is None:
                    planned_out = first
                same = bool(torch.equal(first, planned_out))
                sec, mode = ctx.time_calls([lambda b=b: run(b) for b in binds], outs=outs)
                # the eager output and the timed graph's, each against the reference; the
                # row keeps the worse (a failing one first)
                cmp = max((compare_to_reference(o, ref, weight_format=fmt) for o in (first, outs[0])),
                          key=lambda c: (not c.ok, c.rel_norm))
                split = breakdown(ctx, lambda b=binds[0]: run(b), ctx.reps)
            except Exception as exc:  # noqa: BLE001 - e.g. a config out of resources
                err = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"{layer.name:8s} {fmt:5s} M={m:<5d} {name}: {err}", flush=True)
                if "CUDA error" in str(exc):
                    raise
                rows.append(dict(head, error=err))
                continue
            planned_us = planned_us or sec * 1e6
            tflops = (f1 + f2) / sec / 1e12
            floor = active * w.expert_bytes() / (lim["copy_gbs"] * 1e9)
            r = dict(head, us=sec * 1e6, mode=mode, tflops=tflops,
                     frac_tc=tflops / lim["bf16_tflops"], frac_floor=floor / sec,
                     x_planned=planned_us / (sec * 1e6), fc1_us=split["fc1"] * 1e6,
                     fc2_us=split["fc2"] * 1e6,
                     rest_us=(split["all"] - split["fc1"] - split["fc2"]) * 1e6,
                     eager_us=split["all"] * 1e6,
                     fc1_tc=f1 / split["fc1"] / 1e12 / lim["bf16_tflops"],
                     fc2_tc=f2 / split["fc2"] / 1e12 / lim["bf16_tflops"],
                     row_util=row_util(torch, routings[0][0], layer.e, cfg.block_m),
                     active_experts=active, cosine=cmp.cosine, rel_norm=cmp.rel_norm,
                     max_rel=cmp.max_rel, **{f"tol_{k}": v for k, v in dataclasses.asdict(cmp.tol).items()},
                     bitwise_planned=same,
                     ok=cmp.ok, compile_s=compile_s, tc_tflops=lim["bf16_tflops"],
                     copy_gbs=lim["copy_gbs"])
            rows.append(r)
            print(f"{layer.name:8s} {fmt:5s} M={m:<5d} {name:15s} {r['us']:9.1f} us "
                  f"x{r['x_planned']:.2f} tc {100 * r['frac_tc']:5.1f}% fc1 "
                  f"{100 * r['fc1_tc']:5.1f}% fc2 {100 * r['fc2_tc']:5.1f}% rel_norm "
                  f"{cmp.rel_norm:.2e} {'OK' if r['ok'] else f'FAIL ({cmp})'}", flush=True)
        del ref
    return rows


def table(rows) -> None:
    """Per (shape, format, M): configs fastest first."""
    keys = sorted({(r["shape"], r["format"], r["M"]) for r in rows if r.get("kind") == "time"})
    for key in keys:
        rs = sorted((r for r in rows if (r.get("shape"), r.get("format"), r.get("M")) == key
                     and "us" in r), key=lambda r: r["us"])
        print(f"\n{key[0]} {key[1]} M={key[2]}\n{'name':15s} {'BM':>3s} {'BN1':>3s} {'BN2':>3s} "
              f"{'w':>1s} {'s1':>2s} {'s2':>2s} {'BK':>3s} {'us':>9s} {'x_plan':>6s} {'tc%':>5s} "
              f"{'floor%':>6s} {'fc1us':>8s} {'fc1tc%':>6s} {'fc2us':>8s} {'fc2tc%':>6s} "
              f"{'rest':>6s} {'rows%':>5s} ok")
        for r in rs:
            print(f"{r['name']:15s} {r['block_m']:3d} {r['block_n1']:3d} {r['block_n2']:3d} "
                  f"{r['num_warps']:1d} {r['stages1']:2d} {r['stages2']:2d} {r['chunk']:3d} "
                  f"{r['us']:9.1f} {r['x_planned']:6.2f} {100 * r['frac_tc']:5.1f} "
                  f"{100 * r['frac_floor']:6.1f} {r['fc1_us']:8.1f} {100 * r['fc1_tc']:6.1f} "
                  f"{r['fc2_us']:8.1f} {100 * r['fc2_tc']:6.1f} {r['rest_us']:6.1f} "
                  f"{100 * r['row_util']:5.1f} {'OK' if r['ok'] else 'FAIL'}")


def sm90_usage(compiled, warps: int) -> dict:
    """ptxas registers / spills, shared memory, wgmma shapes, async depth and
    programs per SM (shared memory, registers and 64 warps bound it)."""
    from tests.moe.sm90_compile import ptxas_usage

    u = ptxas_usage(compiled)
    ptx = compiled.asm["ptx"]
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    waits = sorted({int(v) for v in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)})
    regs = -(-max(u["regs"], 1) // 8) * 8
    per_sm = min(SMEM_PER_SM // (u["shared"] + 1024), REGS_PER_SM // (regs * 32 * warps),
                 64 // warps)
    return dict(regs=u["regs"], spill=u["spill"], smem=u["shared"], wgmma=",".join(shapes),
                wgmma_wait=waits, cp_async=len(re.findall(r"cp\.async\.cg", ptx)),
                programs_per_sm=per_sm)


def sm90_report(shapes, formats, ms, orders=None, small=False, tiles=None) -> list[dict]:
    """Compile every candidate's FC1 and FC2 at real dims (meta tensors) for sm_90 (tiles:
    only these names beside "planned")."""
    import torch

    from sparkinfer.bench import moe_cases
    from sparkinfer.moe import MoECaps, allocate_scratch, bind, plan
    from tests.moe._util import meta_weights
    from tests.moe.sm90_compile import compile_sm90, record_launches

    rows = []
    for sname, shape in shapes.items():
        for fmt in formats:
            # bench_moe's spec (DeepSeek-V3 routing for E 256); routing is not compiled here
            spec = moe_cases.Layer.spec(types.SimpleNamespace(dsv3=shape["num_experts"] == 256),
                                        fmt)
            p0 = plan(MoECaps(max_tokens=max(ms), **shape), spec)
            for m in ms:
                cands = candidates(p0, m, orders, small, tiles)
                for name, p in cands:
                    meta = dict(dtype=torch.bfloat16, device="meta")
                    b = bind(p, allocate_scratch(p, "meta"), meta_weights(p),
                             x=torch.empty(m, shape["hidden"], **meta),
                             out=torch.empty(m, shape["hidden"], **meta),
                             topk_ids=torch.empty(m, shape["top_k"], dtype=torch.int32,
                                                  device="meta"),
                             topk_weights=torch.empty(m, shape["top_k"], device="meta"))
                    cfg = b.config
                    for ln in record_launches(b):
                        kern = ln.fn.fn.__name__
                        if kern not in ("moe_fc1_kernel", "moe_fc2_kernel"):
                            continue
                        try:
                            u = sm90_usage(compile_sm90(ln), cfg.num_warps)
                        except Exception as exc:  # noqa: BLE001 - report, keep going
                            u = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                        r = dict(kind="sm90", shape=sname, format=fmt, M=m, name=name,
                                 kernel=kern[4:7], chunk=p.chunk, grid=list(ln.grid),
                                 **dataclasses.asdict(cfg), **u)
                        rows.append(r)
                        bn = cfg.block_n1 if kern == "moe_fc1_kernel" else cfg.block_n2
                        st = cfg.stages1 if kern == "moe_fc1_kernel" else cfg.stages2
                        desc = (f"regs {u['regs']:3d} spill {u['spill']:4d} smem "
                                f"{u['smem'] // 1024:3d}K {u['wgmma']:11s} wait "
                                f"{u['wgmma_wait']} per-SM {u['programs_per_sm']}"
                                if "error" not in u else u["error"][:90])
                        print(f"{sname:8s} {fmt:5s} M={m:<5d} {name:15s} {kern[4:7]} BM "
                              f"{cfg.block_m:3d} BN {bn:3d} w{cfg.num_warps} s{st} BK "
                              f"{p.chunk:3d} grid {ln.grid[0]}x{ln.grid[1]} {desc}",
                              flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)  # sets TRITON_INTERPRET for --dry-run and --sm90
    from sparkinfer.bench import moe as bench_moe
    from sparkinfer.bench.moe_cases import Layer

    shapes = DRY_SHAPES if args.dry_run else bench_moe.SHAPES
    if args.shapes and not args.dry_run:
        shapes = {s: bench_moe.SHAPES[s] for s in args.shapes.split(",")}
    ms = DRY_M if args.dry_run else tuple(int(v) for v in args.m.split(","))
    formats = args.formats.split(",")
    orders = tuple(int(g) for g in args.orders.split(",")) if args.orders else None
    meta = common.metadata(None if argv is None else
                           types.SimpleNamespace(argv=["python3", "benchmarks/sweeps/moe_tile_sweep.py", *argv]))
    if args.sm90:
        rows = sm90_report(shapes, formats, ms, orders, args.small_tiles,
                           tuple(args.tiles.split(",")) if args.tiles else None)
        bad = [r for r in rows if r.get("spill", 1) or r.get("programs_per_sm", 0) < 1]
        common.append_rows(args.out, rows, meta)
        print(f"\nwrote {args.out}; {len(rows)} kernels, {len(bad)} spill, fail or do not fit")
        return 1 if bad else 0
    ns = types.SimpleNamespace(dry_run=args.dry_run, budget_s=args.budget_s, sweep=True,
                               quick=False)
    ctx = bench_moe.Ctx(ns)
    ctx.reps = 1 if args.dry_run else args.reps
    faulthandler.dump_traceback_later(ctx.budget + 240, exit=True)  # never hang
    torch = ctx.torch
    if ctx.cuda and not torch.cuda.is_available():
        sys.exit("moe_tile_sweep: no CUDA device (use --dry-run or --sm90 on a CPU)")
    lim = bench_moe.device_limits(ctx)
    print(f"device: {meta.get('gpu')}  copy {lim['copy_gbs']:.0f} GB/s  bf16 "
          f"{lim['bf16_tflops']:.0f} TFLOP/s", flush=True)
    all_rows = [dict(kind="device", **lim)]
    common.append_rows(args.out, all_rows, meta)
    for name, shape in shapes.items():
        if ctx.over_budget():
            print(f"budget: skipping {name}", flush=True)
            continue
        layer = Layer(ctx, name, shape, max(ms))
        rows = []
        for fmt in formats:
            rows += time_shape(ctx, layer, fmt, ms, lim, orders, args.small_tiles,
                               tuple(args.tiles.split(",")) if args.tiles else None)
        common.append_rows(args.out, rows, meta)
        all_rows += rows
        del layer
        if ctx.cuda:
            torch.cuda.empty_cache()
    table(all_rows)
    bad = [r for r in all_rows if r.get("kind") == "time" and not r.get("ok", False)]
    print(f"\nwrote {args.out}; {len(bad)} configs failed or wrong; "
          f"{time.time() - ctx.t0:.0f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
