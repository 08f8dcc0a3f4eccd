"""`sparkinfer.linear` on the decode projections of every preset (one H200): the
evidence behind `sparkinfer/linear/config.py`.

For each weight shape of Qwen3-30B-A3B, GLM-4.5-Air and Mixtral-8x7B (qkv, o,
routers, dense and shared MLPs, LM heads) at M = 1, 8, 64 (and 128 for two):
cuBLAS (`torch.mm` / `addmm`), the planned launch with programmatic dependent
launch (`planned`) and without (`planned_nopdl`), and the alternative tiles the
planner passed over (preload at another slice, or stream), each timed as one
CUDA graph of back-to-back calls over distinct weights (enough copies that the
graph reads at least 2x the H200's 50 MB L2, at most 64; `l2_resident` marks
shapes too small for that), median of 5 timings of 10 replays. Before timing,
every output is poisoned with NaN, the graph replayed, and each weight's output
compared with the fp64 reference (`ok`, `max_err` in units of the bound: one
rounding to the output dtype plus fp32 summation noise; fp32 weights: tf32x3).
The planned launch is also checked on the GPU for batch invariance (a row alone
and at positions 5 and 37 of a 64-row batch of other random rows, bitwise) and
for replay = eager, bitwise.

Then MEASURED.md's chain (2026-12-03): y_(i+1) = W_i y_i over 48 distinct 2048 x
2048 and 24 distinct 4096 x 4096 bf16 weights at M = 1 in one graph, planned
with PDL / without / cuBLAS: what the weight loads issued before `gdc_wait` buy
when the predecessor lets its dependents launch early; and the same chains with
an RMSNorm before each projection (`chain.norm.*`), the decoder's pattern, where
the norm lets the projection launch early. The PDL chain's graph is also dumped
(CUDA's debug DOT) and the lines naming programmatic edges counted
(`dot_programmatic_lines`; informational: whether the dump names them varies). Each row reports us,
GB/s, the fraction of the specified 4.8 TB/s (`frac_hbm`) and of the device copy
rate measured in the same run (`frac_copy`; a copy's rate counts its reads and
writes, a GEMV mostly reads, so it can pass 1).

    python3 benchmarks/sweeps/linear_decode_sweep.py [--out PATH] [--shapes qwen3.qkv,...] [--budget-s 180]
        [--dry-run]

About 2-3 minutes on an H200, most of it Triton compiles (~35 specializations);
no shape starts past --budget-s. `--dry-run` runs small shapes through the
interpreter on the CPU (logic only, no timing meaning).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# name -> (N, K, weight dtype, bias, gated): the decode projections at TP 1 as the decoder
# calls them (GLM-4.5's fp32 router takes the bf16 hidden state; the down projections
# of its dense MLP and shared experts take [gate | up] and apply silu(gate) * up, which
# cuBLAS's row does with torch's two kernels first)
SHAPES = {
    "qwen3.qkv": (5120, 2048, "bf16", False, False), "qwen3.o": (2048, 4096, "bf16", False, False),
    "qwen3.router": (128, 2048, "bf16", False, False), "qwen3.lm_head": (151936, 2048, "bf16", False, False),
    "glm.qkv": (14336, 4096, "bf16", True, False), "glm.o": (4096, 12288, "bf16", False, False),
    "glm.router": (128, 4096, "fp32", False, False), "glm.dense_gate_up": (21888, 4096, "bf16", False, False),
    "glm.dense_down": (4096, 10944, "bf16", False, True), "glm.shared_gate_up": (2816, 4096, "bf16", False, False),
    "glm.shared_down": (4096, 1408, "bf16", False, True), "glm.lm_head": (151552, 4096, "bf16", False, False),
    "mixtral.qkv": (6144, 4096, "bf16", False, False), "mixtral.o": (4096, 4096, "bf16", False, False),
    "mixtral.router": (8, 4096, "bf16", False, False), "mixtral.lm_head": (32000, 4096, "bf16", False, False),
}
MS = {"qwen3.qkv": (1, 8, 64, 128), "qwen3.lm_head": (1, 8, 64, 128)}  # others: 1, 8, 64
DRY = {"dry.preload": (130, 512, "bf16", True, False), "dry.groups": (256, 2048, "bf16", False, False),
       "dry.stream": (150, 128, "bf16", False, True),
       "dry.router": (72, 256, "fp32", False, False)}
CHAINS = ((2048, 48), (4096, 24))
L2_BYTES, SMS = 50 << 20, 132


def _dtype(name):
    import torch

    return dict(bf16=torch.bfloat16, fp32=torch.float32)[name]


def _time_us(fn, cuda: bool, calls: int) -> tuple[float, object]:
    """(us per call of a graph of fn's `calls` calls, the graph) on CUDA (median of 5 x 10
    replays); on CPU one eager run's wall clock."""
    from sparkinfer.bench.timing import Graph, median, time_calls

    if not cuda:
        return median(time_calls(fn, 1, cuda=False)) * 1e6 / calls, None
    import torch

    g = Graph(fn, torch.cuda.Stream())
    g.replay()
    torch.cuda.synchronize()
    ts = [sum(time_calls(g.replay, 10, cuda=True)) / 10 for _ in range(5)]
    return median(ts) * 1e6 / calls, g


