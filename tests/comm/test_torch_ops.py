"""The collectives as torch.library ops, called eagerly and through torch.compile."""

import torch

from sparkinfer.runtime import run_ranks


def _compiled(world):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=8192, timeout_s=10)
    W, r = world.world_size, world.rank

    def block(x):
        y = torch.ops.sparkinfer.all_reduce(x * 2, comm.id, "auto")
        s = torch.ops.sparkinfer.reduce_scatter(y, comm.id)
        return torch.ops.sparkinfer.all_gather(s + 1, comm.id)

    x = torch.arange(64, dtype=torch.float32) + r
    eager = block(x)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x)
    ref = W * sum(2 * (torch.arange(64, dtype=torch.float32) + q) for q in range(W)) + 1  # rs sums y again
    comm.close()
    return torch.equal(eager, ref), torch.equal(compiled, ref)


def test_ops_run_eagerly_and_under_torch_compile():
    assert run_ranks(_compiled, 2, backend="cpu", timeout_s=300) == [(True, True)] * 2
