"""The one kernel-or-NCCL decision (`dispatch.use_kernel`) as a case table, and
the launch shapes an op accepts (`topology.check_grid_config`). Pure: an
OpContext with stand-in callables, no ranks, no channels."""

import dataclasses

import pytest

from sparkinfer.comm import GridConfig, OpContext, TopologyCaps, grid_config
from sparkinfer.comm.channel import ChannelLayout
from sparkinfer.comm.dispatch import use_kernel
from sparkinfer.comm.topology import check_grid_config
from sparkinfer.errors import CapacityError, LifecycleError, PlanError

CAP = 16 << 10
H200x2 = TopologyCaps(world_size=2, peer_access=True, link="nvlink", num_sms=132, capacity=CAP)


def _ctx(caps=H200x2, capturing=False):
    def no_channel():
        raise AssertionError("the decision must not resolve a channel")

    return OpContext(caps=caps, layout=ChannelLayout(caps.world_size, caps.capacity), device="cpu", rank=0,
                     timeout_ns=1, channel=no_channel, capturing=lambda: capturing)


ONE_RANK = dataclasses.replace(H200x2, world_size=1)
NO_PEERS = dataclasses.replace(H200x2, peer_access=False, link="none")
# id, caps, op, nbytes, algorithm, capturing, expected: "kernel" | "nccl"
DECISIONS = [
    ("auto-within-capacity", H200x2, "all_reduce", CAP, "auto", False, "kernel"),
    ("auto-above-capacity-eager", H200x2, "all_reduce", CAP + 1, "auto", False, "nccl"),
    ("nccl-asked", H200x2, "all_reduce_add_rms_norm", 64, "nccl", False, "nccl"),
    ("nccl-asked-above-capacity-in-capture", H200x2, "dcp_merge", CAP + 1, "nccl", True, "nccl"),
    ("no-peers-auto", NO_PEERS, "all_gather", 64, "auto", False, "nccl"),
    ("no-peers-named-kernel", NO_PEERS, "all_reduce", 64, "oneshot", False, "nccl"),
    ("no-peers-above-capacity-in-capture", NO_PEERS, "all_reduce", CAP + 1, "auto", True, "nccl"),
    ("one-rank-collective", ONE_RANK, "reduce_scatter", 64, "auto", False, "nccl"),
    ("one-rank-all-reduce-named", ONE_RANK, "all_reduce", 64, "twoshot", False, "kernel"),
    ("one-rank-fused-norm", ONE_RANK, "all_reduce_add_rms_norm", 64, "auto", False, "kernel"),
    ("one-rank-dcp", ONE_RANK, "dcp_merge", 64, "auto", True, "kernel"),
    ("named-kernel-within-capacity", H200x2, "dcp_merge", CAP, "kernel", True, "kernel"),
]


@pytest.mark.parametrize("caps,op,nbytes,algorithm,capturing,expected", [c[1:] for c in DECISIONS],
                         ids=[c[0] for c in DECISIONS])
def test_use_kernel_decides_every_op_the_same_way(caps, op, nbytes, algorithm, capturing, expected):
    assert use_kernel(_ctx(caps, capturing), op, nbytes, algorithm) == (expected == "kernel")


@pytest.mark.parametrize(
    "op,algorithm,capturing,match",
    [
        ("all_reduce", "oneshot", False,
         r"all_reduce stages 16385 B but the staging capacity is 16384 B \(algorithm='oneshot'\); create the "
         r"Communicator with a larger capacity_bytes, or pass algorithm='auto' to use NCCL above it"),
        ("all_reduce_add_rms_norm", "auto", True,
         r"all_reduce_add_rms_norm stages 16385 B but the staging capacity is 16384 B \(during graph capture\); "
         r"create the Communicator with a larger capacity_bytes$"),
        ("dcp_merge", "kernel", True, r"\(during graph capture\)"),
    ],
    ids=["named-kernel-eager", "auto-in-capture", "named-kernel-in-capture"],
)
def test_use_kernel_refuses_above_capacity_where_it_cannot_fall_back(op, algorithm, capturing, match):
    with pytest.raises(CapacityError, match=match):
        use_kernel(_ctx(capturing=capturing), op, CAP + 1, algorithm)


def test_nccl_path_without_a_torch_group_raises():
    with pytest.raises(LifecycleError, match="built on a PeerGroup without torch.distributed; no NCCL path"):
        _ctx().torch_group()


@pytest.mark.parametrize(
    "cfg",
    [GridConfig(grid=0, block=256, num_warps=1), GridConfig(grid=133, block=2048, num_warps=8),
     GridConfig(grid=4, block=96, num_warps=8), GridConfig(grid=4, block=2048, num_warps=3),
     GridConfig(grid=4, block=2048, num_warps=8, pipe=3)],
    ids=["no-blocks", "more-blocks-than-sms", "block-not-pow2", "odd-warps", "pipe-3"],
)
def test_check_grid_config_rejects_shapes_the_kernels_cannot_run(cfg):
    with pytest.raises(PlanError, match=r"is not a launch shape for 132 co-resident blocks \(grid 1..132"):
        check_grid_config(cfg, H200x2)


def test_check_grid_config_rejects_other_types_and_takes_the_defaults():
    with pytest.raises(PlanError, match="config must be a topology.GridConfig .* got tuple"):
        check_grid_config((2, 256, 1), H200x2)
    interp = dataclasses.replace(H200x2, link="host", num_sms=2, interpret=True)
    with pytest.raises(PlanError, match="for 2 co-resident blocks"):
        check_grid_config(GridConfig(grid=3, block=256, num_warps=1), interp)
    for nbytes in (1, 4 << 10, 1 << 20, 64 << 20):
        check_grid_config(grid_config(H200x2, nbytes), H200x2)
        check_grid_config(grid_config(interp, nbytes), interp)