def _bound(x, w, b, ref, gated=False):
    """|out - ref| bound: one rounding to bf16 (half a spacing, 2^-8 of the value; the
    interpreter truncates: 2^-7) plus fp32 summation noise; fp32 weights: tf32x3's
    products (2^-20 of |x| @ |w|); gated: one bf16 spacing of each activation
    (2^-8 of |x| @ |w|: the kernel's exp is not torch's to the last fp32 bit)."""
    import torch

    if w.dtype == torch.float32:
        return 2 ** -20 * (x.double().abs() @ w.double().abs().t()).float() + 1e-6 * ref.abs().max()
    ulp = 2 ** -7 if os.environ.get("TRITON_INTERPRET") == "1" else 2 ** -8
    bound = ref.abs() * ulp + 1e-5 * ref.abs().max()
    return bound + 2 ** -8 * (x.double().abs() @ w.double().abs().t()).float() if gated else bound


class Case:
    """One shape at one M: weights (distinct copies), x, outputs, semaphores, references."""

    def __init__(self, n, k, dtype, bias, gated, m, dev, copies):
        import torch

        from sparkinfer.linear import linear_sync
        from sparkinfer.linear.reference import linear_reference

        dt = _dtype(dtype)
        self.n, self.k, self.m, self.dt, self.gated = n, k, m, dt, gated
        self.ws = [(torch.randn(n, k, device=dev) * k ** -0.5).to(dt) for _ in range(copies)]
        self.bs = [torch.randn(n, device=dev).to(dt) if bias else None for _ in range(copies)]
        self.x = torch.randn(m, 2 * k if gated else k, device=dev).bfloat16()  # the hidden state is bf16
        self.act = self.activation(self.x)
        self.outs = [torch.empty(m, n, device=dev, dtype=dt) for _ in range(copies)]
        self.syncs = [linear_sync(w) for w in self.ws]
        self.refs = [linear_reference(self.act, w, b) for w, b in zip(self.ws, self.bs)]

    def activation(self, x):
        """What the product multiplies: silu(gate) * up as torch computes it (gated), else x."""
        import torch.nn.functional as F

        if not self.gated:
            return x
        g, u = x.chunk(2, dim=-1)
        return F.silu(g) * u

    def check(self, run) -> dict:
        """Poison every output, run (a replay), compare each with its reference."""
        for o in self.outs:
            o.fill_(float("nan"))
        run()
        worst = 0.0
        for o, w, b, ref in zip(self.outs, self.ws, self.bs, self.refs):
            err = (o.float() - ref).abs() / _bound(self.act, w, b, ref, self.gated)
            worst = max(worst, float(err.max()) if bool(err.isfinite().all()) else math.inf)
        return dict(ok=worst <= 1.0, max_err=worst)


