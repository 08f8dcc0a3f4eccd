"""Ranks that disagree on the path of one call (sizes that straddle the staging
capacity: one rank in the kernel, the other on the torch.distributed fallback)
raise a typed error on every rank within the deadline instead of hanging; ranks
that agree keep the exact result."""

import pytest
import torch

from sparkinfer.errors import CollectiveError
from sparkinfer.runtime import run_ranks
from tests.faults._util import CAP, expected_sum, payload

N_IN = CAP // 4  # fp32 elements: exactly the capacity (kernel)
N_OUT = CAP // 4 + 16  # above it (fallback)


def _straddle(world, op):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=5)
    r = world.rank
    n = N_IN if r == 0 else N_OUT
    res = "returned"
    try:
        if op == "all_reduce":
            comm.all_reduce(payload(r, n))
        elif op == "all_reduce_oneshot_vs_fallback":
            comm.all_reduce(payload(r, n), algorithm="oneshot" if r == 0 else "auto")
        else:
            comm.all_gather(payload(r, n // 2))
    except CollectiveError as e:
        res = (type(e).__name__, e.peer, "now unusable" in str(e))
    comm.close()
    comm = Communicator(capacity_bytes=CAP, timeout_s=5)  # a fresh one: agreeing ranks are exact, on both paths
    ok = all(torch.equal(comm.all_reduce(payload(r, m)), expected_sum(world.world_size, m)) for m in (N_IN, N_OUT))
    comm.close()
    return res, ok


# op, the error every rank gets: against the flag-synchronized kernels a mismatch; against
# the LL kernel too (it sees the handshake's flag for its sequence number in its own slab)
CASES = [("all_reduce_oneshot_vs_fallback", "CollectiveMismatch"), ("all_gather", "CollectiveMismatch"),
         ("all_reduce", "CollectiveMismatch")]


@pytest.mark.parametrize("op,error", CASES, ids=[c[0] for c in CASES])
def test_sizes_straddling_the_capacity_raise_on_every_rank(op, error):
    out = run_ranks(_straddle, 2, backend="cpu", args=(op,), timeout_s=120)
    assert out == [((error, 1, True), True), ((error, 0, True), True)], out
