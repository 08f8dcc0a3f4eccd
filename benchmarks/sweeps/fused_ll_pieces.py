"""Fused all-reduce + residual + RMSNorm over LL: piece counts and warps per shape against the bare LL all-reduce,
2 GPUs, bf16, per op in a 20-op CUDA graph, median of 15 replays. Every fused launch shape is first checked on fresh
inputs (outputs poisoned with NaN): residual_out bitwise equal to the fp32 reference, out within 2^-7 relative.

    python3 benchmarks/sweeps/fused_ll_pieces.py auto   --out F.json  # the heuristic's shape at T 1..32, H 4096/7168,
                                                                      # and named alternatives at chosen points
    python3 benchmarks/sweeps/fused_ll_pieces.py pieces --out F.json  # S in {1, 2, 4, 8} x warps at H 4096, T 1..16,
                                                                      # S in {3, 7, 14} at H 7168, T 2 / 4
Rows: kind ("ar_ll" or "fused"), T, H, pieces, num_warps, us, ok.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import _common  # noqa: E402
from sparkinfer.runtime import launch  # noqa: E402

ALTERNATIVES = {(2, 4096): (4,), (1, 7168): (7,), (8, 7168): (7,), (16, 7168): (7,)}  # auto mode: pieces to compare


def shapes(mode):
    if mode == "pieces":
        return [(T, 4096) for T in (1, 2, 4, 8, 16)] + [(T, 7168) for T in (2, 4)]
    return [(T, H) for H in (4096, 7168) for T in (1, 2, 4, 8, 16, 32)]


def work(world, mode):
    import torch
    from sparkinfer.comm import Communicator
    from sparkinfer.comm.fused_norm.launch import norm_config
    from sparkinfer.comm.fused_norm.reference import add_rms_norm

    comm = Communicator(capacity_bytes=8 << 20, timeout_s=60, channel_ids=("b",))
    st = torch.cuda.Stream()
    dev = comm.device
    rows = []

    def timeit(fn):
        return round(_common.graph_op_us(fn, st, scope=lambda r: comm.pool.capture(st, "b", reuse=True)), 3)

    for T, H in shapes(mode):
        x = torch.randn(T, H, device=dev).bfloat16()
        o = torch.empty_like(x)
        rows.append(dict(kind="ar_ll", T=T, H=H, us=timeit(lambda: comm.all_reduce(x, o, algorithm="ll"))))
        r = torch.randn(T, H, device=dev).bfloat16()
        wt = torch.randn(H, device=dev).bfloat16()
        ro = torch.empty_like(x)
        auto = norm_config(comm.caps, T, H, 2, ll=True)
        cfgs = [("auto", auto)]
        if mode == "pieces":
            grid = (((1, 4), (2, 4), (4, 4), (8, 4), (4, 8), (2, 8)) if H == 4096
                    else ((3, 4), (7, 4), (14, 4), (14, 2)))
            cfgs += [(f"S{s}_w{w}", norm_config(comm.caps, T, H, 2, ll=True, pieces=s, num_warps=w))
                     for s, w in grid if T * s <= comm.caps.num_sms]
        else:
            cfgs += [(f"S{s}", norm_config(comm.caps, T, H, 2, ll=True, pieces=s))
                     for s in ALTERNATIVES.get((T, H), ())]
        for name, cfg in cfgs:
            xs, rs = torch.randn(T, H, device=dev).bfloat16(), torch.randn(T, H, device=dev).bfloat16()
            o.fill_(float("nan"))
            ro.fill_(float("nan"))
            comm.all_reduce_add_rms_norm(xs, rs, wt, 1e-6, out=o, residual_out=ro, algorithm="fused_ll", config=cfg)
            eo, er = add_rms_norm(comm.all_reduce(xs.float(), algorithm="nccl"), rs, wt, 1e-6)
            torch.cuda.synchronize()
            close = ((o.float() - eo.float()).abs() <= eo.float().abs() * 2 ** -7 + 1e-3).all()
            ok = bool(torch.equal(ro, er)) and bool(close)
            us = timeit(lambda: comm.all_reduce_add_rms_norm(x, r, wt, 1e-6, out=o, residual_out=ro,
                                                             algorithm="fused_ll", config=cfg))
            rows.append(dict(kind="fused", name=name, T=T, H=H, pieces=cfg.pieces, num_warps=cfg.num_warps, us=us,
                             ok=ok))
            if world.rank == 0:
                print(f"T={T:<3} H={H} {name:<8} S={cfg.pieces:<3} w={cfg.num_warps:<2} {us:6.2f} us"
                      + ("" if ok else "  WRONG"), flush=True)
    comm.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("auto", "pieces"))
    ap.add_argument("--out", default="benchmarks/results/fused_ll_pieces_2xh200.json")
    args = ap.parse_args()
    rows = launch(work, 2, backend="cuda", args=(args.mode,), timeout_s=500)[0]
    meta = _common.metadata()
    meta["command"] = "python3 benchmarks/sweeps/fused_ll_pieces.py " + " ".join(sys.argv[1:])
    _common.append_rows(args.out, [dict(r, mode=args.mode) for r in rows], meta)
    bad = [r for r in rows if r.get("ok") is False]
    print(f"{len(rows)} rows -> {args.out}; {len(bad)} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
