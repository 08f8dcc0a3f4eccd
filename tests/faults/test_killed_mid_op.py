"""A rank process killed in the middle of an eager collective, while its peer is
inside the same op: the survivor raises CollectiveTimeout naming the dead rank
within the deadline, close() then raises TeardownError (a peer died), and
neither process leaves a name in /dev/shm (host slabs are unlinked at setup, so
not even SIGKILL, which runs no cleanup, leaves one).

The victim dies inside its own kernel: its interpreter clock (the host callable
behind protocol.now_ns, read at each block's start and while a wait is pending)
kills the process at its second reading, so the victim has begun the op (its
first block signalled its peers) and the survivor, which entered first, is
waiting on it. Interpreted blocks run one after another, so this is always
part-way through the launch."""

import os
import signal
import time

import pytest
import torch

from sparkinfer.comm.topology import GridConfig
from tests.faults._util import CAP, close_outcome, payload, shm_files, spawn_ranks

DEADLINE_S = 1.0
SLACK_S = 3.0  # 2 busy cores: a rank may be descheduled for a while past its deadline
VICTIM = 1
TWO_BLOCKS = GridConfig(grid=2, block=256, num_warps=1)


def _twoshot(comm, r):
    from sparkinfer.comm.all_reduce.launch import all_reduce

    return all_reduce(comm.context, payload(r, 1024), algorithm="twoshot", config=TWO_BLOCKS)


# Each op runs two blocks (TWO_BLOCKS; the fused norm gives each of its two rows one),
# interpreted one after the other, so the victim's clock is read at least twice inside
# the launch. A flag-synchronized op of two phases and an LL op: the stalled-peer tests
# (test_late_peer.py) cover every transport, and to a waiting peer a dead rank and a
# stalled one look alike.
OPS = {
    "all_reduce_twoshot": _twoshot,
    "fused_ll": lambda c, r: c.all_reduce_add_rms_norm(payload(r, 2 * 64).view(2, 64), torch.zeros(2, 64),
                                                       torch.ones(64), algorithm="fused_ll"),
}


def _die_at_second_clock_reading(how: str) -> None:
    from sparkinfer.comm import protocol

    clock, readings = protocol._HOST_NOW.value, [0]

    def dying_clock():
        readings[0] += 1
        if readings[0] >= 2:
            if how == "SIGKILL":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(9)
        return clock()

    protocol._HOST_NOW.value = dying_clock


def _killed_mid_op(world, op, how, pid_dir):
    from sparkinfer.comm import Communicator
    from sparkinfer.errors import CollectiveTimeout

    with open(os.path.join(pid_dir, str(world.rank)), "w") as f:
        f.write(str(os.getpid()))
    warm = Communicator(capacity_bytes=CAP, timeout_s=60)
    OPS[op](warm, world.rank)  # both ranks past their first call's costs, which may exceed the short deadline
    warm.close()
    comm = Communicator(capacity_bytes=CAP, timeout_s=DEADLINE_S)
    if world.rank == VICTIM:
        time.sleep(0.3)  # the survivor is inside the op, waiting
        _die_at_second_clock_reading(how)
        OPS[op](comm, world.rank)
        return "the victim finished the op alive"  # the test fails: it was not killed inside the op
    t0 = time.monotonic()
    try:
        OPS[op](comm, world.rank)
        first = ("returned",)
    except CollectiveTimeout as e:
        first = ("CollectiveTimeout", e.peer, f"waiting for rank {VICTIM}" in str(e))
    except Exception as e:  # noqa: BLE001 - reported, so the test names the wrong type
        first = (f"{type(e).__name__}: {e}",)
    return first, time.monotonic() - t0, close_outcome(comm), shm_files(os.getpid())


CASES = [("all_reduce_twoshot", "os._exit"), ("fused_ll", "SIGKILL")]


@pytest.mark.parametrize("op,how", CASES, ids=[f"{o}-{h}" for o, h in CASES])
def test_rank_killed_inside_an_eager_op_is_named_by_the_survivor(op, how, tmp_path):
    out = spawn_ranks(_killed_mid_op, 2, args=(op, how, str(tmp_path)), timeout_s=90)
    assert VICTIM not in out, out.get(VICTIM)
    status, res = out[1 - VICTIM]
    assert status == "ok", res
    first, took, closed, left = res
    assert first == ("CollectiveTimeout", VICTIM, True), first
    assert took < DEADLINE_S + SLACK_S, took
    assert closed.startswith("TeardownError:") and "a peer died, stalled or left" in closed, closed
    assert left == []
    victim_pid = int((tmp_path / str(VICTIM)).read_text())
    assert shm_files(victim_pid) == [], "the killed rank left its slab in /dev/shm"
