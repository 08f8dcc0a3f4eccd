"""Peer memory: host slabs are zeroed, mapped by peers, unmapped safely, and
handles are exchanged in group-rank order (also for a non-monotonic group)."""

import os

import pytest
import torch

from sparkinfer.comm.memory import HostSlabBackend, make_backend
from sparkinfer.errors import PeerMemoryError
from sparkinfer.runtime import run_ranks


def test_host_slab_zeroed_shared_and_sealed():
    be = HostSlabBackend()
    slab = be.allocate(1 << 16)
    mine = slab.keep[1]
    assert mine.numel() == 1 << 16 and int(mine.sum()) == 0
    peer = be.open(1, slab.handle, 1 << 16)
    mine[123] = 77
    assert peer.keep[1][123].item() == 77  # same physical memory, different mapping
    path = f"/dev/shm/{slab.handle.decode()}"
    be.seal(slab)
    assert not os.path.exists(path)  # nothing left behind if the process dies now
    be.close(peer)
    be.free(slab)
    assert peer.closed and slab.freed


def test_unmap_with_live_view_fails_and_can_be_retried():
    be = HostSlabBackend()
    slab = be.allocate(4096)
    view = slab.keep[1][:16]  # a tensor still pointing into the mapping
    with pytest.raises(PeerMemoryError, match=r"1 tensor view\(s\) of it are still alive"):
        be.free(slab)
    del view
    be.free(slab)
    assert slab.freed


def test_open_missing_handle_is_typed():
    with pytest.raises(PeerMemoryError, match="cannot map rank 3's slab"):
        HostSlabBackend().open(3, b"sparkinfer-does-not-exist", 4096)


def test_make_backend_rejects_unknown_devices():
    with pytest.raises(PeerMemoryError, match="no peer-memory backend for device meta"):
        make_backend(torch.device("meta"))


def _group_order(world):
    import torch.distributed as dist

    from sparkinfer.comm import Communicator

    order = [2, 0, 1]  # group rank g is global rank order[g]: not monotonic
    grp = dist.new_group(order, sort_ranks=False)
    comm = Communicator(grp, capacity_bytes=4096, timeout_s=10)
    g = comm.rank
    ch = comm.pool.get("eager")
    marker_off = ch.layout.stage_off  # first staging byte: written here only
    ch.slab.keep[1][marker_off] = 100 + g
    dist.barrier()
    seen = {r: int(m.keep[1][marker_off]) for r, m in ch.peers.items()}
    table = ch.table.tolist()
    ptr_ok = all(table[r] == m.ptr for r, m in ch.peers.items()) and table[g] == ch.slab.ptr
    gathered = comm.all_gather(torch.tensor([float(dist.get_rank())]))
    dist.barrier()
    comm.close()
    return g, seen, ptr_ok, gathered.tolist()


def test_non_monotonic_group_maps_handle_n_to_group_rank_n():
    out = run_ranks(_group_order, 3, backend="cpu", timeout_s=120)
    for global_rank, (g, seen, ptr_ok, gathered) in enumerate(out):
        assert g == [2, 0, 1].index(global_rank)
        assert seen == {r: 100 + r for r in range(3) if r != g}
        assert ptr_ok
        assert gathered == [2.0, 0.0, 1.0]  # group-rank order, not global order
