"""A/B timing of LL variants on 2 GPUs: all_reduce LL / one-shot at 2-128 KiB and fused norm at T = 1 and 8
(forced pieces), per op in a 20-op CUDA graph, median of 15 replays. Variants are applied as patches to the tree
before a run (results: benchmarks/results/fused_ll_ab_2xh200.json). Usage: python3 fused_ll_ab.py TAG (TAG
starting with "s": the piece-count sweep)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import _common  # noqa: E402
from sparkinfer.runtime import launch  # noqa: E402


def work(world, tag):
    import torch
    from sparkinfer.comm import Communicator
    from sparkinfer.comm.fused_norm.launch import norm_config
    comm = Communicator(capacity_bytes=8 << 20, timeout_s=60, channel_ids=("b",))
    st = torch.cuda.Stream()
    dev = comm.device
    out = []
    def timeit(fn, name):
        us = _common.graph_op_us(fn, st, scope=lambda r: comm.pool.capture(st, "b", reuse=True))
        out.append((name, round(us, 2)))
    for kib in ((2,) if tag.startswith("s") else (2, 32, 128)):
        n = kib * 512
        x = torch.randn(n, device=dev).bfloat16(); o = torch.empty_like(x)
        timeit(lambda: comm.all_reduce(x, o, algorithm="ll"), f"ar_ll_{kib}K")
        timeit(lambda: comm.all_reduce(x, o, algorithm="oneshot"), f"ar_oneshot_{kib}K")
    shapes = ((1, 4096, 8, None), (1, 7168, 7, None), (1, 7168, 14, None), (8, 7168, 7, None), (8, 4096, 1, 8))
    if tag.startswith("s"):
        shapes = ((1, 4096, 2, None), (1, 4096, 4, None), (1, 4096, 4, 8), (1, 7168, 4, None), (1, 7168, 4, 8), (1, 7168, 2, 8),
                  (8, 7168, 2, 8), (8, 7168, 4, None), (8, 7168, 4, 8), (8, 7168, 3, 8), (8, 4096, 2, None), (8, 4096, 2, 8))
    for T, H, pieces, warps in shapes:
        x = torch.randn(T, H, device=dev).bfloat16(); r = torch.randn(T, H, device=dev).bfloat16()
        w = torch.randn(H, device=dev).bfloat16(); o, ro = torch.empty_like(x), torch.empty_like(x)
        cfg = norm_config(comm.caps, T, H, 2, ll=True, pieces=pieces, num_warps=warps)
        timeit(lambda: comm.all_reduce_add_rms_norm(x, r, w, 1e-6, out=o, residual_out=ro, algorithm="fused_ll", config=cfg), f"fused_T{T}_H{H}_S{pieces}_w{warps or cfg.num_warps}")
        timeit(lambda: comm.all_reduce(x, o, algorithm="ll"), f"ar_ll_T{T}_H{H}")
    comm.close()
    return out

if __name__ == "__main__":
    res = launch(work, 2, backend="cuda", args=(sys.argv[1],), timeout_s=300)
    print(sys.argv[1], " ".join(f"{n}={u}" for n, u in res[0]), flush=True)
