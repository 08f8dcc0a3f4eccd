"""Outputs that partially overlap inputs raise AliasingError on every op that
takes `out=`; exact in-place aliasing stays legal and exact, and the
communicator stays usable after the rejections."""

import torch

from sparkinfer.errors import AliasingError
from sparkinfer.runtime import run_ranks
from tests.faults._util import CAP, expect_raises, expected_sum, payload


def _overlaps(world):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=60)
    r, W = world.rank, world.world_size
    buf = torch.zeros(1100)
    buf[:1000] = payload(r, 1000)
    rows = torch.zeros(4 * 64 + 32)
    w = torch.ones(64)
    cases = [
        ("all_reduce-shifted", AliasingError, "out .* overlaps x .* by 3600 B",
         lambda: comm.all_reduce(buf[0:1000], buf[100:1100])),
        ("reduce_scatter-inside", AliasingError, "overlaps x",
         lambda: comm.reduce_scatter(buf[:1000], buf[:500])),
        ("all_gather-inside", AliasingError, "overlaps x",
         lambda: comm.all_gather(buf[:500], buf[:1000])),
        ("fused-out-shifted", AliasingError, "out .* overlaps x",
         lambda: comm.all_reduce_add_rms_norm(rows[:128].view(2, 64), torch.zeros(2, 64), w,
                                              out=rows[32:160].view(2, 64))),
        ("fused-residual_out-on-x", AliasingError, "residual_out .* overlaps x",
         lambda: comm.all_reduce_add_rms_norm(rows[:128].view(2, 64), torch.zeros(2, 64), w,
                                              residual_out=rows[:128].view(2, 64))),
    ]
    bad = expect_raises(cases)
    x = buf[:1000]
    comm.all_reduce(x, x)  # exactly in place: legal
    if not torch.equal(x, expected_sum(W, 1000)):
        bad.append(("in-place", "wrong sum"))
    comm.close()
    return bad


def test_partial_overlap_raises_and_in_place_stays_exact():
    assert run_ranks(_overlaps, 2, backend="cpu", timeout_s=180) == [[], []]
