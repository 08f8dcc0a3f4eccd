"""Non-finite inputs to the comm ops: a NaN lse in dcp_merge gives NaN rows in
the kernel, the NCCL composition and the reference alike (never a dropped shard
or zeros); NaN payloads of all_reduce propagate on every path."""

import torch

from sparkinfer.runtime import run_ranks
from tests.faults._util import CAP

T, H, D = 3, 4, 32


def _inputs(rank: int, device="cpu"):
    g = torch.Generator().manual_seed(100 + rank)
    o = torch.randn(T, H, D, generator=g)
    lse = torch.randn(T, H, generator=g)
    if rank == 1:
        lse[1, 2] = float("nan")  # one row, one rank
        lse[2, 0] = float("-inf")  # an empty shard beside it stays ignored
    return o.to(device), lse.to(device)


def dcp_nan(world):
    """Run on every rank (CPU ranks here, cuda_shared in test_gpu_faults): the failures found."""
    from sparkinfer.comm import Communicator
    from sparkinfer.comm.dcp.reference import dcp_merge_reference

    comm = Communicator(capacity_bytes=CAP, timeout_s=60, device=world.device)
    o, lse = _inputs(world.rank, world.device)
    ref_o, ref_l = dcp_merge_reference(*zip(*[_inputs(r, world.device) for r in range(world.world_size)]))
    bad = []
    for algo in ("kernel", "nccl"):
        got_o, got_l = (t.cpu() for t in comm.dcp_merge(o, lse, return_lse=True, algorithm=algo))
        if not (got_o[1, 2].isnan().all() and got_l[1, 2].isnan()):
            bad.append((algo, "NaN row not NaN"))
        if not (torch.allclose(got_o, ref_o, equal_nan=True, atol=1e-5)
                and torch.allclose(got_l, ref_l, equal_nan=True, atol=1e-5)):
            bad.append((algo, "differs from the reference"))
    if not (ref_o[1, 2].isnan().all() and ref_l[1, 2].isnan()):
        bad.append(("reference", "NaN row not NaN"))
    comm.close()
    return bad


def test_dcp_merge_nan_lse_propagates_in_kernel_nccl_and_reference():
    assert run_ranks(dcp_nan, 2, backend="cpu", timeout_s=180) == [[], []]
