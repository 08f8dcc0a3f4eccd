"""Host-side rejections are typed and say what to do: an unknown algorithm= of any
op raises PlanError (a SparkInferError), before anything runs and even for empty
tensors, and leaves the communicator usable. A rejection is rank-local: what the
other ranks see depends on what the rejecting rank does next (below)."""

import os
import time

import pytest
import torch

from sparkinfer.errors import PlanError, SparkInferError
from sparkinfer.runtime import LocalGroup, run_ranks
from tests.faults._util import CAP, expected_sum, payload

# op -> (call(comm, rows, algorithm), a kernel algorithm of that op: one rank has no torch.distributed path)
OPS = {
    "all_reduce": (lambda c, n, a: c.all_reduce(torch.ones(n), algorithm=a), "oneshot"),
    "all_reduce_add_rms_norm": (lambda c, n, a: c.all_reduce_add_rms_norm(torch.ones(n, 16), torch.ones(n, 16),
                                                                           torch.ones(16), algorithm=a), "fused"),
    "dcp_merge": (lambda c, n, a: c.dcp_merge(torch.ones(n, 2, 16), torch.zeros(n, 2), algorithm=a), "kernel"),
    "all_gather_heads": (lambda c, n, a: c.all_gather_heads(torch.ones(n, 2, 16), algorithm=a), "kernel"),
}


@pytest.fixture(scope="module")
def comm():
    from sparkinfer.comm import Communicator

    c = Communicator(LocalGroup(), device="cpu", capacity_bytes=CAP, timeout_s=5)
    yield c
    c.close()


@pytest.mark.parametrize("rows", [2, 0], ids=["data", "empty"])
@pytest.mark.parametrize("op", list(OPS))
def test_unknown_algorithm_is_a_typed_error(comm, op, rows):
    call, good = OPS[op]
    with pytest.raises(PlanError, match=r"algorithm must be .*got 'ring'; pass 'auto'") as ei:
        call(comm, rows, "ring")
    assert isinstance(ei.value, SparkInferError)
    call(comm, rows, good)  # usable: nothing ran, no sequence number was consumed



DEADLINE_S = 2.0  # "retry": rank 0's second call must reach rank 1 within it, on busy cores too
SLACK_S = 3.0  # 2 busy cores: a rank may be descheduled for a while past its deadline
THEN = ("nothing", "retry", "other")


def _outcome(fn, *args, **kwargs):
    """fn(*args, **kwargs) -> ((error type or "ok", peer or None), whether the message says
    a peer aborted the group, seconds)."""
    from sparkinfer.errors import CollectiveError

    t0 = time.monotonic()
    try:
        res, aborted = ("ok", fn(*args, **kwargs)), None
    except CollectiveError as e:
        res, aborted = (type(e).__name__, e.peer), "aborted the group" in str(e)
    except SparkInferError as e:
        res, aborted = (type(e).__name__, None), None
    return res, aborted, time.monotonic() - t0


def _await(path, seconds=60.0):
    """Wait until the peer created file `path` (a host-side signal, outside the communicator)."""
    t_end = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < t_end:
        time.sleep(0.02)


def _one_rank_rejects(world, marks):
    """For each of THEN, on a fresh communicator: rank 0 passes an int tensor (DTypeError
    on rank 0 only), then "nothing" (it calls again only once rank 1 has given up),
    "retry" (at once, the same call corrected) or "other" (at once, a different
    collective). Rank 1 makes the call once."""
    from sparkinfer.comm import Communicator

    r, x, want = world.rank, payload(world.rank, 64), expected_sum(world.world_size, 64)

    def reduce(comm):
        return torch.equal(comm.all_reduce(x, algorithm="oneshot"), want)

    def gather(comm):
        return comm.all_gather(x).shape == (2 * x.numel(),)

    got = {}
    for then in THEN:
        comm = Communicator(capacity_bytes=CAP, timeout_s=DEADLINE_S)
        gave_up, done = os.path.join(marks, f"{then}-gave-up"), os.path.join(marks, f"{then}-done")
        if r == 0:
            seen = [_outcome(comm.all_reduce, x.int(), algorithm="oneshot")]
            if then == "nothing":
                _await(gave_up)  # rank 1 timed out and aborted the group
            seen.append(_outcome(gather, comm) if then == "other" else _outcome(reduce, comm))
            open(done, "w").close()
        else:
            seen = [_outcome(reduce, comm)]
            open(gave_up, "w").close()
            _await(done)  # close() is bounded by 2 deadlines: both ranks reach it together
        comm.close()
        got[then] = seen
    return got


@pytest.fixture(scope="module")
def one_rank_rejects(tmp_path_factory):
    return run_ranks(_one_rank_rejects, 2, backend="cpu", args=(str(tmp_path_factory.mktemp("marks")),),
                     timeout_s=120)


@pytest.mark.parametrize("then", THEN)
def test_a_host_side_rejection_on_one_rank(one_rank_rejects, then):
    """The rejecting rank raises the typed error and launched nothing (its communicator
    stays usable). Its peers wait in the call: if it makes the same call, corrected,
    within the deadline, that call completes on every rank; if it makes none, they raise
    CollectiveTimeout naming it within the deadline and it learns of the abort at its
    next call; if it makes another collective, every rank raises CollectiveMismatch."""
    r0, r1 = (o[then] for o in one_rank_rejects)
    assert r0[0][0] == ("DTypeError", None), r0
    want = {"nothing": ((("CollectiveTimeout", 1), True), (("CollectiveTimeout", 0), False)),
            "retry": ((("ok", True), None), (("ok", True), None)),
            "other": ((("CollectiveMismatch", 1), False), (("CollectiveMismatch", 0), False))}[then]
    assert (r0[1][:2], r1[0][:2]) == want, (r0, r1)
    assert r1[0][-1] < DEADLINE_S + SLACK_S, r1
