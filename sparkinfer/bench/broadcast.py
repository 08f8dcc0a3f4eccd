"""The broadcast ring's cost per engine step: a plan to N rank processes, and back (CPU only).

    sparkinfer bench broadcast                          # 1, 2, 8 readers x 4 KiB, 64 KiB plans
    sparkinfer bench broadcast --readers 2 --sizes 4    # plan sizes in KiB
    sparkinfer bench broadcast --dry-run                # 1-2 readers, a few steps, result in the temp dir

Method. This process is the driver: it creates the plan ring (`--slots` slots) and spawns
one process per reader, as run_ranks starts ranks; reader 0 creates the result ring (one
reader: the driver). Steps run back to back, each timed by the driver with perf_counter_ns,
`--warmup` dropped, `--steps` kept:
- ring broadcast: publish one plan, then flush(): until every reader has copied it out;
- ring round trip: publish one plan; every reader reads it; reader 0 publishes a 2 KiB
  result (token ids and logprobs of 256 sequences) that the driver reads;
- pipe round trip, the peer: the same exchange over multiprocessing pipes (send_bytes to
  every reader, reader 0's result back), which block in the kernel instead of spinning.
Every record carries its step, kind and size; readers check order, size and the fill byte
of every record, the driver every result (`correct`). The floor beside each size is the
data movement alone: one copy in and one out of the record, in this process.

Readers and the driver all spin while they wait (50 us, then nap): with more processes
than cores they time-slice, and the numbers then measure the scheduler as much as the ring
(rows carry `time_sliced`, and the machine's 1-minute load average before and after the run).
"""

from __future__ import annotations

import os
import platform
import struct
import time

from sparkinfer.bench import common, report
from sparkinfer.bench.timing import median

__all__ = ["add_arguments", "main"]

KiB = 1 << 10
RESULT_BYTES = 2 * KiB  # int32 token ids + fp32 logprobs of 256 sequences
_HEADER = struct.Struct("<QQQ")  # step, kind, size
BROADCAST, ROUND_TRIP, TO_PIPES = 0, 1, 2


def add_arguments(p) -> None:
    p.add_argument("--readers", default="1,2,8", help="reader processes per configuration, comma-separated")
    p.add_argument("--sizes", default="4,64", help="plan record sizes in KiB, comma-separated")
    p.add_argument("--steps", type=int, default=2000, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=200, help="untimed steps before them")
    p.add_argument("--slots", type=int, default=8, help="slots of the plan ring")
    p.add_argument("--timeout", type=float, default=60.0, help="the rings' timeout_s")
    p.add_argument("--out", default=None, help="JSON rows (default benchmarks/results/broadcast_cpu.json)")
    p.add_argument("--dry-run", action="store_true", help="1-2 readers, 4 KiB, a few steps")


def _record(step: int, kind: int, size: int, buf: bytearray) -> bytearray:
    """`buf` as the record of `step`: header, and the fill byte at both ends of the body."""
    _HEADER.pack_into(buf, 0, step, kind, size)
    buf[-1] = buf[_HEADER.size] = step % 251
    return buf


def _check(record: bytes, step: int) -> bool:
    got, _, size = _HEADER.unpack_from(record)
    return got == step and len(record) == size and record[-1] == record[_HEADER.size] == step % 251


def _serve(handle, index: int, plans, results, out) -> None:
    """A reader process: read plans until the ring closes (or pipes in between), check each."""
    from sparkinfer.runtime.broadcast import BroadcastRing

    reader = BroadcastRing.attach(handle, index)
    answers = BroadcastRing.create(None, readers=1, slots=2, record_bytes=RESULT_BYTES,
                                   timeout_s=handle.timeout_s) if index == 0 else None
    if answers is not None:
        out.put(answers.handle)
    result, step, bad = bytearray(RESULT_BYTES), 0, 0
    while (record := reader.read()) is not None:
        kind = _HEADER.unpack_from(record)[1]
        bad += not _check(record, step)
        step += 1
        if kind == ROUND_TRIP and answers is not None:
            answers.publish(_record(step - 1, kind, RESULT_BYTES, result))
        if kind == TO_PIPES:
            while msg := plans.recv_bytes():
                bad += not _check(msg, step)
                step += 1
                if results is not None:
                    results.send_bytes(_record(step - 1, ROUND_TRIP, RESULT_BYTES, result))
    reader.close()
    if answers is not None:
        answers.close()
    out.put((index, step, bad))


def _stats(ns: list[int], steps: int) -> dict:
    kept = sorted(ns[-steps:])
    return {"median_us": round(median(kept) / 1e3, 2), "p99_us": round(kept[int(0.99 * (len(kept) - 1))] / 1e3, 2),
            "mean_us": round(sum(kept) / len(kept) / 1e3, 2), "steps": len(kept)}


def _copy_floor_us(size: int, reps: int = 2000) -> float:
    """Microseconds to copy `size` bytes into a buffer and out again (median of `reps`)."""
    src, dst = bytes(size), memoryview(bytearray(size))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        dst[:] = src
        bytes(dst)
        times.append(time.perf_counter_ns() - t0)
    return round(median(times) / 1e3, 2)


