"""Shared helpers of the fault suite: rank-encoded payloads and a case runner
that records, per case, "ok" or what went wrong (so one launch checks many cases)."""

from __future__ import annotations

import re

import torch

CAP = 8192  # bytes of staging: small, so capacity edges are cheap in the interpreter


def payload(rank: int, n: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """Small integers: every partial sum is exact in bf16/fp16/fp32."""
    return ((torch.arange(n) * 5 + rank * 3 + salt) % 11).to(dtype)


def expected_sum(world: int, n: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    return sum(payload(r, n, torch.float32, salt) for r in range(world)).to(dtype)


def expect_raises(cases) -> list:
    """cases: (id, exception type, message regex, thunk). Returns the failures only."""
    bad = []
    for cid, exc, match, fn in cases:
        try:
            fn()
            bad.append((cid, "no error"))
        except exc as e:
            if not re.search(match, str(e)):
                bad.append((cid, f"wrong message: {e}"))
        except Exception as e:  # noqa: BLE001 - the point is to report the wrong type
            bad.append((cid, f"{type(e).__name__}: {e}"))
    return bad


def spawn_ranks(fn, world_size: int, *, args=(), timeout_s: float = 120.0, backend: str = "cpu") -> dict:
    """Like runtime.run_ranks, but a rank that dies on purpose does not stop the
    others: returns {rank: ("ok", result) | ("err", traceback)} for the ranks that
    reported; ranks still running at the deadline are killed and absent."""
    import multiprocessing as mp
    import pickle
    import queue
    import shutil
    import tempfile
    import time

    from sparkinfer.runtime.ranks import _child

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mkdtemp(prefix="sparkinfer_faults_")
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, backend, f"file://{store}/store", tuple(args), {},
                                              results), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and (any(p.is_alive() for p in procs) or not results.empty()):
            try:
                status, rank, payload = results.get(timeout=0.2)
            except queue.Empty:
                continue
            out[rank] = ("ok", pickle.loads(payload)) if status == "ok" else ("err", payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(store, ignore_errors=True)
    return out


def shm_files(pid: int) -> list:
    """This process's slabs still named in /dev/shm (HostSlabBackend names them sparkinfer-<pid>-*)."""
    import os

    return [f for f in os.listdir("/dev/shm") if f.startswith(f"sparkinfer-{pid}-")]
