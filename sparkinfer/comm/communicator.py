"""Communicator: the public face of sparkinfer.comm.

    comm = Communicator(group, capacity_bytes=8 << 20)
    y = comm.all_reduce(x)                       # eager
    with comm.pool.capture(stream, "target"):     # graph capture
        with torch.cuda.graph(g, stream=stream):
            y = comm.all_reduce(x)
    comm.close()                                  # collective

Ranks that can map each other run the Triton kernels; other groups (several
nodes, GPUs without peer access) get the same API served by torch.distributed.
The ops see only `comm.context` (an OpContext), never the Communicator.
"""

from __future__ import annotations

from sparkinfer import envs
from sparkinfer.comm import torch_ops
from sparkinfer.comm.context import OpContext
from sparkinfer.comm.dispatch import check_errors
from sparkinfer.comm.pool import ChannelPool
from sparkinfer.comm.topology import TopologyCaps
from sparkinfer.errors import SetupError

__all__ = ["Communicator", "detect_caps"]


def detect_caps(group, device, capacity: int) -> TopologyCaps:
    """Gather topology facts (collective: exchanges device indices)."""
    import torch

    interpret = envs.triton_interpret()
    if device.type == "cpu":
        return TopologyCaps(group.size, True, "host", 2, capacity, interpret=True)
    idx = group.all_gather(device.index)
    peer = all(
        i == j or torch.cuda.can_device_access_peer(i, j) for i in idx for j in idx if i == device.index
    )
    peer = all(group.all_gather(peer))
    props = torch.cuda.get_device_properties(device)
    return TopologyCaps(group.size, peer, "nvlink" if peer else "none", props.multi_processor_count, capacity,
                        interpret)


class Communicator:
    """Peer collectives for one group of ranks on one device each.

    group: a torch.distributed ProcessGroup (None = world) or a PeerGroup.
    device: this rank's device (default: cuda current device, or cpu for gloo).
    capacity_bytes: the largest tensor one staged operation carries.
    timeout_s: deadline of every device-side wait (default SPARKINFER_TIMEOUT_S or 10).
    channel_ids: extra semantic channels to prepare now (e.g. "target", "draft").

    Construction is collective and allocates peer memory; close() is collective.
    `context` is the OpContext its ops run with; `id` names it in torch.ops.sparkinfer.*.
    """

    def __init__(self, group=None, *, device=None, capacity_bytes: int = 8 << 20, timeout_s: float | None = None,
                 channel_ids=(), backend=None, streams=None):
        import torch
        import torch.distributed as dist

        from sparkinfer.runtime.group import TorchGroup

        if hasattr(group, "all_gather") and hasattr(group, "size"):
            self.group, self.torch_group = group, None
        else:
            self.group = TorchGroup(group)
            self.torch_group = self.group.group
        if device is None:
            if self.torch_group is not None and dist.get_backend(self.torch_group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
        self.device = torch.device(device)
        self.timeout_s = envs.default_timeout_s() if timeout_s is None else float(timeout_s)
        if self.timeout_s <= 0:
            raise SetupError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_ns = int(self.timeout_s * 1e9)
        caps = detect_caps(self.group, self.device, int(capacity_bytes))
        self.pool = ChannelPool(self.group, self.device, int(capacity_bytes), backend=backend, streams=streams)
        self.streams = self.pool.streams
        if caps.peer_access:
            self.pool.prepare(channel_ids)
        self.context = OpContext(caps=caps, layout=self.pool.layout, device=self.device, rank=self.group.rank,
                                 timeout_ns=self.timeout_ns, channel=self.pool.channel,
                                 capturing=self.streams.is_capturing, nccl_group=self.torch_group)
        self.id = torch_ops.attach(self)  # defines torch.ops.sparkinfer.* (first communicator only)

    @property
    def caps(self) -> TopologyCaps:
        """Facts about the group (see TopologyCaps); read-only."""
        return self.context.caps

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.size

    # ------------------------------------------------------------------ ops
    def all_reduce(self, x, out=None, *, algorithm: str = "auto"):
        """Sum of x over ranks (see comm.all_reduce.launch.all_reduce)."""
        from sparkinfer.comm.all_reduce.launch import all_reduce

        return all_reduce(self.context, x, out, algorithm=algorithm)

    def reduce_scatter(self, x, out=None):
        """Rank r's 1/W share of the sum, split along dim 0."""
        from sparkinfer.comm.reduce_scatter.launch import reduce_scatter

        return reduce_scatter(self.context, x, out)

    def all_gather(self, x, out=None):
        """Every rank's x concatenated along dim 0."""
        from sparkinfer.comm.all_gather.launch import all_gather

        return all_gather(self.context, x, out)

    def all_reduce_add_rms_norm(self, x, residual, weight, eps: float = 1e-6, **kwargs):
        """(out, residual_out): rmsnorm(all_reduce(x) + residual) (see comm.fused_norm.launch)."""
        from sparkinfer.comm.fused_norm.launch import all_reduce_add_rms_norm

        return all_reduce_add_rms_norm(self.context, x, residual, weight, eps, **kwargs)

    def dcp_merge(self, out_partial, lse, **kwargs):
        """Merge per-rank partial attention by log-sum-exp (see comm.dcp.launch.dcp_merge)."""
        from sparkinfer.comm.dcp.launch import dcp_merge

        return dcp_merge(self.context, out_partial, lse, **kwargs)

    def all_gather_heads(self, x, out=None, **kwargs):
        """Every rank's heads [T, H/W, D] -> [T, H, D], bitwise (see comm.dcp.launch)."""
        from sparkinfer.comm.dcp.launch import all_gather_heads

        return all_gather_heads(self.context, x, out, **kwargs)

    # ------------------------------------------------------------------ health and teardown
    def check(self) -> None:
        """Raise any error a kernel recorded on any channel (no device sync)."""
        for cid in self.pool.channel_ids:
            check_errors(self.pool.get(cid))

    def synchronize(self) -> None:
        """Wait for this rank's device, then raise any recorded collective error."""
        self.streams.synchronize()
        self.check()

    def close(self) -> None:
        """Collective teardown of every channel (see ChannelPool.close)."""
        self.pool.close()
        torch_ops.detach(self.id)
