"""A rank that stalls (alive, not progressing) during Communicator setup or
before close(): the others raise SetupError / TeardownError naming it within
two communicator deadlines (Communicator.EXCHANGE_DEADLINES), not gloo's own timeout (30 min), and leave
nothing in /dev/shm; the stalled rank, when it wakes, raises the same error."""

import os
import time

from sparkinfer.comm.memory import HostSlabBackend
from tests.faults._util import CAP, close_outcome, shm_files, spawn_ranks

DEADLINE_S = 2.0
BOUND_S = 2 * DEADLINE_S  # Communicator.EXCHANGE_DEADLINES
STALL_S = 8.0  # well past the bound
SLACK_S = 3.0  # process scheduling on 2 busy cores, and the poll interval (50 ms)


class _StallOnAllocate(HostSlabBackend):
    """The victim's backend: setup stalls where it allocates its slab, then goes on."""

    def allocate(self, nbytes):
        time.sleep(STALL_S)
        return super().allocate(nbytes)


def _stall_in_setup(world, victim):
    from sparkinfer.comm import Communicator
    from sparkinfer.errors import SetupError

    backend = _StallOnAllocate() if world.rank == victim else None
    t0 = time.monotonic()
    try:
        Communicator(capacity_bytes=CAP, timeout_s=DEADLINE_S, backend=backend)
        res = "constructed"
    except SetupError as e:
        res = "SetupError: " + str(e)
    except Exception as e:  # noqa: BLE001 - reported, so the test names the wrong type
        res = f"{type(e).__name__}: {e}"
    return res, time.monotonic() - t0, shm_files(os.getpid())


def test_rank_stalling_in_setup_gives_setup_error_within_the_deadline():
    out = spawn_ranks(_stall_in_setup, 3, args=(2,), timeout_s=90)
    for r in (0, 1):
        status, (msg, elapsed, left) = out[r]
        assert status == "ok", msg
        assert msg.startswith("SetupError:") and "rank(s) [2] did not reach" in msg, msg
        assert elapsed < BOUND_S + SLACK_S, (r, elapsed)
        assert left == [], left
    status, (msg, elapsed, left) = out[2]
    assert status == "ok", msg
    assert msg.startswith("SetupError:") and "after its peers gave up waiting for it" in msg, msg
    assert left == [], left


def _stall_before_close(world, victim):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=DEADLINE_S)
    if world.rank == victim:
        time.sleep(STALL_S)
    t0 = time.monotonic()
    res = close_outcome(comm)
    return res, time.monotonic() - t0, comm.pool.closed, shm_files(os.getpid())


def test_rank_stalling_before_close_gives_teardown_error_within_the_deadline():
    out = spawn_ranks(_stall_before_close, 2, args=(1,), timeout_s=90)
    status, (msg, elapsed, closed, left) = out[0]
    assert status == "ok", msg
    assert msg.startswith("TeardownError:") and "rank(s) [1] did not reach" in msg and "pool is closed" in msg, msg
    assert elapsed < BOUND_S + SLACK_S, elapsed
    assert closed and left == []
    status, (msg, elapsed, closed, left) = out[1]
    assert status == "ok", msg
    assert msg.startswith("TeardownError:") and "after its peers gave up" in msg, msg
    assert closed and left == []
