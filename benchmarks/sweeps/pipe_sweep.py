"""Exploratory 2-GPU all-reduce sweep kept for reproducibility of benchmarks/results/sweep_2xh200_*.json.

    python3 benchmarks/sweeps/pipe_sweep.py
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
from sparkinfer.runtime import launch  # noqa: E402

def body(world):
    import torch, torch.distributed as dist
    from sparkinfer.comm import Communicator, GridConfig
    from sparkinfer.comm.all_reduce.launch import all_reduce
    dev = world.device
    torch.cuda.set_device(dev)
    comm = Communicator(capacity_bytes=64 << 20, timeout_s=10, channel_ids=("bench",))
    W, r = world.world_size, world.rank
    def pay(rank, n, dt, salt=0): return ((torch.arange(n, device=dev) * 5 + rank * 3 + salt) % 11).to(dt)
    s = torch.cuda.Stream(dev)
    res = {}
    NOPS = 20
    for nbytes in [512 << 10, 2 << 20, 8 << 20, 32 << 20]:
        n = nbytes // 2
        x = pay(r, n, torch.bfloat16); o = torch.empty_like(x)
        ref = sum(pay(q, n, torch.float32) for q in range(W)).to(torch.bfloat16)
        variants = [("auto", None)]
        for algo in ["oneshot", "twoshot"]:
            for pipe in (1, 2):
                for blk, nw in [(4096, 8), (8192, 16), (2048, 8)]:
                    for grid in (66, 132, 256):
                        if grid > comm.caps.num_sms: continue  # GridConfig: co-resident blocks only
                        variants.append((algo, GridConfig(grid, blk, nw, pipe)))
        for algo, cfg in variants:
            if algo == "oneshot" and nbytes > (8 << 20): continue
            g = torch.cuda.CUDAGraph()
            o.fill_(float("nan"))
            with torch.cuda.stream(s), comm.pool.capture(s, "bench", reuse=True):
                all_reduce(comm.context, x, o, algorithm=algo, config=cfg)
                torch.cuda.synchronize()
                ok0 = torch.equal(o, ref)
                with torch.cuda.graph(g, stream=s):
                    for _ in range(NOPS):
                        all_reduce(comm.context, x, o, algorithm=algo, config=cfg)
            for _ in range(3): g.replay()
            torch.cuda.synchronize(); dist.barrier()
            ts = []
            for _ in range(10):
                e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
                e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1000 / NOPS)
            ts.sort()
            ok = ok0 and torch.equal(o, ref)
            key = f"{nbytes>>10}KiB {algo} " + (f"g{cfg.grid} b{cfg.block} w{cfg.num_warps} p{cfg.pipe}" if cfg else "default")
            res[key] = (round(ts[len(ts)//2], 2), ok)
            del g
            comm.synchronize()
    comm.close()
    return res

if __name__ == "__main__":
    r = launch(body, 2, backend="cuda", timeout_s=300)
    out = os.environ.get("OUT", ".")
    json.dump(r, open(f"{out}/pipe_sweep.json", "w"), indent=1)
    worst = {k: max(r[0][k][0], r[1][k][0]) for k in r[0]}
    bad = [k for k in r[0] if not (r[0][k][1] and r[1][k][1])]
    print("WRONG:", bad)
    best = {}
    for k, us in worst.items():
        size, algo = k.split()[:2]
        if algo == "auto": print(k, us)
        for p in ("p1", "p2"):
            if k.endswith(p):
                b = best.get((size, algo, p))
                if b is None or us < b[1]: best[(size, algo, p)] = (k, us)
    for v in sorted(best.values()): print("best", v)
