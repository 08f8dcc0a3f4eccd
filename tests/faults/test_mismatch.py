"""Mismatched collectives raise a typed error on every rank within the deadline,
never a hang or a silent wrong answer: every pair of different transports (the
op or the algorithm differs), and every transport with a different size or
dtype on one rank. One launch runs a whole table of cases; after each error the
communicator is poisoned, so each case gets a fresh one. A mismatch message never
prints the same flag twice as "observed" and "expected".

Every case is detected as CollectiveMismatch, none waits out the deadline: the
flags of every flag-synchronized kernel carry a 31-bit fingerprint of (op, sizes,
dtype, launch shape); LL words carry 16 bits of it and an LL kernel also looks
for a peer's staging flag at its sequence number; the torch.distributed fallback
first runs a handshake kernel fingerprinting the public op (so all_gather_heads
against dcp_merge, or the fused norm against all_reduce, over the same
torch.distributed call underneath, is a mismatch too). Not detectable: two LL calls
(all-reduce or fused norm) that differ only in size or dtype and whose
fingerprints agree in those 16 bits (1 pair in 65,536): their words pass for each
other's, so the shorter side may return a wrong sum and the longer one time out.
A wider fingerprint would cost each LL word payload bits; no case here collides."""

import itertools
import re
import time

import pytest
import torch

from sparkinfer.errors import CollectiveError
from sparkinfer.runtime import run_ranks
from tests.faults._util import CAP, expected_sum, payload

DEADLINE_S = 2.0
SLACK_S = 3.0  # 2 busy cores: a rank may be descheduled for a while past its deadline
H, DH = 32, 4  # fused norm hidden size; dcp heads (head dim H)


def _rows(rank, n, dtype):
    return payload(rank, n, dtype).view(-1, H)


def _heads(rank, n, dtype):
    """[T, DH, H]: dcp_merge's o and all_gather_heads' x have this one shape, so their
    torch.distributed paths make the same first all_gather (the handshake tells them apart)."""
    T = n // (DH * H) or 1
    return payload(rank, T * DH * H, dtype).view(T, DH, H)


def _dcp(comm, rank, n, dtype, algorithm):
    o = _heads(rank, n, dtype)
    lse = payload(rank, o.shape[0] * DH).view(-1, DH)
    return comm.dcp_merge(o, lse, algorithm=algorithm)


def _norm(c, r, n, dt, algorithm):
    return c.all_reduce_add_rms_norm(_rows(r, n, dt), torch.zeros(n // H, H, dtype=dt), torch.ones(H),
                                     algorithm=algorithm)


# transport -> call(comm, rank, elements, dtype); sizes are multiples of DH * H = 128 elements
TRANSPORTS = {
    "ll": lambda c, r, n, dt: c.all_reduce(payload(r, n, dt), algorithm="ll"),
    "oneshot": lambda c, r, n, dt: c.all_reduce(payload(r, n, dt), algorithm="oneshot"),
    "twoshot": lambda c, r, n, dt: c.all_reduce(payload(r, n, dt), algorithm="twoshot"),
    # x's shape is fused_nccl's: both make the same torch.distributed all_reduce underneath
    "nccl": lambda c, r, n, dt: c.all_reduce(_rows(r, n, dt), algorithm="nccl"),
    "all_gather": lambda c, r, n, dt: c.all_gather(payload(r, n, dt)),
    "reduce_scatter": lambda c, r, n, dt: c.reduce_scatter(payload(r, n, dt)),
    "fused": lambda c, r, n, dt: _norm(c, r, n, dt, "fused"),
    "fused_ll": lambda c, r, n, dt: _norm(c, r, n, dt, "fused_ll"),
    "fused_nccl": lambda c, r, n, dt: _norm(c, r, n, dt, "nccl"),
    "dcp_merge": lambda c, r, n, dt: _dcp(c, r, n, dt, "kernel"),
    "dcp_nccl": lambda c, r, n, dt: _dcp(c, r, n, dt, "nccl"),
    "heads": lambda c, r, n, dt: c.all_gather_heads(_heads(r, n, dt), algorithm="kernel"),
    "heads_nccl": lambda c, r, n, dt: c.all_gather_heads(_heads(r, n, dt), algorithm="nccl"),
}
N = 128

# case id -> ((transport, elements, dtype) of rank 0, that of rank 1)
CASES = {"op": {f"{a}-vs-{b}": ((a, N, torch.float32), (b, N, torch.float32))
                for a, b in itertools.combinations(TRANSPORTS, 2)},
         "size": {f"{t}-{a}-vs-{b}": ((t, a, torch.float32), (t, b, torch.float32))
                  for t in TRANSPORTS for a, b in ((N, 2 * N), (2 * N, N))},  # both flag orders
         "dtype": {t: ((t, N, torch.float32), (t, N, torch.bfloat16)) for t in TRANSPORTS}}


def _run_cases(world, kind):
    from sparkinfer.comm import Communicator

    got = {}
    for cid, calls in CASES[kind].items():
        name, n, dtype = calls[world.rank]
        comm = Communicator(capacity_bytes=CAP, timeout_s=DEADLINE_S)
        t0 = time.monotonic()
        try:
            TRANSPORTS[name](comm, world.rank, n, dtype)
            res = ("returned",)
        except CollectiveError as e:
            res = (type(e).__name__, e.peer, str(e))
        got[cid] = res + (time.monotonic() - t0,)
        comm.close()
    comm = Communicator(capacity_bytes=CAP, timeout_s=DEADLINE_S)  # the process is healthy afterwards
    healthy = torch.equal(comm.all_reduce(payload(world.rank, N)), expected_sum(world.world_size, N))
    comm.close()
    return got, healthy


@pytest.mark.parametrize("kind", list(CASES))
def test_mismatch_raises_on_every_rank_within_the_deadline(kind):
    out = run_ranks(_run_cases, 2, backend="cpu", args=(kind,), timeout_s=300)
    bad = []
    for r, (got, healthy) in enumerate(out):
        assert healthy, r
        for cid, res in got.items():
            if res[0] != "CollectiveMismatch" or res[1] != 1 - r:
                bad.append((r, cid, res))
            elif res[-1] > DEADLINE_S + SLACK_S:
                bad.append((r, cid, f"took {res[-1]:.1f} s"))
            elif (m := re.search(r"flag (0x[0-9a-f]+), expected (0x[0-9a-f]+)", res[2])) and m[1] == m[2]:
                bad.append((r, cid, f"identical flags: {res[2]}"))
    assert bad == [], "\n".join(map(str, bad))
