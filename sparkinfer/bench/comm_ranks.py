"""The rank side of `sparkinfer bench comm`: implementations, the exact check and the
graph timing of every (op, implementation, size). Runs in each rank process."""

from __future__ import annotations

import contextlib
import json
import time
import warnings

from sparkinfer.bench.collectives import Collective, Ctx, poison
from sparkinfer.bench.report import progress
from sparkinfer.bench.timing import Graph, median, time_calls

__all__ = ["Impl", "make_impls", "count_impls", "measure", "bench_rank", "LL_MAX_BENCH"]

MiB = 1 << 20
LL_MAX_BENCH = 4 * MiB  # LL stages 2 bytes per byte and is meant for small sizes: timed up to here
OPS = ("all_reduce", "reduce_scatter", "all_gather", "symm")  # symm: torch SymmetricMemory's all_reduce


class Impl:
    """One implementation of one op at one size, on `coll`'s buffers.

    load(seed) writes the inputs; call() is one op (captured `ops` times);
    result() is the tensor to compare with coll.expected(seed); reset() makes the
    buffers safe to reduce repeatedly (in-place implementations, which set
    inplace: a graph of `ops` calls then multiplies the sum by W^(ops - 1))."""

    def __init__(self, name, coll, call, *, load=None, result=None, reset=None, ours=False, inplace=False):
        self.name, self.coll, self.call, self.ours, self.inplace = name, coll, call, ours, inplace
        self.load = load or (lambda seed: (coll.load(seed), poison(coll.out)))
        self.result = result or (lambda: coll.out)
        self.reset = reset or (lambda: None)


def _our_algorithms(size: int) -> list[str]:
    from sparkinfer.comm.topology import ALGORITHMS

    return [a for a in ALGORITHMS if a != "nccl" and (a != "ll" or size <= LL_MAX_BENCH)] + ["auto"]


def count_impls(op: str, size: int) -> int:
    """How many rows make_impls(op, size) yields (for the progress bar)."""
    return len(_our_algorithms(size)) + 1 if op == "all_reduce" else 2


_SYMM_KEEP: list = []


