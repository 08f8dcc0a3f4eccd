"""4- and 8-rank CPU runs of every collective (issue 6's CPU share): the same
kernels, protocol and policy code paths that serve 2..16 GPUs."""

import pytest
import torch

from sparkinfer.runtime import run_ranks
from tests.comm.test_collectives import expected_sum, payload


def _every_collective(world):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=4096, timeout_s=120)
    W, r = world.world_size, world.rank
    bad = []
    for algo in ("ll", "oneshot", "twoshot", "auto"):
        for n in (3, 2 * W * 9):
            out = comm.all_reduce(payload(r, n, torch.bfloat16, n), algorithm=algo)
            if not torch.equal(out, expected_sum(W, n, torch.bfloat16, n)):
                bad.append(("all_reduce", algo, n))
    m = 4 * W
    rs = comm.reduce_scatter(payload(r, m, torch.float32))
    if not torch.equal(rs, expected_sum(W, m, torch.float32)[r * 4:(r + 1) * 4]):
        bad.append(("reduce_scatter",))
    ag = comm.all_gather(payload(r, 5, torch.float16))
    if not torch.equal(ag, torch.cat([payload(q, 5, torch.float16) for q in range(W)])):
        bad.append(("all_gather",))
    comm.close()
    return bad


@pytest.mark.parametrize("world", [4, 8], ids=lambda w: f"{w}ranks")
def test_every_collective_on_many_ranks(world):
    assert run_ranks(_every_collective, world, backend="cpu", timeout_s=900) == [[]] * world
