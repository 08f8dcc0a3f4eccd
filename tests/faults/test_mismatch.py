"""Mismatched calls raise CollectiveMismatch on every rank, and the message never
prints the same flag twice as "observed" and "expected"."""

import re

from sparkinfer.errors import CollectiveError
from sparkinfer.runtime import run_ranks
from tests.faults._util import CAP, payload

SIZES = [(64, 128), (128, 64), (64, 96), (96, 64)]  # fp32 elements on (rank 0, rank 1): both flag orders


def _ll_sizes(world):
    from sparkinfer.comm import Communicator

    got = []
    for sizes in SIZES:
        comm = Communicator(capacity_bytes=CAP, timeout_s=10)
        try:
            comm.all_reduce(payload(world.rank, sizes[world.rank]), algorithm="ll")
            got.append("returned")
        except CollectiveError as e:
            got.append((type(e).__name__, str(e)))
        comm.close()
    return got


def test_ll_size_mismatch_message_never_prints_identical_flags():
    for r, results in enumerate(run_ranks(_ll_sizes, 2, backend="cpu", timeout_s=180)):
        for sizes, res in zip(SIZES, results):
            assert res != "returned", (r, sizes)
            kind, msg = res
            assert kind == "CollectiveMismatch", (r, sizes, msg)
            m = re.search(r"flag (0x[0-9a-f]+), expected (0x[0-9a-f]+)", msg)
            assert m is None or m.group(1) != m.group(2), (r, sizes, msg)


def _cross_transport(world):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=10)
    x = payload(world.rank, 64)
    try:
        if world.rank == 0:
            comm.all_reduce(x, algorithm="ll")  # LL words
        else:
            comm.all_gather(x)  # staging slots and flags
        res = "returned"
    except CollectiveError as e:
        res = (type(e).__name__, e.peer)
    comm.close()
    return res


def test_ll_against_a_flag_synchronized_op_is_a_mismatch_not_a_timeout():
    assert run_ranks(_cross_transport, 2, backend="cpu", timeout_s=120) == [("CollectiveMismatch", 1),
                                                                            ("CollectiveMismatch", 0)]
