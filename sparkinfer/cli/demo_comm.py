"""`sparkinfer demo-comm`: every collective on N ranks, checked exactly.

    sparkinfer demo-comm [--world-size 2] [--backend auto|cpu|cuda|cuda_shared]

It starts N ranks (GPUs if this host has N, else CPU processes running
the same Triton kernels through the interpreter), builds a Communicator through
the channel pool, runs every collective on rank-encoded payloads, checks each
result exactly against the fp32 reference, and closes the pool collectively.
"""

from __future__ import annotations

import time

__all__ = ["add_parser", "demo"]


def _demo_rank(world, sizes):
    import torch

    from sparkinfer.comm import Communicator

    dev = world.device
    comm = Communicator(device=dev, capacity_bytes=1 << 20, timeout_s=30, channel_ids=("target",))
    lines = []
    W, r = world.world_size, world.rank

    def payload(rank, n, dtype):  # small integers: every sum is exact in bf16
        return ((torch.arange(n, device=dev) * 7 + rank * 3) % 17).to(dtype)

    def expect(n, dtype):
        return sum(payload(q, n, torch.float32) for q in range(W)).to(dtype)

    for n in sizes:
        for algo in ("oneshot", "twoshot", "auto"):
            x = payload(r, n, torch.bfloat16)
            out = torch.full_like(x, float("nan"))
            comm.all_reduce(x, out, algorithm=algo)
            ok = torch.equal(out, expect(n, torch.bfloat16))
            lines.append(f"all_reduce {algo:8s} n={n:<6d} bf16  {'exact' if ok else 'WRONG'}")
        m = n * W
        x = payload(r, m, torch.float32)
        rs = comm.reduce_scatter(x)
        ok = torch.equal(rs, expect(m, torch.float32)[r * n:(r + 1) * n])
        lines.append(f"reduce_scatter    n={m:<6d} fp32  {'exact' if ok else 'WRONG'}")
        ag = comm.all_gather(payload(r, n, torch.float16))
        ok = torch.equal(ag, torch.cat([payload(q, n, torch.float16) for q in range(W)]))
        lines.append(f"all_gather        n={n:<6d} fp16  {'exact' if ok else 'WRONG'}")
    if dev.type == "cuda":
        s = torch.cuda.Stream(dev)
        x = payload(r, sizes[0], torch.bfloat16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), comm.pool.capture(s, "target"):
            out = comm.all_reduce(x)  # warm-up inside the scope
            with torch.cuda.graph(g, stream=s):
                out = comm.all_reduce(x)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize(dev)
        ok = torch.equal(out, expect(sizes[0], torch.bfloat16))
        lines.append(f"graph replay      n={sizes[0]:<6d} bf16  {'exact' if ok else 'WRONG'}")
    comm.synchronize()
    comm.close()
    lines.append("pool closed collectively")
    return lines


def demo(args) -> int:
    from sparkinfer.runtime.ranks import check_world_size, resolve_backend, run_ranks

    backend = resolve_backend(args.backend, check_world_size(args.world_size))  # SetupError: one line (cli.main)
    print(f"sparkinfer demo-comm: {args.world_size} ranks on {backend}"
          + (" (Triton interpreter; no GPU found for every rank)" if backend == "cpu" else ""), flush=True)
    sizes = [1, 1000, 20000] if backend == "cpu" else [1, 4096, 1 << 18]
    t0 = time.perf_counter()
    results = run_ranks(_demo_rank, args.world_size, backend=backend, args=(sizes,), timeout_s=600)
    for r, lines in enumerate(results):
        for line in lines:
            print(f"  rank {r}: {line}")
    bad = sum("WRONG" in line for lines in results for line in lines)
    print(f"{'FAILED' if bad else 'OK'}: {sum(len(x) for x in results) - bad} checks passed, {bad} failed "
          f"in {time.perf_counter() - t0:.1f} s")
    return 1 if bad else 0


def add_parser(sub) -> None:
    d = sub.add_parser("demo-comm", help="run every collective across N ranks and check the results")
    d.add_argument("--world-size", type=int, default=2)
    d.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda", "cuda_shared"))
    d.set_defaults(run=demo)