def _run_readers(readers: int, sizes: list[int], args, advance) -> list[dict]:
    """Every row of one reader count: ring broadcast and round trip, then pipe round trip."""
    import multiprocessing as mp

    from sparkinfer.runtime.broadcast import BroadcastRing

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ring = BroadcastRing.create(None, readers=readers, slots=args.slots, record_bytes=max(sizes),
                                timeout_s=args.timeout)
    pipes = [ctx.Pipe(duplex=False) for _ in range(readers)]  # (receive end, send end)
    back_r, back_w = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_serve, args=(ring.handle, i, pipes[i][0], back_w if i == 0 else None, out),
                         daemon=True) for i in range(readers)]
    for p in procs:
        p.start()
    rows, step, ok = [], 0, True
    try:
        answers = BroadcastRing.attach(out.get(timeout=args.timeout), 0)
        ring.wait_attached()
        n = args.warmup + args.steps
        for size in sizes:
            buf = bytearray(size)
            for kind, exchange in ((BROADCAST, "broadcast"), (ROUND_TRIP, "round_trip")):
                ns = []
                for _ in range(n):
                    record = _record(step, kind, size, buf)
                    t0 = time.perf_counter_ns()
                    ring.publish(record)
                    if kind == BROADCAST:
                        ring.flush()
                    else:
                        ok &= _check(answers.read(), step)
                    ns.append(time.perf_counter_ns() - t0)
                    step += 1
                rows.append({"transport": "ring", "exchange": exchange, "record_bytes": size,
                             **_stats(ns, args.steps)})
                advance(f"{readers} readers, {size // KiB} KiB, ring {exchange}")
        ring.publish(_record(step, TO_PIPES, 64, bytearray(64)))
        step += 1
        for size in sizes:
            buf, ns = bytearray(size), []
            for _ in range(n):
                record = _record(step, ROUND_TRIP, size, buf)
                t0 = time.perf_counter_ns()
                for _, send in pipes:
                    send.send_bytes(record)
                ok &= _check(back_r.recv_bytes(), step)
                ns.append(time.perf_counter_ns() - t0)
                step += 1
            rows.append({"transport": "pipe", "exchange": "round_trip", "record_bytes": size,
                         **_stats(ns, args.steps)})
            advance(f"{readers} readers, {size // KiB} KiB, pipe round trip")
        for _, send in pipes:
            send.send_bytes(b"")
        ring.close()
        ok &= answers.read() is None
        answers.close()
        reports = sorted(out.get(timeout=args.timeout) for _ in range(readers))
        ok &= reports == [(i, step, 0) for i in range(readers)]
    finally:
        ring.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    cores = os.cpu_count() or 1
    for r in rows:
        r.update(readers=readers, result_bytes=RESULT_BYTES if r["exchange"] == "round_trip" else 0, slots=args.slots,
                 correct=ok, copy_floor_us=_copy_floor_us(r["record_bytes"]), time_sliced=readers + 1 > cores)
    return rows


def _cpu() -> dict:
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    cores = os.cpu_count()
    return {"cpu": model, "cores": cores, "arch": platform.machine(), "python_impl": platform.python_implementation(),
            "note": f"CPU benchmark on a {cores}-core machine: rows with time_sliced=true ran more spinning "
                    "processes (readers + the driver) than cores, so they time-slice; other work on the machine "
                    "time-slices with them too (load_avg_1m: before and after the run)"}


def _load_avg() -> float | None:
    """The 1-minute load average: other work on the machine time-slices with the readers too."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def main(args) -> int:
    readers = [1, 2] if args.dry_run else [int(r) for r in args.readers.split(",")]
    sizes = [4 * KiB] if args.dry_run else [int(float(s) * KiB) for s in args.sizes.split(",")]
    if args.dry_run:
        args.steps, args.warmup = 30, 5
    meta = {**common.metadata(args), **_cpu()}
    out = args.out or common.default_out("broadcast", meta, 1, dry_run=args.dry_run)
    rows, load = [], [_load_avg()]
    with report.progress(total=len(readers) * len(sizes) * 3, label="broadcast") as advance:
        for n in readers:
            rows += _run_readers(n, sizes, args, advance)
    load.append(_load_avg())
    for r in rows:
        r["bench"], r["mode"], r["load_avg_1m"] = "broadcast", "dry-run" if args.dry_run else "full", load
    path = common.append_rows(out, rows, meta)
    by = {(r["readers"], r["record_bytes"], r["transport"], r["exchange"]): r for r in rows}

    def cell(key):
        r = by.get(key)
        return f"{r['median_us']:.1f} / {r['p99_us']:.1f}" if r else "–"

    table = [[n, f"{s // KiB} KiB", cell((n, s, "ring", "broadcast")), cell((n, s, "ring", "round_trip")),
              cell((n, s, "pipe", "round_trip")), f"{by[(n, s, 'ring', 'broadcast')]['copy_floor_us']:.1f}",
              "yes" if by[(n, s, "ring", "broadcast")]["time_sliced"] else "no"] for n in readers for s in sizes]
    report.print_table(f"us per step, median / p99 ({meta['cores']} cores, {meta['cpu']})",
                       ["readers", "plan", "ring broadcast", "ring round trip", "pipe round trip", "copy floor",
                        "time-sliced"], table)
    bad = [f"{r['readers']} readers" for r in rows if not r["correct"]]
    print(f"wrong records: {sorted(set(bad)) or 'none'}; rows appended to {path}")
    return 1 if bad else 0
