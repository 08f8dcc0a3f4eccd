"""Per-kernel GPU time of one MoE call (eager, torch.profiler), planned and forced configs.
usage: moe_prof.py OUT shapes ms cfgs"""
import dataclasses, json, sys, collections
sys.path.insert(0, 'benchmarks')
import bench_moe as B, _common
out, shapes, ms = sys.argv[1], sys.argv[2].split(","), [int(m) for m in sys.argv[3].split(",")]
cfgs = [("planned", {})]
if len(sys.argv) > 4 and sys.argv[4]:
    for item in sys.argv[4].split(";"):
        name, kvs = item.split(":")
        cfgs.append((name, {k: int(v) for k, v in (a.split("=") for a in kvs.split(","))}))
import os
FMT = os.environ.get("FMT", "nvfp4")
args = B.parse_args(["--formats", FMT, "--no-baselines", "--out", out])
_common.ensure_repo_on_path()
ctx = B.Ctx(args)
torch = ctx.torch
from torch.profiler import profile, ProfilerActivity
from sparkinfer.moe import allocate_scratch, bind, run
rows = []
for name in shapes:
    layer = B.Layer(ctx, name, B.SHAPES[name], max(ms))
    p0, w, _, _ = layer.build(FMT)
    for m in ms:
        for cname, kw in cfgs:
            p = p0.forced(dataclasses.replace(p0.config_for(m), **kw))
            scratch = allocate_scratch(p, "cuda")
            x = torch.randn(m, layer.h, device="cuda").bfloat16()
            binds = []
            for s in range(8):
                ids, tw = layer.routing(m, 1000 * m + s)
                o = torch.empty(m, layer.h, dtype=torch.bfloat16, device="cuda")
                binds.append(bind(p, scratch, w, x=x, out=o, topk_ids=ids, topk_weights=tw))
            for b in binds:
                run(b)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    for b in binds:
                        run(b)
                torch.cuda.synchronize()
            agg = collections.defaultdict(list)
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    agg[ev.name].append(ev.time_range.elapsed_us())
            ker = {k.split("_kernel")[0][:14]: round(sum(v) / 40, 2) for k, v in agg.items()}
            r = dict(shape=name, M=m, cfg=cname, kernels=ker, total=round(sum(ker.values()), 2))
            rows.append(r)
            print("prof", name, m, cname, r["total"], ker, flush=True)
    del layer, w
    torch.cuda.empty_cache()
json.dump(rows, open(out, "w"))
