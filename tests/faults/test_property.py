"""A seeded random mix of valid and invalid calls, the same on every rank: each
call returns the exact reference result or raises the expected typed error on
every rank, host-side rejections leave the communicator usable, and nothing is
left in /dev/shm. The seed is printed by the assertion on failure."""

import os
import random

import torch

from sparkinfer.errors import AliasingError, CapacityError, DTypeError, ShapeError
from sparkinfer.runtime import run_ranks
from tests.faults._util import CAP, expected_sum, payload, shm_files

SEED = random.randrange(1 << 30)
CALLS = 10


def _mix(world, seed):
    from sparkinfer.comm import Communicator

    rng = random.Random(seed)  # same stream on every rank
    comm = Communicator(capacity_bytes=CAP, timeout_s=30)
    W, r = world.world_size, world.rank
    log = []
    for i in range(CALLS):
        kind = rng.choice(["all_reduce", "all_gather", "reduce_scatter", "bad_dtype", "overlap", "over_capacity",
                           "bad_shape"])
        n = rng.choice([1, 7, 64, 333, CAP // 4]) * (W if kind == "reduce_scatter" else 1)
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        x = payload(r, n, dtype, salt=i)
        try:
            if kind == "all_reduce":
                ok = torch.equal(comm.all_reduce(x, algorithm=rng.choice(["auto", "oneshot", "twoshot"])),
                                 expected_sum(W, n, dtype, salt=i))
            elif kind == "all_gather":
                ok = torch.equal(comm.all_gather(x), torch.cat([payload(q, n, dtype, salt=i) for q in range(W)]))
            elif kind == "reduce_scatter":
                ok = torch.equal(comm.reduce_scatter(x), expected_sum(W, n, dtype, salt=i).chunk(W)[r])
            elif kind == "bad_dtype":
                comm.all_reduce(x.int())
                ok = False
            elif kind == "overlap":
                buf = torch.zeros(2 * n + 1, dtype=dtype)
                comm.all_reduce(buf[: n + 1], buf[n : 2 * n + 1])
                ok = False
            elif kind == "over_capacity":
                comm.all_reduce(payload(r, CAP // 2 + 1, dtype), algorithm="oneshot")
                ok = False
            else:
                comm.all_gather(x, torch.empty(n, dtype=dtype))
                ok = W == 1
            log.append((kind, "ok" if ok else "wrong result"))
        except (DTypeError, AliasingError, CapacityError, ShapeError) as e:
            want = {"bad_dtype": DTypeError, "overlap": AliasingError, "over_capacity": CapacityError,
                    "bad_shape": ShapeError}.get(kind)
            log.append((kind, "ok" if type(e) is want else f"{type(e).__name__}: {e}"))
    comm.close()
    return log, shm_files(os.getpid())


def test_random_mix_of_valid_and_invalid_calls():
    out = run_ranks(_mix, 2, backend="cpu", args=(SEED,), timeout_s=240)
    for r, (log, left) in enumerate(out):
        assert all(res == "ok" for _, res in log), (SEED, r, log)
        assert left == [], (SEED, r, left)
    assert out[0][0] == out[1][0], SEED
