"""A seeded random mix of valid and invalid calls on every op. Each call returns
the reference result or raises the expected typed error on every rank, within
the deadline; afterwards nothing is left in /dev/shm or the temp directory. The
seed is printed by the assertions on failure.

Valid calls: all_reduce (every algorithm), all_gather, reduce_scatter, the fused
norm (every algorithm), dcp_merge (kernel, NCCL, scattered heads or not) and
all_gather_heads, on random sizes and dtypes. Invalid calls made the same way on
every rank (host-side rejections: the communicator stays usable): a bad dtype,
an overlapping out=, a size above the capacity, a bad shape, an unknown
algorithm. Invalid calls that differ across ranks: two different collectives, or
one collective with different sizes (CollectiveMismatch on every rank; the
communicator is then poisoned, so it is closed and re-created, and the mix goes
on), and a tensor rejected on one rank only and retried corrected at once (the
call completes on every rank)."""

import os
import random
import time

import torch

from sparkinfer.errors import (
    AliasingError,
    CapacityError,
    CollectiveMismatch,
    DTypeError,
    PlanError,
    ShapeError,
    SparkInferError,
)
from sparkinfer.runtime import run_ranks
from tests.faults._util import CAP, expected_sum, payload, shm_files

SEED = random.randrange(1 << 30)
CALLS = 40
DEADLINE_S = 5.0
SLACK_S = 3.0  # 2 busy cores: a rank may be descheduled for a while past its deadline
H = 32  # fused norm hidden size
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _close(got, want, dtype) -> bool:
    return torch.allclose(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def _norm(comm, r, W, T, dtype, algorithm):
    from sparkinfer.comm.fused_norm.reference import all_reduce_add_rms_norm_reference

    xs = [(payload(q, T * H, dtype) - 5).view(T, H) for q in range(W)]
    residual, weight = payload(7, T * H, dtype).view(T, H), 1 + payload(9, H, dtype) / 8
    out, res = comm.all_reduce_add_rms_norm(xs[r], residual, weight, algorithm=algorithm)
    want, want_res = all_reduce_add_rms_norm_reference(xs, residual, weight, 1e-6)
    return _close(out, want, dtype) and _close(res, want_res, dtype)


def _dcp_inputs(q, T, dtype, salt):
    g = torch.Generator().manual_seed(salt * 16 + q)
    return torch.randn(T, 4, 32, generator=g).to(dtype), torch.randn(T, 4, generator=g)


def _dcp(comm, r, W, T, dtype, algorithm, scatter, salt):
    from sparkinfer.comm.dcp.reference import dcp_merge_reference

    ins = [_dcp_inputs(q, T, dtype, salt) for q in range(W)]
    out = comm.dcp_merge(*ins[r], algorithm=algorithm, scatter_heads=scatter)
    want = dcp_merge_reference(*zip(*ins))[0]
    if scatter:
        want = want[:, r * 4 // W:(r + 1) * 4 // W]
    return _close(out, want, dtype)


def _heads(comm, r, W, T, dtype, algorithm):
    xs = [payload(q, T * 2 * 32, dtype).view(T, 2, 32) for q in range(W)]
    return torch.equal(comm.all_gather_heads(xs[r], algorithm=algorithm), torch.cat(xs, dim=1))


# A collective for the mismatch calls: (comm, rank, elements) -> result; sizes are multiples of 4 * H
TRANSPORTS = {
    "oneshot": lambda c, r, n: c.all_reduce(payload(r, n), algorithm="oneshot"),
    "twoshot": lambda c, r, n: c.all_reduce(payload(r, n), algorithm="twoshot"),
    "all_gather": lambda c, r, n: c.all_gather(payload(r, n)),
    "reduce_scatter": lambda c, r, n: c.reduce_scatter(payload(r, n)),
    "fused": lambda c, r, n: c.all_reduce_add_rms_norm(payload(r, n).view(-1, H), torch.zeros(n // H, H),
                                                       torch.ones(H), algorithm="fused"),
    "dcp_merge": lambda c, r, n: c.dcp_merge(payload(r, n).view(-1, 4, H), torch.zeros(n // (4 * H), 4),
                                             algorithm="kernel"),
    "all_gather_heads": lambda c, r, n: c.all_gather_heads(payload(r, n).view(-1, 4, H), algorithm="kernel"),
    "nccl": lambda c, r, n: c.all_reduce(payload(r, n), algorithm="nccl"),
}
# LL calls that differ only in size or dtype are left out of the size mismatches: a
# 1-in-65,536 fingerprint collision is a documented gap (test_mismatch.py)
VALID = ["all_reduce", "all_gather", "reduce_scatter", "fused_norm", "dcp_merge", "all_gather_heads"]
SAME_INVALID = ["bad_dtype", "overlap", "over_capacity", "bad_shape", "bad_algorithm"]
ACROSS = ["mismatch_op", "mismatch_size", "one_rank_retry"]
WANT = {"bad_dtype": DTypeError, "overlap": AliasingError, "over_capacity": CapacityError, "bad_shape": ShapeError,
        "bad_algorithm": PlanError, "mismatch_op": CollectiveMismatch, "mismatch_size": CollectiveMismatch}


def _draw(rng, i, kind=None) -> dict:
    """Call i's kind (unless given) and parameters: the same draws on every rank (one stream per seed)."""
    kind = kind or rng.choice(VALID * 2 + SAME_INVALID + ACROSS)
    plan = dict(i=i, kind=kind, dtype=rng.choice(DTYPES), n=rng.choice([1, 7, 64, 333, CAP // 4]),
                T=rng.choice([1, 3, 8]))
    if kind == "all_reduce":
        plan["algorithm"] = rng.choice(["auto", "ll", "oneshot", "twoshot", "nccl"])
    elif kind == "fused_norm":
        plan["algorithm"] = rng.choice(["auto", "fused", "fused_ll", "nccl"])
    elif kind in ("dcp_merge", "all_gather_heads"):
        plan["algorithm"], plan["scatter"] = rng.choice(["auto", "kernel", "nccl"]), rng.random() < 0.5
    elif kind == "bad_algorithm":
        plan["algorithm"] = rng.choice(["ring", "NCCL", ""])
    elif kind == "mismatch_op":
        plan["ops"] = rng.sample(list(TRANSPORTS), 2)
    elif kind == "mismatch_size":
        plan["ops"] = [rng.choice(list(TRANSPORTS))] * 2
    return plan


def _run(comm, p, r, W) -> bool:
    """Make call `p` on rank r; True if it returned the reference result."""
    i, kind, dtype, n, T = p["i"], p["kind"], p["dtype"], p["n"], p["T"]
    x = payload(r, n, dtype, salt=i)
    if kind == "all_reduce":
        return torch.equal(comm.all_reduce(x, algorithm=p["algorithm"]), expected_sum(W, n, dtype, salt=i))
    if kind == "all_gather":
        return torch.equal(comm.all_gather(x), torch.cat([payload(q, n, dtype, salt=i) for q in range(W)]))
    if kind == "reduce_scatter":
        x = payload(r, n * W, dtype, salt=i)
        return torch.equal(comm.reduce_scatter(x), expected_sum(W, n * W, dtype, salt=i).chunk(W)[r])
    if kind == "fused_norm":
        return _norm(comm, r, W, T, dtype, p["algorithm"])
    if kind == "dcp_merge":
        return _dcp(comm, r, W, T, dtype, p["algorithm"], p["scatter"], i)
    if kind == "all_gather_heads":
        return _heads(comm, r, W, T, dtype, p["algorithm"])
    if kind == "bad_dtype":
        comm.all_reduce(x.int())
    elif kind == "overlap":
        buf = torch.zeros(2 * n + 1, dtype=dtype)
        comm.all_reduce(buf[: n + 1], buf[n: 2 * n + 1])
    elif kind == "over_capacity":
        comm.all_reduce(payload(r, CAP // 2 + 1, dtype), algorithm="oneshot")
    elif kind == "bad_shape":
        comm.all_gather(x, torch.empty(n, dtype=dtype))
    elif kind == "bad_algorithm":
        comm.all_reduce(x, algorithm=p["algorithm"])
    elif kind == "one_rank_retry":
        if r == 0:
            try:
                comm.all_reduce(x.int(), algorithm="oneshot")
            except DTypeError:
                pass  # rank-local: nothing ran here, the peers wait for the corrected call
        return torch.equal(comm.all_reduce(x, algorithm="oneshot"), expected_sum(W, n, dtype, salt=i))
    else:  # mismatch_op: two different collectives; mismatch_size: one collective, rank 1's twice as big
        TRANSPORTS[p["ops"][r % 2]](comm, r, 4 * H * (2 if kind == "mismatch_size" and r == 1 else 1))
    return False


def _mix(world, seed):
    from sparkinfer.comm import Communicator

    rng = random.Random(seed)  # same stream on every rank
    make = lambda: Communicator(capacity_bytes=CAP, timeout_s=DEADLINE_S)  # noqa: E731
    comm, W, r = make(), world.world_size, world.rank
    log = []
    forced = dict(zip(rng.sample(range(CALLS), len(ACROSS)), ACROSS))  # each across-rank kind at least once
    for i in range(CALLS):
        plan = _draw(rng, i, forced.get(i))
        t0 = time.monotonic()
        try:
            res = "ok" if _run(comm, plan, r, W) else "wrong result"
        except SparkInferError as e:
            res = "ok" if type(e) is WANT.get(plan["kind"]) else f"{type(e).__name__}: {e}"
            if isinstance(e, CollectiveMismatch):
                res = res if e.peer == 1 - r else f"names rank {e.peer}, not its peer"
                comm.close()  # poisoned: close it on every rank and create a new one
                comm = make()
        took = time.monotonic() - t0
        what = {k: str(v) for k, v in plan.items() if k not in ("i", "kind")}
        log.append((i, plan["kind"], what, res, "in time" if took < DEADLINE_S + SLACK_S else f"took {took:.1f} s"))
    comm.close()
    return log, os.getpid(), shm_files(os.getpid())


def test_random_mix_of_valid_and_invalid_calls(tmp_path, monkeypatch):
    """Every call: the expected outcome on every rank, in time; the same log on both
    ranks; no /dev/shm name of either rank and no sparkinfer_* temp entry (the
    launch runs with its own temp directory, so another process's files do not count)."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = run_ranks(_mix, 2, backend="cpu", args=(SEED,), timeout_s=240)
    for r, (log, pid, left) in enumerate(out):
        bad = [e for e in log if e[3] != "ok" or e[4] != "in time"]
        assert bad == [], (SEED, r, bad)
        assert left == [] and shm_files(pid) == [], (SEED, r, left)
    assert [e[:4] for e in out[0][0]] == [e[:4] for e in out[1][0]], SEED
    assert [f for f in os.listdir(tmp_path) if f.startswith("sparkinfer")] == [], SEED
    kinds = {e[1] for e in out[0][0]}
    assert len(kinds) >= 8, (SEED, kinds)  # a mix, not a few kinds over and over
