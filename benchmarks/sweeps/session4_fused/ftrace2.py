"""Phase traces (globaltimer ns / clock64 per block) of the fused LL kernel and the LL all-reduce, last op of a 20-op
graph, 10 replays. Needs a tree patched by mk_trace.py."""
import os, sys, json, statistics as stt
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _common  # noqa
from sparkinfer.runtime import launch  # noqa


def work(world, tag):
    import torch
    from sparkinfer.comm import Communicator
    import sparkinfer.comm.fused_norm.launch as fl
    import sparkinfer.comm.all_reduce.launch as al
    from sparkinfer.comm.topology import ll_launch_config
    comm = Communicator(capacity_bytes=8 << 20, timeout_s=60, channel_ids=("b",))
    st = torch.cuda.Stream()
    dev = comm.device
    res = {}
    for kind in ("fused", "ar"):
        for T, H in ((1, 4096), (1, 7168), (8, 7168)):
            x = torch.randn(T, H, device=dev).bfloat16(); r = torch.randn(T, H, device=dev).bfloat16()
            wt = torch.randn(H, device=dev).bfloat16(); o2, ro = torch.empty_like(x), torch.empty_like(x)
            if kind == "fused":
                cfg = fl.norm_config(comm.caps, T, H, 2, ll=True); mod = fl
                fn = lambda: comm.all_reduce_add_rms_norm(x, r, wt, 1e-6, out=o2, residual_out=ro, algorithm="fused_ll", config=cfg)
            else:
                cfg = ll_launch_config(comm.caps, x.numel() * 2); mod = al
                fn = lambda: comm.all_reduce(x, o2, algorithm="ll")
            tr = torch.zeros(cfg.grid, 16, dtype=torch.int64, device=dev)
            mod.TRACE = tr
            fn(); torch.cuda.synchronize()
            g = _common.Graph(lambda: [fn() for _ in range(20)], st, scope=lambda rr: comm.pool.capture(st, "b", reuse=True))
            samples = []
            for rep in range(12):
                g.replay(); torch.cuda.synchronize()
                t = tr.cpu()
                samples.append({"gt": (t[:, :8] - int(t[:, 0].min())).tolist(), "clk": (t[:, 8:] - t[:, 8:9]).tolist()})
            g.release()
            mod.TRACE = None
            res[f"{kind}_T{T}_H{H}"] = samples[2:]
    comm.close()
    return res


if __name__ == "__main__":
    res = launch(work, 2, backend="cuda", args=("t",), timeout_s=300)
    out = os.environ.get("OUT", "/tmp/out"); os.makedirs(out, exist_ok=True)
    json.dump(res, open(os.path.join(out, f"ftrace_{sys.argv[1]}.json"), "w"))
    for rank, rr in enumerate(res):
        for k, samples in rr.items():
            n = 7 if k.startswith("fused") else 4
            ph = [round(stt.median(stt.median(b[i] - b[i - 1] for b in s["clk"]) for s in samples)) for i in range(1, n)]
            span = round(stt.median(max(b[n - 1] for b in s["gt"]) for s in samples))
            print(f"{sys.argv[1]} rank{rank} {k} clk phases={ph} span_ns={span}")
