#!/usr/bin/env python3
"""MoE at decode sizes: the plan's launch config against forced variants, and
the GPU time of every kernel of one call.

Legend: M (= T) tokens, BN1 / BN2 weight rows per FC1 / FC2 program, S1 / S2
reduction splits, stages1 / stages2 pipeline depths (`TileConfig` fields).

For each shape of bench_moe (--shapes) and M (--m), times (CUDA graph, 8
routings per graph, median; `bench_moe.time_ours`) the planned config and each
--cfg variant, a `TileConfig` with the given fields replaced; with
--profile, also records each kernel's GPU time in one call (torch.profiler,
eager, 5 x 8 calls averaged). Rows (with GPU, driver, versions, commit, date,
command) go to --out. Timing only: bench_moe.py checks the plan's configs.

    python3 benchmarks/sweeps/moe_micro_ab.py --m 1,8 \
        --cfg "bn2:block_n2=128;s2_6:stages2=6" --profile
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
import bench_moe as B  # noqa: E402


def parse_cfgs(text: str) -> list[tuple[str, dict]]:
    out = [("planned", {})]
    for item in filter(None, (text or "").split(";")):
        name, kvs = item.split(":")
        out.append((name, {k: int(v) if v.lstrip("-").isdigit() else v
                           for k, v in (a.split("=") for a in kvs.split(","))}))
    return out


def profile_call(ctx, layer, p, w, m) -> dict:
    """{kernel: us} of one call of plan p at M = m (eager, averaged)."""
    torch = ctx.torch
    from torch.profiler import ProfilerActivity, profile

    from sparkinfer.moe import allocate_scratch, bind, run

    scratch = allocate_scratch(p, "cuda")
    x = torch.randn(m, layer.h, device="cuda").bfloat16()
    binds = []
    for s in range(8):
        ids, tw = layer.routing(m, 1000 * m + s)
        out = torch.empty(m, layer.h, dtype=torch.bfloat16, device="cuda")
        binds.append(bind(p, scratch, w, x=x, out=out, topk_ids=ids, topk_weights=tw))
    [run(b) for b in binds]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            [run(b) for b in binds]
        torch.cuda.synchronize()
    agg = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            agg[ev.name.split("_kernel")[0]] += ev.time_range.elapsed_us() / 40
    return {k: round(v, 2) for k, v in agg.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="dsv3,qwen3,mixtral,dsv3_tp8")
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--format", default="nvfp4", choices=("nvfp4", "bf16"))
    ap.add_argument("--cfg", default="", help="'name:field=v,field=v;name2:...'")
    ap.add_argument("--profile", action="store_true", help="also per-kernel GPU time")
    ap.add_argument("--out", default="benchmarks/results/moe_micro_ab_h200.json")
    a = ap.parse_args(argv)
    _common.ensure_repo_on_path()
    args = B.parse_args(["--formats", a.format, "--no-baselines", "--sweep", "--out", a.out])
    ctx = B.Ctx(args)
    ctx.budget = float("inf")
    if not ctx.torch.cuda.is_available():
        sys.exit("moe_micro_ab: no CUDA device")
    import sparkinfer.moe.tuning as tuning

    meta = _common.metadata(sys.argv if argv is None else [__file__, *argv])
    lim = B.device_limits(ctx)
    cfgs = parse_cfgs(a.cfg)
    ms = tuple(int(v) for v in a.m.split(","))
    rows = [dict(kind="device", **lim)]
    for name in a.shapes.split(","):
        layer = B.Layer(ctx, name, B.SHAPES[name], max(ms))
        tuning.candidates = lambda p, m: tuple(  # what time_ours times at each M
            (n, dataclasses.replace(p.config_for(m), **kw)) for n, kw in cfgs)
        rows += B.time_ours(ctx, layer, lim, a.format, ms, None)
        if a.profile:
            p0, w, _, _ = layer.build(a.format)
            for m in ms:
                for n, kw in cfgs:
                    p = p0.forced(dataclasses.replace(p0.config_for(m), **kw))
                    ker = profile_call(ctx, layer, p, w, m)
                    rows.append(dict(kind="profile", shape=name, M=m, format=a.format,
                                     variant=n, kernels_us=ker))
                    print(f"prof  {name:8s} M={m:<5d} {n:10s} {sum(ker.values()):8.1f} us  {ker}",
                          flush=True)
            del p0, w
        del layer
        ctx.torch.cuda.empty_cache()
    _common.append_rows(a.out, rows, meta)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