def make_impls(comm, op: str, size: int, symm) -> list:
    """The implementations of `op` (one of OPS) at `size` bytes (bf16). An
    implementation that is unavailable is a string saying why."""
    import torch
    import torch.distributed as dist

    bf, n, W = torch.bfloat16, size // 2, comm.world_size
    if op == "reduce_scatter":
        c = Collective(comm, "rs", n, bf)
        return [Impl("ours", c, c.call, ours=True), Impl("nccl", c, lambda: dist.reduce_scatter_tensor(c.out, c.x))]
    if op == "all_gather":
        c = Collective(comm, "ag", n // W, bf)
        return [Impl("ours", c, c.call, ours=True), Impl("nccl", c, lambda: dist.all_gather_into_tensor(c.out, c.x))]
    if op == "all_reduce":
        out = [Impl(alg, c, c.call, ours=True) for alg in _our_algorithms(size)
               for c in [Collective(comm, "ar", n, bf, alg)]]
        c = Collective(comm, "ar", n, bf)
        load = lambda seed: (c.load(seed), c.out.copy_(c.x))  # noqa: E731 - NCCL reduces in place
        return out + [Impl("nccl", c, lambda: dist.all_reduce(c.out), load=load, reset=lambda: c.out.zero_(),
                           inplace=True)]
    assert op == "symm", op
    if isinstance(symm, str):
        return [symm, symm]
    mod, gname = symm
    try:
        buf = mod.empty(n, dtype=bf, device=comm.device)
        mod.rendezvous(buf, gname)
        _SYMM_KEEP.append(buf)  # never freed while a peer may still map it
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return [f"rendezvous: {type(e).__name__}: {e}"] * 2
    ops, out = torch.ops.symm_mem, []
    c1 = Collective(comm, "ar", n, bf)
    load1 = lambda seed: (c1.load(seed), buf.copy_(c1.x), poison(c1.out))  # noqa: E731
    out.append(Impl("symm_one_shot", c1, lambda: ops.one_shot_all_reduce_out(buf, "sum", gname, c1.out), load=load1))
    c2 = Collective(comm, "ar", n, bf)
    out.append(Impl("symm_two_shot", c2, lambda: ops.two_shot_all_reduce_(buf, "sum", gname),
                    load=lambda seed: (c2.load(seed), buf.copy_(c2.x)), result=lambda: buf, reset=lambda: buf.zero_(),
                    inplace=True))
    return out


def _graph_expected(impl, seed: int, ops: int):
    """What one replay of a graph of `ops` calls leaves in impl.result(), or None
    when it is not exact: an in-place all-reduce reduces its own output again on
    each call, so it holds sum * W^(ops - 1), exact in bf16 when W is a power of
    two (payload sums are integers of at most 8 bits)."""
    want = impl.coll.expected(seed)
    if not impl.inplace:
        return want
    W = impl.coll.comm.world_size
    if W & (W - 1) or (ops - 1) * W.bit_length() > 100:
        return None
    return (want.float() * float(W) ** (ops - 1)).to(want.dtype)


def measure(ctx, impl, ops: int, replays: int, channel: str = "bench") -> dict:
    """Exact check once eagerly, then the graph timing, then the exact check of
    one more replay of the timed graph on new inputs (poisoned outputs).
    Returns row fields: correct is True only when both checks pass."""
    import torch

    row = {}
    impl.load(1)
    impl.call()
    ctx.sync()
    eager_ok = bool(torch.equal(impl.result(), impl.coll.expected(1)))
    impl.reset()
    s = ctx.stream()
    scope = (lambda r: ctx.comm.pool.capture(s, channel, reuse=True)) if impl.ours else None
    g = Graph(lambda: [impl.call() for _ in range(ops)], s, scope=scope, cpu_streams=ctx.cpu_streams, warmup=1)
    g.replay()  # upload / first-launch cost stays out of the timings
    ctx.sync()
    ts = time_calls(g.replay, replays + 1, cuda=ctx.cuda)[1:]
    impl.load(2)  # the timed graph itself, on new inputs (the default load poisons outputs)
    g.replay()
    ctx.sync()
    want = _graph_expected(impl, 2, ops)
    graph_ok = None if want is None else bool(torch.equal(impl.result(), want))
    impl.reset()
    g.release()
    row["correct_eager"], row["correct_graph"] = eager_ok, graph_ok
    row["correct"] = eager_ok and graph_ok is not False
    row["us"] = median(ts) / ops * 1e6
    row["us_min"] = min(ts) / ops * 1e6
    return row


def _symm_setup(world):
    """(torch symmetric-memory module, group name), or why it is unavailable."""
    if world.backend != "cuda":
        return "unavailable: CPU dry run"
    try:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        gname = dist.group.WORLD.group_name
        with warnings.catch_warnings(), contextlib.suppress(Exception):
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(gname)  # required by older torch, a deprecated no-op later
        return symm_mem, gname
    except Exception as e:  # noqa: BLE001
        return f"unavailable: {type(e).__name__}: {e}"


def bench_rank(world, cfg: dict) -> list:
    """Every measurement of the run on this rank, in a fixed order (both ranks agree)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch.distributed as dist

    from sparkinfer.comm import Communicator, select_algorithm

    sizes = cfg["sizes"]
    cap = max(sizes + [2 * s for s in sizes if s <= LL_MAX_BENCH])
    comm = Communicator(capacity_bytes=cap, timeout_s=10.0, channel_ids=("bench",))
    ctx, symm, rows = Ctx(world, comm), _symm_setup(world), []
    t_start = time.perf_counter()

    def emit(row):  # rows also stream to disk: a rank that dies loses only what follows
        rows.append(row)
        with open(f"{cfg['partial']}.rank{world.rank}.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    total = sum(count_impls(op, s) for op in OPS for s in sizes)
    with progress(total, "comm", enabled=world.rank == 0) as advance:
        # ours and NCCL first, torch SymmetricMemory last: a crash there cannot take our rows with it
        for op in OPS:
            for size in sizes:
                ops = cfg["ops"].get(size, cfg["ops_default"])
                for i, impl in enumerate(make_impls(comm, op, size, symm)):
                    row = {"op": "all_reduce" if op == "symm" else op, "size_bytes": size, "dtype": "bfloat16",
                           "ops_per_graph": ops, "replays": cfg["replays"]}
                    if isinstance(impl, str):  # unavailable: `impl` says why
                        row.update(impl=("symm_one_shot", "symm_two_shot")[i], error=impl[:400])
                    else:
                        row["impl"] = impl.name
                        if impl.name == "auto":
                            row["algorithm"] = select_algorithm(comm.caps, size, None)
                        try:
                            row.update(measure(ctx, impl, ops, cfg["replays"]))
                        except Exception as e:  # noqa: BLE001 - same on both ranks; recorded, the run goes on
                            row["error"] = f"{type(e).__name__}: {e}"[:400]
                    emit(row)
                    advance(f"{row['op']} {row['impl']} {size >> 10} KiB")
    comm.synchronize()
    comm.close()
    dist.barrier()
    rows.append({"op": "rank_info", "seconds": round(time.perf_counter() - t_start, 1), "num_sms": comm.caps.num_sms,
                 "capacity": comm.caps.capacity, "link": comm.caps.link})
    return rows
