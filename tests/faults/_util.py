"""Shared helpers of the fault suite: rank-encoded payloads and a case runner
that records, per case, "ok" or what went wrong (so one launch checks many cases)."""

from __future__ import annotations

import re
import time

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
            out[rank] = ("ok", pickle.loads(payload)) if status == "ok" else ("err", payload[0])  # its traceback
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(store, ignore_errors=True)
    return out


_SHM_NAME = re.compile(r"^sparkinfer-(?:ring-|res-)?(\d+)-")


def shm_files(*pids: int) -> list:
    """The /dev/shm names these processes made that are still there: host slabs
    (sparkinfer-<pid>-*), plan rings (sparkinfer-ring-<pid>-*) and result rings
    (sparkinfer-res-<pid>-*). By creator, not by difference with an earlier listing:
    the other test worker's names come and go meanwhile (a CI run saw one of them)."""
    import os

    return sorted(f for f in os.listdir("/dev/shm") if (m := _SHM_NAME.match(f)) and int(m.group(1)) in pids)


def close_outcome(comm) -> str:
    """comm.close()'s outcome as text: "closed", "TeardownError: ...", or another error's type and message."""
    from sparkinfer.errors import TeardownError

    try:
        comm.close()
        return "closed"
    except TeardownError as e:
        return "TeardownError: " + str(e)
    except Exception as e:  # noqa: BLE001 - the point is to report the wrong type
        return f"{type(e).__name__}: {e}"


def late_peer_outcomes(world, ops: dict, make_comm, x, late_s: float, *, sync: bool = False) -> dict:
    """{op name: (first, later)} of one rank when rank 1 reaches each op `late_s` after
    rank 0 (which times out and aborts the group meanwhile). first: "returned" or
    ("timeout", peer, says it aborted the group, says the communicator is now unusable);
    later: a second call says the communicator is unusable and to close() it. sync:
    synchronize after the first call (on a GPU the end-of-kernel abort check is seen there)."""
    from sparkinfer.errors import CollectiveTimeout

    got = {}
    for name, op in ops.items():
        comm = make_comm()
        if world.rank == 1:
            time.sleep(late_s)  # rank 0 times out and aborts meanwhile
        try:
            op(comm, x)
            if sync:
                comm.synchronize()
            first = "returned"
        except CollectiveTimeout as e:
            first = ("timeout", e.peer, "aborted the group" in str(e), "now unusable" in str(e))
        try:
            op(comm, x)
            later = "returned"
        except CollectiveTimeout as e:
            later = "unusable since an earlier error" in str(e) and "close() the communicator" in str(e)
        comm.close()
        got[name] = (first, later)
    return got


def assert_late_peer_outcomes(r0: dict, r1: dict, names) -> None:
    """Both ranks time out naming the other, only the late one hears of the abort, and
    both then refuse further calls."""
    for name in names:
        assert r0[name] == (("timeout", 1, False, True), True), (name, r0[name])
        assert r1[name] == (("timeout", 0, True, True), True), (name, r1[name])


def nonfinite_problems(got: torch.Tensor, ref: torch.Tensor, *, atol: float = 0.0) -> list:
    """How `got` departs from `ref`'s non-finite pattern: NaN exactly where ref has NaN,
    +inf / -inf exactly where ref has them, finite elements equal (atol 0) or within atol.
    Compared in fp32, on the CPU; [] when they agree."""
    g, r = got.detach().float().cpu(), ref.detach().float().cpu()
    if g.shape != r.shape:
        return [f"shape {tuple(g.shape)}, reference {tuple(r.shape)}"]
    bad = []
    for what, mask in (("NaN", torch.isnan), ("+inf", lambda t: t == float("inf")),
                       ("-inf", lambda t: t == float("-inf"))):
        mg, mr = mask(g), mask(r)
        if not torch.equal(mg, mr):
            bad.append(f"{what} at {mg.flatten().nonzero().flatten().tolist()[:12]}, reference at "
                       f"{mr.flatten().nonzero().flatten().tolist()[:12]} (flat indices)")
    fin = torch.isfinite(g) & torch.isfinite(r)
    err = (g[fin] - r[fin]).abs().max().item() if fin.any() else 0.0
    if err > atol * max(1.0, r[fin].abs().max().item() if fin.any() else 1.0):
        bad.append(f"finite elements differ by {err:g}")
    return bad


def bits(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (NaN payloads included), to compare results across ranks."""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def run_case_table(world, modules, skip=()) -> dict:
    """Run every case of each module's CASES (id -> run(comm, rank) -> (problems,
    replicated outputs); modules named, since closures do not pickle to the ranks; one
    name or several) on one communicator on world.device, tensors made there by default:
    {id: (problems, sha1 of each replicated output)}. Ids containing a string of `skip`
    are left out. One launch for several tables: each launch costs seconds of start-up."""
    import hashlib
    import importlib

    cases = {}
    for module in [modules] if isinstance(modules, str) else modules:
        table = importlib.import_module(module).CASES
        assert not set(table) & set(cases), "case ids must be unique across the tables"
        cases.update(table)

    from sparkinfer.comm import Communicator

    # the GPU compiles each kernel on its first call: ranks may be seconds apart there
    comm = Communicator(capacity_bytes=CAP, timeout_s=30 if world.device.type == "cpu" else 120,
                        device=world.device)
    got = {}
    with torch.device(world.device):
        for cid, run in cases.items():
            if any(s in cid for s in skip):
                continue
            try:
                problems, replicated = run(comm, world.rank)
            except Exception as e:  # noqa: BLE001 - reported per case, the other cases still run
                problems, replicated = [f"{type(e).__name__}: {e}"], []
            got[cid] = (problems, [hashlib.sha1(bits(t)).hexdigest() for t in replicated])
    comm.synchronize()
    comm.close()
    return got
