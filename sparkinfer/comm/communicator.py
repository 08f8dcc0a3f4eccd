"""Communicator: the public face of sparkinfer.comm.

    comm = Communicator(group, capacity_bytes=8 << 20)
    y = comm.all_reduce(x)                       # eager
    with comm.pool.capture(stream, "target"):     # graph capture
        with torch.cuda.graph(g, stream=stream):
            y = comm.all_reduce(x)
    comm.close()                                  # collective

Ranks that can map each other run the Triton kernels; other groups (several
nodes, GPUs without peer access) get the same API served by torch.distributed.
"""

from __future__ import annotations

import itertools
import weakref

from sparkinfer import envs
from sparkinfer.comm.launching import check_errors
from sparkinfer.comm.pool import ChannelPool
from sparkinfer.comm.topology import LaunchConfig, TopologyCaps, launch_config, ll_launch_config
from sparkinfer.errors import LifecycleError, SetupError

__all__ = ["Communicator", "get_communicator"]

_REGISTRY: weakref.WeakValueDictionary[int, Communicator] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def get_communicator(comm_id: int) -> Communicator:
    """The live communicator with this id (used by the torch.library ops)."""
    comm = _REGISTRY.get(comm_id)
    if comm is None:
        raise LifecycleError(f"no live Communicator with id {comm_id}; it was closed or garbage-collected")
    return comm


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
    link = "nvlink" if peer else "none"
    return TopologyCaps(group.size, peer, link, props.multi_processor_count, capacity, interpret)


class Communicator:
    """Peer collectives for one group of ranks on one device each.

    group: a torch.distributed ProcessGroup (None = world) or a PeerGroup.
    device: this rank's device (default: cuda current device, or cpu for gloo).
    capacity_bytes: the largest tensor one staged operation carries.
    timeout_s: deadline of every device-side wait (default SPARKINFER_TIMEOUT_S or 10).
    channel_ids: extra semantic channels to prepare now (e.g. "target", "draft").

    Construction is collective and allocates peer memory; close() is collective.
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
        self.caps = detect_caps(self.group, self.device, int(capacity_bytes))
        self.pool = ChannelPool(self.group, self.device, int(capacity_bytes), backend=backend, streams=streams)
        self.streams = self.pool.streams
        if self.caps.peer_access:
            self.pool.prepare(channel_ids)
        self._configs: dict[int, LaunchConfig] = {}
        # Benchmarking only (launch-shape sweeps): None, a LaunchConfig, or
        # callable(nbytes) -> LaunchConfig used instead of launch_config(). Set it identically on
        # every rank (the grid is part of each op's fingerprint) and only between graph captures.
        self._config_override = None
        self.id = next(_IDS)
        _REGISTRY[self.id] = self
        from sparkinfer.comm.torch_ops import register_ops

        register_ops()  # torch.ops.sparkinfer.* (first communicator only)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.size

    def config_for(self, nbytes: int) -> LaunchConfig:
        ov = self._config_override
        if ov is not None:
            return ov(nbytes) if callable(ov) else ov
        cfg = self._configs.get(nbytes)
        if cfg is None:
            cfg = self._configs[nbytes] = launch_config(self.caps, nbytes)
        return cfg

    def ll_config_for(self, nbytes: int) -> LaunchConfig:
        """Launch shape of the LL one-shot for a tensor of `nbytes` (block in int32 words)."""
        ov = self._config_override
        if ov is not None:
            return ov(nbytes) if callable(ov) else ov
        cfg = self._configs.get(-nbytes)
        if cfg is None:
            cfg = self._configs[-nbytes] = ll_launch_config(self.caps, nbytes)
        return cfg

    # ------------------------------------------------------------------ ops
    def all_reduce(self, x, out=None, *, algorithm: str = "auto"):
        """Sum of x over ranks (see comm.all_reduce.launch.all_reduce)."""
        from sparkinfer.comm.all_reduce.launch import all_reduce

        return all_reduce(self, x, out, algorithm=algorithm)

    def reduce_scatter(self, x, out=None):
        """Rank r's 1/W share of the sum, split along dim 0."""
        from sparkinfer.comm.reduce_scatter.launch import reduce_scatter

        return reduce_scatter(self, x, out)

    def all_gather(self, x, out=None):
        """Every rank's x concatenated along dim 0."""
        from sparkinfer.comm.all_gather.launch import all_gather

        return all_gather(self, x, out)

    def all_reduce_add_rms_norm(self, x, residual, weight, eps: float = 1e-6, **kwargs):
        """(out, residual_out): rmsnorm(all_reduce(x) + residual) (see comm.fused_norm.launch)."""
        from sparkinfer.comm.fused_norm.launch import all_reduce_add_rms_norm

        return all_reduce_add_rms_norm(self, x, residual, weight, eps, **kwargs)

    def dcp_merge(self, out_partial, lse, **kwargs):
        """Merge per-rank partial attention by log-sum-exp (see comm.dcp.launch.dcp_merge)."""
        from sparkinfer.comm.dcp.launch import dcp_merge

        return dcp_merge(self, out_partial, lse, **kwargs)

    def all_gather_heads(self, x, out=None, **kwargs):
        """Every rank's heads [T, H/W, D] -> [T, H, D], bitwise (see comm.dcp.launch)."""
        from sparkinfer.comm.dcp.launch import all_gather_heads

        return all_gather_heads(self, x, out, **kwargs)

    # ------------------------------------------------------------------ fallback (torch.distributed)
    def _need_torch_group(self):
        if self.torch_group is None:
            raise LifecycleError("this communicator was built on a PeerGroup without torch.distributed; "
                                 "no NCCL fallback")
        return self.torch_group

    def fallback_all_reduce(self, x, out):
        import torch.distributed as dist

        g = self._need_torch_group()
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        dist.all_reduce(out, group=g)
        return out

    def fallback_reduce_scatter(self, x, out):
        import torch.distributed as dist

        dist.reduce_scatter_tensor(out, x, group=self._need_torch_group())
        return out

    def fallback_all_gather(self, x, out):
        import torch.distributed as dist

        dist.all_gather_into_tensor(out, x, group=self._need_torch_group())
        return out

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
        _REGISTRY.pop(self.id, None)
