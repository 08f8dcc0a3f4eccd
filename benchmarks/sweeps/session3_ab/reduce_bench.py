"""Reduce kernel alone: old (per-k branch) vs new ([KP, BH] tile) at several T, BH."""
import sys, json, torch, triton
sys.path.insert(0, '.'); sys.path.insert(0, '.scratch')
from sparkinfer.moe.kernels.reduce import moe_reduce_kernel as new
from reduce_old import moe_reduce_kernel as old
rows = []
for (T, K, H, E, S, dt) in [(1, 8, 7168, 256, 1, torch.float32), (8, 8, 7168, 256, 1, torch.float32),
                            (1, 8, 2048, 128, 2, torch.float32),
                            (4096, 8, 7168, 256, 1, torch.bfloat16), (4096, 8, 2048, 128, 1, torch.bfloat16),
                            (64, 8, 7168, 256, 1, torch.bfloat16)]:
    part = torch.randn(S, T * K, H, device="cuda").to(dt)
    ids = torch.randint(0, E, (T, K), device="cuda", dtype=torch.int32)
    tw = torch.rand(T, K, device="cuda")
    out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    ref = (part.float().sum(0).view(T, K, H) * tw[..., None]).sum(1)
    for name, BH in [("old", 256), ("new", 128), ("new", 256), ("new", 512), ("new", 1024)]:
        def call():
            if name == "old":
                old[(T, triton.cdiv(H, BH))](part, ids, tw, out, H, S, part.stride(0), part.stride(1),
                                             out.stride(0), E=E, K=K, BH=BH, WEIGHT_AFTER=True)
            else:
                new[(T, triton.cdiv(H, BH))](part, ids, tw, out, H, S, part.stride(0), part.stride(1),
                                             out.stride(0), E=E, K=K, KP=triton.next_power_of_2(K),
                                             BH=BH, WEIGHT_AFTER=True)
        out.fill_(float("nan")); call(); torch.cuda.synchronize()
        err = (out.float() - ref).abs().max().item()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                call()
        g.replay(); torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record(); g.replay(); b.record(); torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1000 / 20)
        ts.sort()
        r = dict(T=T, K=K, H=H, S=S, dtype=str(dt), kernel=name, BH=BH, us=round(ts[2], 2), maxerr=err)
        rows.append(r); print("reduce", r, flush=True)
json.dump(rows, open(sys.argv[1], "w"))
