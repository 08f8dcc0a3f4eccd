#!/usr/bin/env python3
"""Fused MoE on one GPU: correctness at real shapes, then time against the HBM floor.

Legend: M (= T) tokens, E experts, K top-k, H hidden, I intermediate per rank.

One run: 1. device limits measured here: copy bandwidth (large device-to-device
copy, bytes read + written) and the bf16 tensor-core rate (8192^3 matmul); 2. per
shape and format, correctness of every family the plan uses (router + MoE vs the
fp32 reference: NVFP4 / fp8_block of their dequantized weights, fp8_block with
its E4M3 activations), eager repeat and CUDA-graph replay bitwise equal to eager;
3. timing (CUDA graph, median) of sparkinfer, `torch._grouped_mm` (bf16, with
torch sort/gather/scatter) and a per-expert torch loop (bf16), with the active
experts' weight bytes and the fraction of the HBM floor (those bytes at the
measured copy bandwidth). A graph replays G calls with different routings, so
L2 rarely serves a repeat. Routing is not timed (top-k ids are given).

Writes JSON rows (with GPU, driver, versions, commit, date, command) to --out, a
PNG beside it, and prints a table. --quick: fewer M values (~1-2 min on an H200
with compilation). --sweep: no checks, no baselines; times the configs
`sparkinfer.moe.tuning.candidates` proposes around the plan's at M in {1, 8, 64,
4096} (~3 min), what the planner's thresholds and tiles need (NVFP4 grouped: the
dequantized path vs the NVFP4 kernels, NVFP4_DEQUANT_MIN_ROWS). --dry-run: tiny
shapes on CPU through the Triton interpreter (checks this script without a GPU).

    python3 benchmarks/bench_moe.py --quick
    python3 benchmarks/bench_moe.py --sweep        # -> benchmarks/results/moe_sweep_h200.json
    python3 benchmarks/bench_moe.py --sweep --formats nvfp4 --m 256,512,1024,2048,4096
    python3 benchmarks/bench_moe.py --shapes dsv3,dsv3_tp8     # full, in two parts
    python3 benchmarks/bench_moe.py --shapes qwen3,mixtral
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (imports nothing heavy)

SHAPES = {
    "dsv3": dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048),
    "qwen3": dict(num_experts=128, top_k=8, hidden=2048, intermediate=768),
    "mixtral": dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336),
    "dsv3_tp8": dict(num_experts=256, top_k=8, hidden=7168, intermediate=256),
}
DRY_SHAPES = {"tiny": dict(num_experts=8, top_k=2, hidden=128, intermediate=128)}  # fp8: 128s
FORMATS = "nvfp4,bf16,fp8_block"
FULL_M = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
QUICK_M = (1, 8, 64, 4096)
SWEEP_M = QUICK_M
DRY_M = (1, 3, 20)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="M in %s" % (QUICK_M,))
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes")
    ap.add_argument("--shapes", default=None, help="comma list of %s" % ",".join(SHAPES))
    ap.add_argument("--m", default=None, help="comma list of token counts (overrides presets)")
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--nvfp4-decode", choices=("ptx", "arith"), default=None,
                    help="NVFP4 weight decode (default: the plan's; ptx falls back to arith by "
                    "itself if it fails a check; with arith, ptx is probed at M=4 and reported)")
    ap.add_argument("--sweep", action="store_true",
                    help="time tuning.candidates() configs at M in %s; no checks, no "
                    "baselines" % (SWEEP_M,))
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting timings after this many seconds (default 120 quick, "
                    "170 sweep, 400 full)")
    ap.add_argument("--out", help="default benchmarks/results/moe_h200.json (--sweep: "
                    "moe_sweep_h200.json; --dry-run: under /tmp)")
    args = ap.parse_args(argv)
    args.out = args.out or (f"{'/tmp' if args.dry_run else 'benchmarks/results'}/moe_"
                            f"{'sweep_' if args.sweep else ''}h200.json")
    return args


class Ctx:
    """Run-wide state: torch modules, device, timing, budget, limits."""

    def __init__(self, args):
        import torch
        import triton

        self.torch, self.triton, self.args = torch, triton, args
        self.cuda = not args.dry_run
        self.dev = "cuda" if self.cuda else "cpu"
        self.t0 = time.time()
        short = args.quick or args.dry_run
        self.budget = args.budget_s or (170.0 if args.sweep else 120.0 if short else 400.0)
        self.reps = 2 if args.dry_run else (5 if args.sweep else 8 if args.quick else 15)

    def calls_per_graph(self, m: int, baseline: bool = False) -> int:
        """Routings replayed per timing: enough distinct experts that L2 rarely
        serves a repeat at small M; one on CPU dry runs."""
        if self.args.dry_run:
            return 1
        return (4 if m <= 64 else 1) if baseline else (8 if m <= 64 else 2)

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.budget

    def time_calls(self, calls) -> tuple[float, str]:
        """Seconds per call of the G callables `calls`, replayed back to back
        (CUDA graph when it captures, else eager), median of self.reps."""
        torch = self.torch

        def all_calls():
            [c() for c in calls]

        if not self.cuda:
            all_calls()
            ts = _common.time_calls(all_calls, self.reps, cuda=False)
            return _common.median(ts) / len(calls), "eager-cpu"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            all_calls()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        mode = "graph"
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
        ts = _common.time_calls(fn, self.reps, cuda=True)
        return _common.median(ts) / len(calls), mode


def device_limits(ctx) -> dict:
    torch = ctx.torch
    n = (2 << 30) if ctx.cuda else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.dev)
    dst = torch.empty_like(src)
    src.fill_(1)
    t_copy = _common.median(_common.time_calls(lambda: dst.copy_(src), 10, cuda=ctx.cuda))
    del src, dst
    s = 8192 if ctx.cuda else 512
    a = torch.randn(s, s, dtype=torch.bfloat16, device=ctx.dev)
    b = torch.randn(s, s, dtype=torch.bfloat16, device=ctx.dev)
    a @ b
    t_mm = _common.median(_common.time_calls(lambda: a @ b, 10, cuda=ctx.cuda))
    return {"copy_gbs": 2 * n / t_copy / 1e9, "bf16_tflops": 2 * s ** 3 / t_mm / 1e12}


class Layer:
    """One shape's random weights: bf16 (also the baselines'), and NVFP4 and
    fp8_block sources made the first time a format is built."""

    def __init__(self, ctx, name, shape, max_tokens):
        torch = ctx.torch
        from _moe_weights import random_fp8_block, random_nvfp4
        self.ctx, self.name, self.shape, self.max_tokens = ctx, name, shape, max_tokens
        e, h, i = shape["num_experts"], shape["hidden"], shape["intermediate"]
        self.e, self.k, self.h, self.i = e, shape["top_k"], h, i
        gen = dict(device=ctx.dev)
        self.w1 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, **gen).mul_(h ** -0.5)
        self.w2 = torch.randn(e, h, i, dtype=torch.bfloat16, **gen).mul_(i ** -0.5)
        self.src = {"bf16": (self.w1, self.w2)}
        self.make = {fmt: (lambda f=f: (f(e, 2 * i, h, ctx.dev), f(e, h, i, ctx.dev)))
                     for fmt, f in (("nvfp4", random_nvfp4), ("fp8_block", random_fp8_block))}
        self.dsv3 = e == 256

    def spec(self, fmt):
        from sparkinfer.moe import MoESpec

        if self.dsv3:  # DeepSeek-V3 routing: 8 groups, keep 4, scale 2.5
            return MoESpec(weight_format=fmt, routing="sigmoid_grouped", n_group=8,
                           topk_group=4, routed_scaling_factor=2.5)
        return MoESpec(weight_format=fmt)

    def build(self, fmt, decode=None):
        """(plan, prepared weights, scratch, source weights) for `fmt`, with the
        NVFP4 decode forced to `decode` (None: the plan's)."""
        from sparkinfer.moe import MoECaps, allocate_scratch, plan, prepare_weights

        caps = MoECaps(max_tokens=self.max_tokens, **self.shape)
        p = plan(caps, self.spec(fmt))
        p = p.with_changes(decode=decode) if decode else p
        src = self.src[fmt] if fmt in self.src else self.src.setdefault(fmt, self.make[fmt]())
        return p, prepare_weights(p, *src), allocate_scratch(p, self.ctx.dev), src

    def routing(self, m, seed):
        torch = self.ctx.torch
        g = torch.Generator(device=self.ctx.dev).manual_seed(seed)
        ids = torch.rand(m, self.e, generator=g, device=self.ctx.dev).topk(self.k).indices
        w = torch.rand(m, self.k, generator=g, device=self.ctx.dev) + 0.1
        return ids.to(torch.int32), w / w.sum(-1, keepdim=True)


def check(ctx, layer, fmt, ts, decode, kind="check") -> list[dict]:
    """Correctness rows for token counts `ts` (one per family/config the plan uses).
    kind "probe": the same checks of a non-default option, reported, never a failure."""
    torch = ctx.torch
    from sparkinfer.moe import bind, moe_reference, run
    from sparkinfer.moe.routing import route_reference

    p, w, scratch, src = layer.build(fmt, decode)
    rows = []
    for t in ts:
        spec = p.spec
        x = torch.randn(t, layer.h, device=ctx.dev).bfloat16()
        logits = torch.randn(t, layer.e, device=ctx.dev)
        bias = torch.randn(layer.e, device=ctx.dev) * 0.1 if layer.dsv3 else None
        out = torch.full((t, layer.h), float("nan"), dtype=torch.bfloat16, device=ctx.dev)
        b = bind(p, scratch, w, x=x, out=out, logits=logits, bias=bias)
        run(b)
        eager = out.clone()
        rid, _ = route_reference(logits, spec, layer.k, bias=bias)
        ids_match = (b.topk_ids == rid).float().mean().item()
        ref = moe_reference(x, src, (b.topk_ids, b.topk_weights), spec=spec)
        cos = torch.nn.functional.cosine_similarity(eager.float().flatten(), ref.flatten(), 0)
        cos = cos.item()
        out.fill_(float("nan"))
        run(b)
        repeat = torch.equal(out, eager)
        replay = None
        if ctx.cuda:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run(b)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            replay = torch.equal(out, eager)
            del g
        ok = cos >= 0.9999 and repeat and replay is not False and ids_match >= 0.999
        decode = b.config.decode if fmt == "nvfp4" else None
        rows.append(dict(kind=kind, shape=layer.name, format=fmt, M=t, decode=decode, ok=ok,
                         family=b.config.family, block_m=b.config.block_m, cosine=cos,
                         ids_match=ids_match, repeat_bitwise=repeat, replay_bitwise=replay))
        label = decode if fmt == "nvfp4" else "-"
        print(f"{kind:5s} {layer.name:8s} {fmt:5s} {label:5s} M={t:<5d} {b.config.family:7s} "
              f"BM={b.config.block_m:<3d} cos={cos:.6f} ids={ids_match:.4f} repeat={repeat} "
              f"replay={replay} {'OK' if ok else 'FAIL'}", flush=True)
    return rows


def checks(ctx, layer, fmt, ms, decode) -> list[dict]:
    """Check rows of one format at M = 4, 64 and max(ms). NVFP4: a failing ptx
    decode falls back to arith (decode[fmt] then says so); the arith decode
    probes ptx at M = 4 (micro), reported as "probe" rows, never a failure."""
    ts = sorted({min(4, max(ms)), min(64, max(ms)), max(ms)})
    rows = check(ctx, layer, fmt, ts, decode[fmt])
    if fmt != "nvfp4":
        return rows
    if rows[0]["decode"] == "ptx" and not all(r["ok"] for r in rows):
        print("!! NVFP4 PTX decode failed a check; re-checking with the arithmetic "
              "decode, which then serves the timings (rows say decode=arith)", flush=True)
        decode[fmt] = "arith"
        rows += check(ctx, layer, fmt, ts, "arith")
    elif rows[0]["decode"] == "arith":
        rows += check(ctx, layer, fmt, ts[:1], "ptx", kind="probe")
    return rows


def _row(ctx, layer, lim, m, fmt, impl, sec, mode, expert_bytes, active):
    k, h, i = layer.k, layer.h, layer.i
    nbytes = active * expert_bytes
    floor = nbytes / (lim["copy_gbs"] * 1e9)
    flops = 2.0 * m * k * (2 * i * h + h * i)
    return dict(kind="time", shape=layer.name, M=m, format=fmt, impl=impl, mode=mode,
                us=sec * 1e6, active_experts=active, weight_bytes=nbytes,
                floor_us=floor * 1e6, frac_floor=floor / sec, tflops=flops / sec / 1e12,
                frac_tc=flops / sec / 1e12 / lim["bf16_tflops"],
                E=layer.e, K=k, H=h, I=i, copy_gbs=lim["copy_gbs"],
                tc_tflops=lim["bf16_tflops"])


def _error_row(layer, m, fmt, impl, exc) -> dict:
    """A timing that failed, as a row; a CUDA error poisons the context, so it re-raises."""
    err = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(f"time  {layer.name:8s} {fmt:5s} M={m:<5d} {impl}: {err}", flush=True)
    if "CUDA error" in str(exc):
        raise exc
    return dict(kind="time", shape=layer.name, M=m, format=fmt, impl=impl, error=err)


def time_ours(ctx, layer, lim, fmt, ms, decode) -> list[dict]:
    torch = ctx.torch
    from sparkinfer.moe import allocate_scratch, bind, run
    from sparkinfer.moe.tuning import candidates

    p0, w, _, _ = layer.build(fmt, decode)
    rows = []  # --sweep: the plan, then the configs tuning.candidates proposes at each M
    jobs = [(m, n, p0 if n == "planned" else p0.forced(c)) for m in ms
            for n, c in (candidates(p0, m) if ctx.args.sweep else [("planned", None)])]
    for m, variant, p in jobs:
        if ctx.over_budget():
            print(f"budget: skipping {layer.name} {fmt} M={m} {variant}", flush=True)
            continue
        scratch = allocate_scratch(p, ctx.dev)
        g_calls = ctx.calls_per_graph(m)
        x = torch.randn(m, layer.h, device=ctx.dev).bfloat16()
        calls, active = [], 0
        for s in range(g_calls):
            ids, tw = layer.routing(m, 1000 * m + s)
            active += torch.unique(ids).numel() / g_calls
            out = torch.empty(m, layer.h, dtype=torch.bfloat16, device=ctx.dev)
            b = bind(p, scratch, w, x=x, out=out, topk_ids=ids, topk_weights=tw)
            calls.append(lambda b=b: run(b))
        impl = "sparkinfer" if variant == "planned" else f"sparkinfer:{variant}"
        try:
            sec, mode = ctx.time_calls(calls)
        except Exception as exc:  # noqa: BLE001 - e.g. a sweep variant out of resources
            rows.append(_error_row(layer, m, fmt, impl, exc))
            continue
        r = _row(ctx, layer, lim, m, fmt, impl, sec, mode, w.expert_bytes(), active)
        r.update(dataclasses.asdict(b.config), decode=b.config.decode if fmt == "nvfp4" else None)
        rows.append(r)
        del scratch, calls
        print(f"time  {layer.name:8s} {fmt:5s} M={m:<5d} {impl:24s} {r['family']:7s} "
              f"{r['us']:9.1f} us  floor {100 * r['frac_floor']:5.1f}%  tc "
              f"{100 * r['frac_tc']:5.1f}%", flush=True)
    return rows


def _grouped_mm_call(ctx, layer, x, ids, tw, out):
    torch = ctx.torch
    e_idx = torch.arange(layer.e, device=ctx.dev)
    w1t, w2t = layer.w1.transpose(1, 2), layer.w2.transpose(1, 2)

    def call():
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum((flat[:, None] == e_idx[None, :]).sum(0), 0).to(torch.int32)
        tok = order // layer.k
        h1 = torch._grouped_mm(x[tok], w1t, offs=offs)
        g, u = h1.chunk(2, dim=-1)
        h2 = torch._grouped_mm(torch.nn.functional.silu(g) * u, w2t, offs=offs)
        h2 = h2.float() * tw.flatten()[order][:, None]
        out.zero_()
        out.index_add_(0, tok, h2)

    return call


def _loop_call(ctx, layer, x, ids, tw, out):
    torch = ctx.torch
    work = []
    for e in torch.unique(ids).tolist():  # host-side routing, outside the timed region
        t_idx, k_idx = torch.nonzero(ids == e, as_tuple=True)
        work.append((e, t_idx, tw[t_idx, k_idx][:, None]))

    def call():
        out.zero_()
        for e, t_idx, wr in work:
            g, u = (x[t_idx] @ layer.w1[e].t()).chunk(2, dim=-1)
            h2 = (torch.nn.functional.silu(g) * u) @ layer.w2[e].t()
            out.index_add_(0, t_idx, h2.float() * wr)

    return call


def time_baselines(ctx, layer, lim, ms) -> list[dict]:
    torch = ctx.torch
    rows = []
    ebytes = 3 * layer.h * layer.i * 2
    for m in ms:
        for impl, make in (("torch_grouped_mm", _grouped_mm_call), ("torch_loop", _loop_call)):
            if ctx.over_budget():
                print(f"budget: skipping {layer.name} {impl} M={m}", flush=True)
                continue
            g_calls = ctx.calls_per_graph(m, baseline=True)
            x = torch.randn(m, layer.h, device=ctx.dev).bfloat16()
            calls, active = [], 0
            try:
                for s in range(g_calls):
                    ids, tw = layer.routing(m, 1000 * m + s)
                    active += torch.unique(ids).numel() / g_calls
                    out = torch.empty(m, layer.h, dtype=torch.float32, device=ctx.dev)
                    calls.append(make(ctx, layer, x, ids.long(), tw, out))
                sec, mode = ctx.time_calls(calls)
            except Exception as exc:  # noqa: BLE001 - a missing baseline is a row, not a crash
                rows.append(_error_row(layer, m, "bf16", impl, exc))
                continue
            rows.append(_row(ctx, layer, lim, m, "bf16", impl, sec, mode, ebytes, active))
            print(f"time  {layer.name:8s} bf16  M={m:<5d} {impl:18s} {sec * 1e6:9.1f} us",
                  flush=True)
    return rows


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return None
    trows = [r for r in rows if r.get("kind") == "time" and "us" in r and ":" not in r["impl"]]
    if not (shapes := sorted({r["shape"] for r in trows})):
        return None
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        sr = [r for r in trows if r["shape"] == shape]
        for key in sorted({(r["impl"], r["format"]) for r in sr}):
            pts = sorted((r["M"], r["us"]) for r in sr if (r["impl"], r["format"]) == key)
            ax.plot(*zip(*pts), marker="o", label=f"{key[0]} {key[1]}")
        for fmt, style in (("nvfp4", ":"), ("bf16", "--"), ("fp8_block", "-.")):
            pts = sorted((r["M"], r["floor_us"]) for r in sr
                         if r["impl"] == "sparkinfer" and r["format"] == fmt)
            if pts:
                ax.plot(*zip(*pts), linestyle=style, color="gray", label=f"HBM floor {fmt}")
        ax.set(xscale="log", yscale="log", title=shape, xlabel="M (tokens)", ylabel="us")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def table(rows):
    t = {(r["shape"], r["M"], r["format"], r["impl"]): r for r in rows
         if r.get("kind") == "time" and "us" in r}
    for (shape, m, fmt, impl), r in sorted(t.items()):
        if impl.startswith("sparkinfer:") and (shape, m, fmt, "sparkinfer") in t:
            base = t[(shape, m, fmt, "sparkinfer")]["us"]
            print(f"sweep {shape:9s} {m:5d} {fmt:5s} {impl[11:]:16s} {r['us']:9.1f} us  "
                  f"x{base / r['us']:.2f} vs planned  floor {100 * r['frac_floor']:5.1f}%  "
                  f"tc {100 * r['frac_tc']:5.1f}%")
    print(f"\n{'shape':9s} {'M':>5s} {'fmt':5s} {'family':7s} {'us':>9s} {'floor%':>6s} "
          f"{'tc%':>5s} {'gmm_us':>9s} {'x_gmm':>6s} {'loop_us':>9s}")
    for (shape, m, fmt, impl), r in sorted(t.items()):
        if impl != "sparkinfer":
            continue
        g = t.get((shape, m, "bf16", "torch_grouped_mm"), {}).get("us", float("nan"))
        lp = t.get((shape, m, "bf16", "torch_loop"), {}).get("us", float("nan"))
        print(f"{shape:9s} {m:5d} {fmt:5s} {r['family']:7s} {r['us']:9.1f} "
              f"{100 * r['frac_floor']:6.1f} {100 * r['frac_tc']:5.1f} {g:9.1f} "
              f"{g / r['us']:6.2f} {lp:9.1f}")


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    _common.ensure_repo_on_path()
    ctx = Ctx(args)
    faulthandler.dump_traceback_later(ctx.budget + 180, exit=True)  # never hang
    torch = ctx.torch
    if ctx.cuda and not torch.cuda.is_available():
        sys.exit("bench_moe: no CUDA device (use --dry-run on CPU)")
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    if args.shapes and not args.dry_run:
        shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    ms = DRY_M if args.dry_run else (SWEEP_M if args.sweep else QUICK_M if args.quick else
                                     FULL_M)
    if args.m:
        ms = tuple(int(v) for v in args.m.split(","))
    formats = args.formats.split(",")
    meta = _common.metadata(sys.argv if argv is None else ["benchmarks/bench_moe.py", *argv])
    lim = device_limits(ctx)
    print(f"device: {meta.get('gpu')}  copy {lim['copy_gbs']:.0f} GB/s  bf16 "
          f"{lim['bf16_tflops']:.0f} TFLOP/s", flush=True)
    all_rows = [dict(kind="device", **lim)]
    _common.append_rows(args.out, all_rows[:1], meta)
    for name, shape in shapes.items():
        rows = []
        layer = Layer(ctx, name, shape, max(ms))
        decode = {fmt: args.nvfp4_decode for fmt in formats}
        for fmt in formats if not args.sweep else ():
            rows += checks(ctx, layer, fmt, ms, decode)
        for fmt in formats:
            rows += time_ours(ctx, layer, lim, fmt, ms, decode[fmt])
        if not (args.no_baselines or args.sweep):
            rows += time_baselines(ctx, layer, lim, ms)
        _common.append_rows(args.out, rows, meta)
        all_rows += rows
        del layer
        if ctx.cuda:
            torch.cuda.empty_cache()
    png = plot(all_rows, str(Path(args.out).with_suffix(".png")))
    table(all_rows)
    bad = [r for r in all_rows if r.get("kind") == "check" and not r["ok"]]
    print(f"\nwrote {args.out}" + (f" and {png}" if png else "") +
          f"; checks failed: {len(bad)}; {time.time() - ctx.t0:.0f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
