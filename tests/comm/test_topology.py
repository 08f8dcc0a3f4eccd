"""Pure policy: algorithm choice and launch shapes as tables."""

import pytest

from sparkinfer.comm import TopologyCaps, grid_config, select_algorithm
from sparkinfer.comm.channel import MAX_BLOCKS, ChannelLayout

H200x2 = TopologyCaps(world_size=2, peer_access=True, link="nvlink", num_sms=132, capacity=64 << 20)


@pytest.mark.parametrize(
    "caps,nbytes,algo",
    [
        (H200x2, 2 << 10, "ll"),
        (H200x2, (2 << 10) + 2, "oneshot"),
        (H200x2, 256 << 10, "ll"),
        (H200x2, (256 << 10) + 4, "oneshot"),
        (H200x2, (4 << 20) + 4, "twoshot"),
        (H200x2, 32 << 20, "twoshot"),
        (H200x2, (64 << 20) + 2, "nccl"),
        (TopologyCaps(8, True, "nvlink", 132, 64 << 20), 512 << 10, "twoshot"),
        (TopologyCaps(16, True, "pcie", 132, 64 << 20), 64 << 10, "ll"),
        (TopologyCaps(4, False, "none", 132, 64 << 20), 2 << 10, "nccl"),
        (TopologyCaps(1, True, "nvlink", 132, 64 << 20), 2 << 10, "nccl"),
    ],
    ids=["2r-2KiB", "2r-2KiB-odd", "2r-256KiB", "2r-256KiB+", "2r-4MiB+", "2r-32MiB", "2r-over-cap", "8r-512KiB",
         "16r-64KiB", "no-peer", "1r"],
)
def test_select_algorithm(caps, nbytes, algo):
    assert select_algorithm(caps, nbytes) == algo


@pytest.mark.parametrize("world", list(range(2, 17)))
@pytest.mark.parametrize("nbytes", [2, 1 << 20, 1 << 30])
def test_grid_config_is_co_resident_for_any_world_size(world, nbytes):
    caps = TopologyCaps(world, True, "nvlink", 132, 64 << 20)
    cfg = grid_config(caps, nbytes)
    assert 1 <= cfg.grid <= min(caps.num_sms, MAX_BLOCKS)


def test_interpreter_launches_are_small():
    caps = TopologyCaps(2, True, "host", 2, 1 << 20, interpret=True)
    assert grid_config(caps, 1 << 20).grid <= 2


@pytest.mark.parametrize("world", [2, 3, 8, 16])
def test_layout_is_aligned_and_grows_with_world(world):
    lay = ChannelLayout(world, 1000)
    assert lay.lane_bytes == 4096 and lay.stage_off % 4096 == 0
    assert lay.ll_off == lay.stage_off + 2 * (world + 1) * 4096  # staging: 2 slots of W lanes + gather
    assert lay.ll_lane_bytes == 4096  # LL words: 2 x 1000 B, page-rounded
    assert lay.nbytes == lay.ll_off + 2 * world * 4096
