#!/usr/bin/env python3
"""The HTTP process's own CPU per streamed token: `sparkinfer serve`'s serving path
(uvicorn, the app, the handles) over the deterministic fake engine, loaded by `bench
serve`'s load generator.

The fake engine (`tests/serve/fake_engine.py`) steps every `--step-s` in a thread of the
server's process and answers every request at once, so what the server process spends
is the HTTP layer's work plus the fake's stepping thread. Linux's per-thread CPU clocks
(/proc/<pid>/task/<tid>/stat) split them: the main thread runs uvicorn's event loop
(parsing, the handlers, chunk formatting, metrics, socket writes), the other threads
the fake's steps and the pushes into the handles, where a real server's engine reader
thread would be. Rows: per level, the loop thread's and the other threads' CPU
microseconds per output token, and tokens/s, and whether uvloop and httptools were
importable (uvicorn then serves on them). Streams of `--output-len` tokens a
request (`ignore_eos`) at fixed concurrency; a warm-up level first.

    python3 benchmarks/sweeps/serve_http_cost.py --concurrency 64 --requests 384 --repeats 3

Runs the checkout it is started in (the working directory: its `sparkinfer` and
`tests` come first on the path), so one copy of this script can time two commits'
servers. CPU numbers of the machine it runs on (the 2-core CI VM is noisy:
take the median of --repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def _serve(step_s: float, max_batch: int) -> int:
    from sparkinfer.cli.serve import serve_engine
    from sparkinfer.serve.server import ServeOptions
    from sparkinfer.serve.state import ServerLimits
    from tests.serve.fake_engine import FakeEngine

    engine = FakeEngine(step_s=step_s, max_context=8192, max_batch=max_batch, max_waiting=4 * max_batch)
    options = ServeOptions(host="127.0.0.1", port=0, limits=ServerLimits(grace_s=5, poll_s=0.05),
                           log_level="warning", access_log=False)
    return serve_engine(engine, options)


def _thread_cpu_s(pid: int) -> dict[int, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended between the listing and the read
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def _extras() -> dict:
    """Whether uvicorn's optional event loop (uvloop) and HTTP parser (httptools) are
    importable here; the server subprocess, with the same path, then takes them
    (uvicorn's "auto" loop and http)."""
    import importlib.util

    return {name: importlib.util.find_spec(name) is not None for name in ("uvloop", "httptools")}


def main(argv=None) -> int:
    sys.path.insert(0, os.getcwd())  # the checkout timed: its sparkinfer and its tests (the fake engine)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="64")
    ap.add_argument("--requests", type=int, default=384, help="requests per level")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--step-s", type=float, default=0.004, help="the fake engine's step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)  # the server subprocess
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.serve_fake:
        return _serve(args.step_s, max(levels))

    from sparkinfer.bench.common import append_rows, metadata
    from sparkinfer.bench.serve_load import LoadSpec, run_load_procs
    from sparkinfer.bench.serve_process import started_server

    cmd = [sys.executable, os.path.abspath(__file__), "--serve-fake", "--step-s", str(args.step_s),
           "--concurrency", args.concurrency]
    rows = []
    with started_server(cmd, 120) as server:
        pid = server.proc.pid
        for conc in levels:
            spec = LoadSpec(url=server.url, model="fake-model", input_len=args.input_len, output_len=args.output_len,
                            requests=args.requests, concurrency=conc)
            run_load_procs(LoadSpec(**{**spec.__dict__, "requests": conc}), args.client_procs)  # warm-up
            runs = []
            for _ in range(args.repeats):
                before = _thread_cpu_s(pid)
                results, wall = run_load_procs(spec, args.client_procs)
                after = _thread_cpu_s(pid)
                tokens = sum(r.output_tokens for r in results if r.ok)
                loop_s = after[pid] - before[pid]
                other_s = sum(v - before.get(t, 0.0) for t, v in after.items() if t != pid)
                runs.append(dict(ok=all(r.ok for r in results), tokens=tokens, wall_s=wall,
                                 loop_us_per_token=loop_s / tokens * 1e6, other_us_per_token=other_s / tokens * 1e6,
                                 tokens_per_s=tokens / wall))
                print(json.dumps({"concurrency": conc, **{k: round(v, 2) if isinstance(v, float) else v
                                                          for k, v in runs[-1].items()}}), flush=True)
            rows.append(dict(bench="serve_http_cost", concurrency=conc, requests=args.requests,
                             output_len=args.output_len, step_s=args.step_s, client_procs=args.client_procs,
                             cpu_cores=os.cpu_count(), **_extras(), ok=all(r["ok"] for r in runs), runs=runs,
                             **{k: statistics.median(r[k] for r in runs)
                                for k in ("loop_us_per_token", "other_us_per_token", "tokens_per_s")}))
    if args.out:
        append_rows(args.out, rows, metadata())
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
