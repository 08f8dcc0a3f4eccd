"""Fused MoE on one GPU: correctness at real shapes, then time against the HBM floor.

Legend: M (= T) tokens, E experts, K top-k, H hidden, I intermediate per rank.

One run: 1. device limits measured here: copy bandwidth (large device-to-device
copy, bytes read + written) and the bf16 tensor-core rate (8192^3 matmul);
2. per shape and format, correctness of every family the plan uses (router +
MoE vs the fp32 reference: NVFP4 / fp8_block of their dequantized weights,
fp8_block with its E4M3 activations), eager repeat and CUDA-graph replay bitwise
equal to eager; 3. timing (CUDA graph, median) of
sparkinfer, `torch._grouped_mm` (bf16, with torch sort/gather/scatter) and a
per-expert torch loop (bf16), with the active experts' weight bytes and the
fraction of the HBM floor (those bytes at the measured copy bandwidth). A graph
replays G calls with different routings, so L2 rarely serves a repeat.
Routing is not timed for sparkinfer (top-k ids are given); the baselines' routing
setup (sort, offsets, gather; the loop's per-expert row lists) is timed. The
outputs of every timed graph are checked against the fp32 reference (rows' `ok`).
Each row also carries the GPU's specified peaks (`common.SPEC_PEAKS`: H200
4.8 TB/s, 989 TFLOP/s dense bf16) and the fractions of them.

Writes JSON rows (with GPU, driver, versions, commit, date, command) to --out,
a PNG beside it, and prints a table. --quick: fewer M values (~1-2 min on an
H200 with compilation). --sweep: no checks, no baselines; times the launch
configs `sparkinfer.moe.tuning.candidates` proposes around the plan's choice at
M in {1, 8, 64, 4096} (~3 min), the measurements the planner's thresholds and
tiles need (NVFP4 grouped: the dequantized path vs the NVFP4 kernels,
NVFP4_DEQUANT_MIN_ROWS). --dry-run: tiny shapes on CPU through the Triton interpreter, to
check this script's logic without a GPU.

    sparkinfer bench moe --quick
    sparkinfer bench moe --sweep        # -> benchmarks/results/sweeps/moe_sweep_<machine>.json
    sparkinfer bench moe --sweep --formats nvfp4 --m 256,512,1024,2048,4096
    sparkinfer bench moe --shapes dsv3,dsv3_tp8     # full, in two parts
    sparkinfer bench moe --shapes qwen3,mixtral
    sparkinfer bench moe --shapes glm_air_tp8,glm_air_tp8_i256 --quick   # a padded I (176 per rank)
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from pathlib import Path

from sparkinfer.bench import common
from sparkinfer.bench.timing import median, time_calls

__all__ = ["add_arguments", "main", "SHAPES", "Ctx", "device_limits", "failed_checks"]

SHAPES = {
    "dsv3": dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048),
    "qwen3": dict(num_experts=128, top_k=8, hidden=2048, intermediate=768),
    "mixtral": dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336),
    "dsv3_tp8": dict(num_experts=256, top_k=8, hidden=7168, intermediate=256),
    # GLM-4.5-Air's experts at TP 8: 1408 / 8 = 176 per rank, which the plan pads to 192
    # (moe/plan.py PAD_MULTIPLE); rows time the padded layer against the floor of the
    # unpadded bytes. Not in the default run (--shapes glm_air_tp8); fp8_block skips it
    # (its 128 x 128 blocks need I a multiple of 128).
    "glm_air_tp8": dict(num_experts=128, top_k=8, hidden=4096, intermediate=176),
    # The same layer at I 256: what padding 176 to a multiple of 128 (chunk 128) would cost,
    # beside glm_air_tp8's 192 (chunk 64, whose NVFP4 FC2 at BN 64 loads its scale tile
    # synchronously: tests/moe/test_compile_sm90.py), to choose moe/plan.py PAD_MULTIPLE.
    "glm_air_tp8_i256": dict(num_experts=128, top_k=8, hidden=4096, intermediate=256),
}
DEFAULT_SHAPES = ("dsv3", "qwen3", "mixtral", "dsv3_tp8")
DRY_SHAPES = {"tiny": dict(num_experts=8, top_k=2, hidden=128, intermediate=128),  # fp8: 128s
              "tiny_padded": dict(num_experts=8, top_k=2, hidden=128, intermediate=48)}  # --shapes tiny_padded
FORMATS = "nvfp4,bf16,fp8_block"
FULL_M = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
QUICK_M = (1, 8, 64, 4096)
SWEEP_M = QUICK_M
DRY_M = (1, 3, 20)


def _shape_list(text: str) -> list[str]:
    import argparse

    names = text.split(",")
    unknown = sorted(set(names) - set(SHAPES) - set(DRY_SHAPES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shapes {unknown}; choose from {sorted(SHAPES)} "
                                         f"(--dry-run: {sorted(DRY_SHAPES)})")
    return names


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"M in {QUICK_M}")
    p.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes")
    p.add_argument("--shapes", default=None, type=_shape_list,
                   help=f"comma list of {','.join(SHAPES)} (default {','.join(DEFAULT_SHAPES)})")
    p.add_argument("--m", default=None, help="comma list of token counts (overrides presets)")
    p.add_argument("--formats", default=FORMATS)
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--nvfp4-decode", choices=("ptx", "arith"), default=None,
                   help="NVFP4 weight decode (default: the plan's; ptx falls back to arith by "
                   "itself if it fails a check; with arith, ptx is probed at M=4 and reported)")
    p.add_argument("--sweep", action="store_true",
                   help=f"time tuning.candidates() configs at M in {SWEEP_M}; no checks, no baselines")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting timings after this many seconds (default 120 quick, 170 sweep, 400 full)")
    p.add_argument("--out", default=None,
                   help="JSON rows (default benchmarks/results/moe_<machine>.json; --sweep: results/sweeps/)")


class Ctx:
    """Run-wide state: torch modules, device, timing, budget, limits."""

    def __init__(self, args):
        import torch
        import triton

        self.torch, self.triton, self.args = torch, triton, args
        self.cuda = not args.dry_run
        self.dev = "cuda" if self.cuda else "cpu"
        self.t0 = time.time()
        self.budget = args.budget_s or (170.0 if args.sweep else 120.0 if args.quick or
                                        args.dry_run else 400.0)
        self.reps = 2 if args.dry_run else (5 if args.sweep else 8 if args.quick else 15)

    def calls_per_graph(self, m: int, baseline: bool = False) -> int:
        """Routings replayed per timing: enough distinct experts that L2 rarely
        serves a repeat at small M; one on CPU dry runs."""
        if self.args.dry_run:
            return 1
        return (4 if m <= 64 else 1) if baseline else (8 if m <= 64 else 2)

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.budget

    def time_calls(self, calls, *, outs=(), graph: bool = True) -> tuple[float, str]:
        """Seconds per call of the G callables `calls`, replayed back to back
        (CUDA graph when it captures and `graph`, else eager), median of
        self.reps. outs: the calls' output tensors, poisoned (NaN) after the
        timing and written by one more replay of the same graph (or eager
        pass), so the caller checks the exact graph that was timed."""
        torch = self.torch

        def all_calls():
            [c() for c in calls]

        if not self.cuda:
            all_calls()
            sec = median(time_calls(all_calls, self.reps, cuda=False)) / len(calls)
            mode, fn = "eager-cpu", all_calls
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                all_calls()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            mode, fn = ("graph", None) if graph else ("eager (host-synchronizing setup)", all_calls)
            if graph:
                try:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        all_calls()
                    fn = g.replay
                except Exception as exc:  # noqa: BLE001 - fall back, and say so in the row
                    torch.cuda.synchronize()
                    mode, fn = f"eager ({type(exc).__name__})", all_calls
            fn()
            torch.cuda.synchronize()
            sec = median(time_calls(fn, self.reps, cuda=True)) / len(calls)
        for o in outs:
            o.fill_(float("nan"))
        if outs:
            fn()
            if self.cuda:
                torch.cuda.synchronize()
        return sec, mode


def device_limits(ctx) -> dict:
    torch = ctx.torch
    n = (2 << 30) if ctx.cuda else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.dev)
    dst = torch.empty_like(src)
    src.fill_(1)
    t_copy = median(time_calls(lambda: dst.copy_(src), 10, cuda=ctx.cuda))
    src = dst = None  # free both before the matmul's operands
    s = 8192 if ctx.cuda else 512
    a = torch.randn(s, s, dtype=torch.bfloat16, device=ctx.dev)
    b = torch.randn(s, s, dtype=torch.bfloat16, device=ctx.dev)
    a @ b
    t_mm = median(time_calls(lambda: a @ b, 10, cuda=ctx.cuda))
    return {"copy_gbs": 2 * n / t_copy / 1e9, "bf16_tflops": 2 * s ** 3 / t_mm / 1e12}


def _runs(args) -> tuple[dict, tuple]:
    """(shapes, token counts) of this run."""
    from sparkinfer.errors import PlanError

    table, default = (DRY_SHAPES, ("tiny",)) if args.dry_run else (SHAPES, DEFAULT_SHAPES)
    names = args.shapes or default
    if any(n not in table for n in names):
        raise PlanError(f"--shapes {','.join(names)}: {'--dry-run runs' if args.dry_run else 'a GPU run takes'} "
                        f"{', '.join(table)}")
    shapes = {n: table[n] for n in names}
    ms = DRY_M if args.dry_run else (SWEEP_M if args.sweep else QUICK_M if args.quick else FULL_M)
    if args.m:
        ms = tuple(int(v) for v in args.m.split(","))
    return shapes, ms


def main(args) -> int:
    from sparkinfer.bench.moe_cases import Layer, checks, time_baselines, time_ours
    from sparkinfer.bench.moe_report import plot, print_tables
    from sparkinfer.bench.report import progress
    from sparkinfer.errors import DeviceError

    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    shapes, ms = _runs(args)
    ctx = Ctx(args)
    if ctx.cuda and not ctx.torch.cuda.is_available():
        raise DeviceError("sparkinfer bench moe: no CUDA device; use --dry-run to run it on the CPU")
    formats = args.formats.split(",")
    meta = common.metadata(args)
    out = Path(args.out) if args.out else common.default_out("moe", meta, 1, dry_run=args.dry_run,
                                                              sweep=args.sweep)
    faulthandler.dump_traceback_later(ctx.budget + 180, exit=True, file=sys.__stderr__)  # never hang
    lim = {**device_limits(ctx), **common.spec_peaks(meta.get("gpu"))}
    print(f"device: {meta.get('gpu')}, copy {lim['copy_gbs']:.0f} GB/s, bf16 {lim['bf16_tflops']:.0f} TFLOP/s"
          f" measured (specified: {lim.get('spec_hbm_gbs', '?')} GB/s, {lim.get('spec_bf16_tflops', '?')} TFLOP/s)",
          flush=True)
    all_rows = [dict(kind="device", bench="moe", **lim)]
    common.append_rows(out, all_rows[:1], meta)
    baselines = not (args.no_baselines or args.sweep)
    per_shape = {name: shape_formats(shape, formats) for name, shape in shapes.items()}
    steps = sum((0 if args.sweep else len(f)) + len(ms) * (len(f) + 2 * baselines) for f in per_shape.values())
    try:
        with progress(steps, "moe") as advance:
            for name, shape in shapes.items():
                rows = []
                formats = per_shape[name]
                layer = Layer(ctx, name, shape, max(ms))
                decode = {f: args.nvfp4_decode for f in formats}
                for f in formats if not args.sweep else ():
                    rows += checks(ctx, layer, f, ms, decode)
                    advance(f"{name} {f} checks")
                for f in formats:
                    rows += time_ours(ctx, layer, lim, f, ms, decode[f], advance)
                if baselines:
                    rows += time_baselines(ctx, layer, lim, ms, advance)
                for r in rows:
                    r["bench"] = "moe"
                common.append_rows(out, rows, meta)  # shape by shape: a crash keeps what was measured
                all_rows += rows
                del layer
                if ctx.cuda:
                    ctx.torch.cuda.empty_cache()
    finally:
        faulthandler.cancel_dump_traceback_later()
    print_tables(all_rows, f"{meta['gpu']}, commit {str(meta.get('commit'))[:10]}")
    png = plot(all_rows, out.with_suffix(".png"))
    bad = failed_checks(all_rows)
    timed = sum(r["kind"] == "time" for r in bad)
    print(f"checks failed: {len(bad)} ({len(bad) - timed} check rows, {timed} timed graphs); "
          f"{time.time() - ctx.t0:.0f} s; rows appended to {out}" + (f", plot {png}" if png else ""), flush=True)
    return 1 if bad else 0


def shape_formats(shape: dict, formats: list[str]) -> list[str]:
    """The formats a shape runs: fp8_block only where H and I are multiples of its 128 x 128
    blocks (the plan refuses the rest; a skipped format is printed)."""
    if "fp8_block" in formats and (shape["hidden"] % 128 or shape["intermediate"] % 128):
        print(f"fp8_block skipped: H={shape['hidden']}, I={shape['intermediate']} are not multiples of 128",
              flush=True)
        return [f for f in formats if f != "fp8_block"]
    return formats


def failed_checks(rows: list[dict]) -> list[dict]:
    """The rows whose correctness check failed: check rows, and time rows whose timed
    graph's own output failed its check (`_check_timed` sets their ok). Both decide the
    exit status: a run whose timed graph computed a wrong answer must not exit 0 even
    though its separate check rows passed. Probe rows (an alternative decode tried for
    information) and timings that raised (rows with `error`, no verdict) are not checks."""
    return [r for r in rows if r.get("kind") in ("check", "time") and r.get("ok") is False]
