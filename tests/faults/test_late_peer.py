"""A peer that arrives after rank 0 timed out and aborted the group learns of the
abort at that call (the interpreter is synchronous; on the GPU at its next host
check), on every transport; every later call says the communicator is unusable
and what to do."""


import torch

from sparkinfer.runtime import run_ranks
from tests.faults._util import CAP, assert_late_peer_outcomes, late_peer_outcomes, payload

OPS = {
    "all_reduce_ll": lambda c, x: c.all_reduce(x, algorithm="ll"),
    "all_reduce_oneshot": lambda c, x: c.all_reduce(x, algorithm="oneshot"),
    "all_reduce_twoshot": lambda c, x: c.all_reduce(x, algorithm="twoshot"),
    "all_gather": lambda c, x: c.all_gather(x),
    "reduce_scatter": lambda c, x: c.reduce_scatter(x),
    "all_reduce_add_rms_norm": lambda c, x: c.all_reduce_add_rms_norm(x.view(2, 32), torch.zeros(2, 32),
                                                                       torch.ones(32)),
}
TIMEOUT_S, LATE_S = 1.0, 2.5


def _late(world):
    from sparkinfer.comm import Communicator

    return late_peer_outcomes(world, OPS, lambda: Communicator(capacity_bytes=CAP, timeout_s=TIMEOUT_S),
                              payload(world.rank, 64), LATE_S)


def test_a_late_peer_learns_of_the_abort_on_every_transport():
    r0, r1 = run_ranks(_late, 2, backend="cpu", timeout_s=240)
    assert_late_peer_outcomes(r0, r1, OPS)