def _variants(n, k, elem, m, cuda, gated=False):
    """(impl, tile or None for cuBLAS, pdl, config overrides) of one shape at one M: the
    planned tile, and for a split preload tile the same sums one program per slice
    ("fine") and one per group ("coarse", at K steps of 128 and 64, 128 features a program; gated calls coarse too;
    other group sizes, whose sums differ) whichever M the planner switches at."""
    from sparkinfer.linear import LinearTile, linear_tile
    from sparkinfer.linear.config import BLOCK_N, MAX_ROWS, MAX_SPLIT, PRELOAD_BYTES, PRELOAD_BYTES_FP32

    planned = linear_tile(n, k, elem, SMS)
    out = [("cublas", None, False, {}), ("planned", planned, True, {})]
    if m <= 8 and cuda:
        out.append(("planned_nopdl", planned, False, {}))
    if not planned.stream and planned.split > 1:
        out += [("fine", dataclasses.replace(planned, coarse_always=False), True, dict(COARSE_MIN_ROWS=MAX_ROWS)),
                ("coarse", planned, True, dict(COARSE_MIN_ROWS=0)),
                ("coarse_bk64", planned, True, dict(COARSE_MIN_ROWS=0, COARSE_BLOCK_K=64)),
                ("coarse_bn128", planned, True, dict(COARSE_MIN_ROWS=0, COARSE_BLOCK_N=128))]
        if gated:
            out += [("coarse_gated", planned, True, dict(COARSE_MIN_ROWS=0, COARSE_GATED=True))]
        out += [(f"coarse_g{g}", dataclasses.replace(planned, group=g), True, dict(COARSE_MIN_ROWS=0))
                for g in (1, 2, 4) if g != planned.group and g < planned.split]
    cap = PRELOAD_BYTES if elem <= 2 else PRELOAD_BYTES_FP32
    for ks in (256, 512):
        t = LinearTile(stream=False, block_n=BLOCK_N, block_k=64, k_slice=ks, split=-(-k // ks))
        if (t.stream, t.k_slice) != (planned.stream, planned.k_slice) and min(n, BLOCK_N) * ks * elem <= cap \
                and t.split <= MAX_SPLIT and ks <= k and m <= 8:
            out.append((f"preload_ks{ks}", t, True, {}))
    if not planned.stream:
        out.append(("stream", linear_tile(n, k, elem, 1), True, {}))
    else:  # f64ac5d's stream tile: BK 128, 6 steps in flight
        out.append(("stream_bk128_s6", dataclasses.replace(planned, block_k=128, k_slice=-(-k // 128) * 128,
                                                           stages=6), True, {}))
    return out


def _settings(overrides):
    """`sparkinfer.linear.config` attributes set inside the `with` (a graph captures the
    launches the settings pick)."""
    from unittest import mock

    from sparkinfer.linear import config

    return mock.patch.dict(vars(config), overrides)


def _with(overrides, fn):
    """fn, called under `_settings(overrides)`."""
    def call():
        with _settings(overrides):
            fn()
    return call


def shape_rows(name, spec, args, dev, cuda, bw, peak) -> list[dict]:
    import torch

    from sparkinfer.linear import linear

    n, k, dtype, bias, gated = spec
    elem = 4 if dtype == "fp32" else 2
    wbytes = n * k * elem
    copies = 2 if not cuda else max(2, min(64, -(-2 * L2_BYTES // wbytes)))
    rows = []
    for m in (1, 8, 33) if not cuda else (args.ms or MS.get(name, (1, 8, 64))):
        c = Case(n, k, dtype, bias, gated, m, dev, copies)
        base = dict(shape=name, N=n, K=k, M=m, dtype=dtype, bias=bias, gated=gated, weights_in_graph=copies,
                    l2_resident=copies * wbytes < 2 * L2_BYTES)
        for impl, tile, pdl, overrides in _variants(n, k, elem, m, cuda, gated):
            if tile is None:
                def call(c=c):
                    for w, b, o in zip(c.ws, c.bs, c.outs):
                        a = c.activation(c.x).to(w.dtype)
                        torch.addmm(b, a, w.t(), out=o) if b is not None else torch.mm(a, w.t(), out=o)
            else:
                def run(c=c, tile=tile, pdl=pdl):
                    for w, b, o, s in zip(c.ws, c.bs, c.outs, c.syncs):
                        linear(c.x, w, b, out=o, sync=s, tile=tile, pdl=pdl, gated=c.gated)
                call = _with(overrides, run)
            us, g = _time_us(call, cuda, copies)
            row = dict(base, impl=impl, us=us, **c.check(g.replay if g is not None else call))
            if tile is not None:
                row.update(stream=tile.stream, k_slice=tile.k_slice, split=tile.split, group=tile.group, pdl=pdl,
                           **{k.lower(): v for k, v in overrides.items()})
            moved = wbytes + c.x.numel() * 2 + m * n * elem
            row.update(gbs=moved / us / 1e3, frac_hbm=moved / us / 1e3 / peak if peak else None,
                       frac_copy=moved / us * 1e6 / bw if bw else None)
            if impl in ("planned", "coarse"):
                row.update(_invariance(c, tile, dev, overrides))
                if g is not None:  # replay = eager, bitwise
                    call()
                    eager = [o.clone() for o in c.outs]
                    g.replay()
                    row["replay_equals_eager"] = all(torch.equal(a, b) for a, b in zip(eager, c.outs))
            rows.append(row)
            args.say(row)
            del g
        del c
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _invariance(c, tile, dev, overrides) -> dict:
    """A row alone, at position 5 and 37 of 64 random rows, and (overrides: a coarse call)
    every row of the 64 against one program per slice: the same bits."""
    import torch

    from sparkinfer.linear import linear

    w, b, s, kw = c.ws[0], c.bs[0], c.syncs[0], dict(tile=tile, gated=c.gated)
    x = torch.randn(64, c.x.shape[1], device=dev).bfloat16()
    alone = linear(x[37:38], w, b, sync=s, **kw)
    with _settings(overrides):
        full = linear(x, w, b, sync=s, **kw)
    x2 = torch.randn(64, c.x.shape[1], device=dev).bfloat16()
    x2[5] = x[37]
    moved = linear(x2, w, b, sync=s, **kw)
    ok = torch.equal(full[37:38], alone) and torch.equal(moved[5:6], alone)
    if overrides:
        from sparkinfer.linear.config import MAX_ROWS

        kw["tile"] = dataclasses.replace(tile, coarse_always=False)
        with _settings(dict(COARSE_MIN_ROWS=MAX_ROWS)):
            fine = linear(x, w, b, sync=s, **kw)
        ok = ok and torch.equal(full.view(torch.int16), fine.view(torch.int16))
    return dict(batch_invariant=bool(ok), sync_rearmed=not bool(s.any()))


def _dot_programmatic(call) -> int | None:
    """Lines of the captured graph's debug DOT dump that name a programmatic edge or
    launch attribute (CUDA's cudaGraphDebugDotPrint); None where the dump failed."""
    import tempfile

    import torch

    try:
        g = torch.cuda.CUDAGraph()
        g.enable_debug_mode()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=s):
            call()
        with tempfile.TemporaryDirectory() as d:
            g.debug_dump(os.path.join(d, "g.dot"))
            text = open(os.path.join(d, "g.dot")).read().lower()
        return sum("programmatic" in line for line in text.splitlines())
    except Exception:  # noqa: BLE001 - informational only
        return None


def chain_rows(args, dev, cuda, bw, peak) -> list[dict]:
    """MEASURED.md's chain of dependent GEMVs (y_(i+1) = W_i y_i), and the decoder's
    pattern (y_(i+1) = W_i rmsnorm(y_i): the norm lets the projection launch early),
    planned with and without PDL, and cuBLAS."""
    import torch

    from sparkinfer.linear import linear, linear_sync, linear_tile
    from sparkinfer.norm import rms_norm

    rows = []
    for n, steps in CHAINS if cuda else ((256, 3),):
        ws = [(torch.randn(n, n, device=dev) * n ** -0.5).bfloat16() for _ in range(steps)]
        syncs = [linear_sync(w) for w in ws]
        gamma = torch.ones(n, device=dev, dtype=torch.bfloat16)
        ys = [torch.randn(1, n, device=dev).bfloat16()] + [torch.empty(1, n, device=dev, dtype=torch.bfloat16)
                                                            for _ in ws]
        hs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in ws]
        tile = linear_tile(n, n, 2, SMS)
        impls = (("planned", True), ("planned_nopdl", False), ("cublas", False))
        for norm in (False, True):
            for impl, pdl in impls[::1 if cuda else 2]:
                def call(impl=impl, pdl=pdl, ws=ws, syncs=syncs, ys=ys, hs=hs, tile=tile, norm=norm, gamma=gamma):
                    for i, (w, s) in enumerate(zip(ws, syncs)):
                        h = rms_norm(ys[i], gamma, 1e-6, out=hs[i]) if norm else ys[i]
                        if impl == "cublas":
                            torch.mm(h, w.t(), out=ys[i + 1])
                        else:
                            linear(h, w, out=ys[i + 1], sync=s, tile=tile, pdl=pdl)
                us, g = _time_us(call, cuda, steps)
                for y in ys[1:]:
                    y.fill_(float("nan"))
                (g.replay if g is not None else call)()
                worst = 0.0
                for i, w in enumerate(ws):  # each step against the fp64 product of its own input
                    h = hs[i] if norm else ys[i]
                    ref = (h.double() @ w.double().t()).float()
                    err = (ys[i + 1].float() - ref).abs() / _bound(h, w, None, ref)
                    worst = max(worst, float(err.max()) if bool(err.isfinite().all()) else math.inf)
                moved = n * n * 2 + 4 * n
                row = dict(shape=f"chain{'.norm' if norm else ''}.{n}", N=n, K=n, M=1, dtype="bf16", impl=impl,
                           steps=steps, us=us, pdl=pdl, ok=worst <= 1.0, max_err=worst, gbs=moved / us / 1e3,
                           frac_hbm=moved / us / 1e3 / peak if peak else None,
                           frac_copy=moved / us * 1e6 / bw if bw else None,
                           stream=tile.stream, k_slice=tile.k_slice, split=tile.split)
                if cuda and impl == "planned" and not norm:
                    row["dot_programmatic_lines"] = _dot_programmatic(call)
                rows.append(row)
                args.say(row)
                del g
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="default benchmarks/results/sweeps/linear_decode_sweep_<machine>.json")
    p.add_argument("--shapes", default=None, help="comma-separated names of SHAPES (default all)")
    p.add_argument("--no-chain", action="store_true")
    p.add_argument("--ms", default=None, help="comma-separated row counts (default 1, 8, 64; 128 for two shapes)")
    p.add_argument("--budget-s", type=float, default=180.0,
                   help="start no new shape past this many seconds (the lead's device call allows 4 minutes)")
    p.add_argument("--dry-run", action="store_true", help="small shapes, interpreter on the CPU")
    args = p.parse_args()
    args.ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else None
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from sparkinfer.bench.common import append_rows, default_out, metadata, spec_peaks
    from sparkinfer.bench.decode_model import copy_bandwidth

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("the sweep needs a GPU; --dry-run checks its logic on the CPU")
        return 2
    t0 = time.time()
    dev = torch.device("cuda" if cuda else "cpu")
    meta = metadata(None)
    peak = spec_peaks(meta.get("gpu")).get("spec_hbm_gbs")
    bw = copy_bandwidth() if cuda else None
    print(f"copy rate {bw / 1e12:.2f} TB/s (read + write)" if bw else "dry run: no rates")

    def say(r):
        fr = f" {100 * r['frac_hbm']:5.1f}% of 4.8 TB/s" if r.get("frac_hbm") else ""
        print(f"{r['shape']:20s} M={r['M']:<4d} {r['impl']:14s} {r['us']:9.2f} us{fr} ok={r['ok']}"
              f"{' inv=' + str(r['batch_invariant']) if 'batch_invariant' in r else ''}"
              f"  [{time.time() - t0:5.0f} s]", flush=True)
    args.say = say
    shapes = DRY if args.dry_run else SHAPES
    names = args.shapes.split(",") if args.shapes else list(shapes)
    rows = [] if args.no_chain else chain_rows(args, dev, cuda, bw, peak)
    skipped = []
    for name in names:
        if time.time() - t0 > args.budget_s:
            skipped.append(name)
            continue
        torch.manual_seed(len(rows))
        rows += shape_rows(name, shapes[name], args, dev, cuda, bw, peak)
    if skipped:
        print(f"past --budget-s {args.budget_s:.0f}: skipped {','.join(skipped)} (rerun with --shapes)")
    note = "linear decode sweep: graphs over distinct weights, median of 5 x 10 replays; see the script's docstring"
    out = args.out or default_out("linear_decode", meta, 1, dry_run=args.dry_run, sweep=False)
    if not args.out and not args.dry_run:
        out = out.parent / "sweeps" / out.name.replace("linear_decode_", "linear_decode_sweep_")
    path = append_rows(out, [dict(r, note=note, copy_bandwidth_Bps=bw, spec_hbm_gbs=peak) for r in rows], meta)
    bad = [r for r in rows if not r["ok"] or r.get("batch_invariant") is False or r.get("replay_equals_eager") is False]
    print(f"{len(rows)} rows -> {path} in {time.time() - t0:.0f} s; {len(bad)} failed checks")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
