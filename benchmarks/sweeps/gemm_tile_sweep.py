#!/usr/bin/env python3
"""`gemm` tiles at prefill and mixed-step sizes: time candidate tiles against the planned one.

Legend: M rows (prompt tokens of a forward's chunks), N output features, K reduction;
a tile is (BM, BN, BK, stages, warps, G), BK fixed at 64 (`sparkinfer.linear.gemm`).

For each preset's projection shapes (qkv, o, router; `--presets`) and M in `--m`,
times `gemm` with the tile `gemm_tile(M, N)` plans and with each of `GEMM_CANDIDATES` (a CUDA
graph of `--reps` calls, `timing.graph_op_us`), each by per-thread loads and by TMA
descriptors (and with TMA in the --schedules beyond "tiles": persistent, warp-specialized),
and cuBLAS (torch.mm) beside them, on random inputs, and checks every
candidate's output against the planned tile's bitwise (a row's bits must not follow
the tile, or M would change them) and the planned output against an fp32 reference
(bf16 rounding). Prints a table per shape and M, writes JSON rows with
`sparkinfer.bench.common.metadata` to --out; exit status 1 when any bitwise check
or reference check failed. --dry-run: tiny shapes through the Triton interpreter.

    python3 benchmarks/sweeps/gemm_tile_sweep.py --presets qwen3-30b-a3b --m 256,512,1024,2048
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # sparkinfer without an install


def _shapes(preset: str) -> list[tuple[str, int, int]]:
    from sparkinfer.models.presets import preset_config

    c = preset_config(preset)
    h = c["hidden_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    e = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
    return [("qkv", (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d, h),
            ("o", h, c["num_attention_heads"] * d), ("router", e, h)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen3-30b-a3b,mixtral-8x7b,glm-4.5-air")
    ap.add_argument("--m", default="256,512,1024,2048")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--schedules", default="tiles",
                    help="comma list of gemm schedules (tiles, persistent, ws); beyond tiles, each is timed "
                         "with TMA loads on the --schedule-tiles candidates")
    # warp specialization partitions 4-warp tiles only (sparkinfer/linear/gemm.py)
    ap.add_argument("--schedule-tiles", default="64x64,64x128,128x128-w4,128x128")
    ap.add_argument("--out", default=None, help="default benchmarks/results/sweeps/gemm_tile_sweep_<machine>.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from sparkinfer.bench.common import append_rows, default_out, metadata
    from sparkinfer.bench.timing import sweep_op_us
    from sparkinfer.linear.gemm import GEMM_CANDIDATES, GEMM_SCHEDULE, gemm, gemm_tile

    schedules = set(args.schedules.split(","))
    sched_tiles = args.schedule_tiles.split(",")
    unknown = sorted(set(sched_tiles) - set(GEMM_CANDIDATES))
    if unknown:
        ap.error(f"--schedule-tiles: unknown {unknown}; choose from {sorted(GEMM_CANDIDATES)}")

    cuda = torch.cuda.is_available() and not args.dry_run
    dev = torch.device("cuda" if cuda else "cpu")
    if args.dry_run:
        shapes = [("tiny", "qkv", 96, 64), ("tiny", "router", 8, 64)]
        ms, reps = [40, 130], 1
    else:
        shapes = [(p, *s) for p in args.presets.split(",") for s in _shapes(p)]
        ms, reps = [int(m) for m in args.m.split(",")], args.reps
    rows, bad = [], 0
    g = torch.Generator().manual_seed(0)
    for preset, name, n, k in shapes:
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(dev)
        for m in ms:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
            planned = gemm_tile(m, n)
            ref = gemm(x, w)
            exact = x.float() @ w.float().T
            ref_ok = torch.allclose(ref.float(), exact, rtol=2 ** -7, atol=1e-5 * k)
            bad += not ref_ok
            print(f"\n{preset} {name} N={n} K={k} M={m} (planned {planned})")
            cands = {"planned": (planned, None, None)}
            if "tiles" in schedules:
                cands.update({c: (t, False, "tiles") for c, t in GEMM_CANDIDATES.items()})
                cands.update({c + "+tma": (t, True, "tiles") for c, t in GEMM_CANDIDATES.items()})
            for sch in schedules - {"tiles"}:
                cands.update({f"{c}+tma+{sch}": (GEMM_CANDIDATES[c], True, sch) for c in sched_tiles})
            for cname, (tile, tma, sch) in cands.items():
                out = torch.full_like(ref, float("nan"))
                try:
                    same = torch.equal(gemm(x, w, out=out, tile=tile, tma=tma, schedule=sch), ref)
                except Exception as e:  # a schedule the compiler refuses for this tile: a row, not a stop
                    print(f"  {cname:14s} {str(tile):28s} failed: {type(e).__name__}: {str(e)[:200]}")
                    rows.append(dict(bench="gemm_tile_sweep", preset=preset, name=name, n=n, k=k, m=m, config=cname,
                                     tile=list(tile), tma=tma, schedule=sch, planned=False,
                                     error=f"{type(e).__name__}: {str(e)[:500]}", ok=False))
                    bad += 1
                    continue
                bad += not same
                us = sweep_op_us(lambda x=x, w=w, tile=tile, out=out, tma=tma, sch=sch:
                                 gemm(x, w, out=out, tile=tile, tma=tma, schedule=sch), cuda, reps)
                tflops = 2 * m * n * k / us / 1e6
                rows.append(dict(bench="gemm_tile_sweep", preset=preset, name=name, n=n, k=k, m=m, config=cname,
                                 tile=list(tile), tma=tma, schedule=sch or GEMM_SCHEDULE, planned=cname == "planned",
                                 us=us, tflops=tflops, bitwise_equal_planned=same, planned_matches_fp32=ref_ok,
                                 ok=same and ref_ok))
                print(f"  {cname:24s} {str(tile):28s} {us:9.1f} us {tflops:7.1f} TFLOP/s  same bits {same}")
            # cuBLAS beside them: the rate a kernel free to pick its sum order by M reaches
            out = torch.empty_like(ref)
            us = sweep_op_us(lambda x=x, w=w, out=out: torch.mm(x, w.T, out=out), cuda, reps)
            err = ((out.float() - exact).abs().max() / exact.abs().max()).item()
            rows.append(dict(bench="gemm_tile_sweep", preset=preset, name=name, n=n, k=k, m=m, config="cublas",
                             planned=False, us=us, tflops=2 * m * n * k / us / 1e6, rel_err_vs_fp32=err,
                             ok=err < 2 ** -7))
            print(f"  {'cublas':14s} {'':28s} {us:9.1f} us {2 * m * n * k / us / 1e6:7.1f} TFLOP/s")
    meta = metadata(types.SimpleNamespace(argv=["python3", "benchmarks/sweeps/gemm_tile_sweep.py", *sys.argv[1:]]))
    out = args.out or default_out("gemm_tile", meta, 1, dry_run=args.dry_run, sweep=True)
    print(f"rows -> {append_rows(out, rows, meta)}; {bad} checks failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
