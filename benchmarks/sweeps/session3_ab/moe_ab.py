"""A/B of MoE launch configs (forced around the plan) at NVFP4 M 1, 8: timing only.
usage: moe_ab.py VARIANT OUT [shapes] [ms] [fmt] [cfgs: 'name:k=v,k=v;name2:...']"""
import dataclasses, json, sys, time
sys.path.insert(0, 'benchmarks')
import bench_moe as B, _common
variant, out = sys.argv[1], sys.argv[2]
shapes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["dsv3", "qwen3", "mixtral", "dsv3_tp8"]
ms = tuple(int(m) for m in (sys.argv[4].split(",") if len(sys.argv) > 4 else ["1", "8"]))
fmt = sys.argv[5] if len(sys.argv) > 5 else "nvfp4"
cfgs = [("planned", {})]
if len(sys.argv) > 6 and sys.argv[6]:
    for item in sys.argv[6].split(";"):
        name, kvs = item.split(":")
        cfgs.append((name, {k: int(v) for k, v in (a.split("=") for a in kvs.split(","))}))
import os
DRY = os.environ.get("DRY")
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
args = B.parse_args(["--formats", fmt, "--no-baselines", "--out", out, "--sweep"] + (["--dry-run"] if DRY else []))
_common.ensure_repo_on_path()
ctx = B.Ctx(args); ctx.budget = 1e9
torch = ctx.torch
lim = B.device_limits(ctx)
import sparkinfer.moe.tuning as tuning
rows = []
t0 = time.time()
for name in shapes:
    layer = B.Layer(ctx, name, (B.DRY_SHAPES if DRY else B.SHAPES)[name], max(ms))
    def cands(p, m):
        c = p.config_for(m)
        return tuple((n, dataclasses.replace(c, **kw)) for n, kw in cfgs)
    B.candidates = cands  # time_ours imported it inside; patch the module attr too
    tuning.candidates = cands
    rs = B.time_ours(ctx, layer, lim, fmt, ms, None)
    for r in rs:
        r["variant"] = variant
    rows += rs
    del layer
    DRY or torch.cuda.empty_cache()
print(f"{variant} done in {time.time()-t0:.0f}s", flush=True)
json.dump(rows, open(out, "w"))
