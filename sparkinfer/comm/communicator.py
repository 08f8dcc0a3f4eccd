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

import math
import operator

from sparkinfer import envs
from sparkinfer.comm import torch_ops
from sparkinfer.comm.context import OpContext
from sparkinfer.comm.dispatch import check_errors
from sparkinfer.comm.pool import ChannelPool
from sparkinfer.comm.topology import TopologyCaps
from sparkinfer.errors import DeviceError, SetupError, SparkInferError

__all__ = ["Communicator", "detect_caps", "EXCHANGE_DEADLINES"]

# A host exchange of setup or close() waits this many deadlines (timeout_s) for a peer: a live
# peer may first spend one whole deadline in a kernel that is timing out (close() synchronizes
# before its first exchange), so one deadline would fail its close() (tests/faults/test_exit.py
# did, 1 s deadline); a rank that is not there after two stalled or died.
EXCHANGE_DEADLINES = 2


def _exchange(group, obj) -> list:
    """group.all_gather during setup; a failed exchange (a peer died or left) is SetupError."""
    try:
        return group.all_gather(obj)
    except SparkInferError:
        raise
    except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses of all kinds
        raise SetupError(f"rank {group.rank}: Communicator setup could not exchange with its peers "
                         f"({type(e).__name__}: {e}); a peer died, stalled or left the group") from e


def _resolve_device(device, torch_group):
    """This rank's torch.device: "cpu" (any index) or "cuda[:i]" (default: the current CUDA device for
    NCCL groups, else cpu); DeviceError quoting anything else."""
    import torch
    import torch.distributed as dist

    if device is None:
        if torch_group is not None and dist.get_backend(torch_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"device={device!r} is not a device ({e}); pass 'cpu', 'cuda' or 'cuda:<index>'") from e
    if dev.type == "cpu":
        return torch.device("cpu")  # "cpu:0" names the same memory; tensors report plain "cpu"
    if dev.type != "cuda":
        raise DeviceError(f"device={device!r}: a Communicator runs on 'cpu' or 'cuda:<index>', not {dev.type!r}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = dev.index if dev.index is not None else (torch.cuda.current_device() if n else 0)
    if index >= n:
        raise DeviceError(f"device={device!r}: this process sees {n} CUDA device(s); pass one of them or 'cpu'")
    return torch.device("cuda", index)


def _check_timeout(timeout_s) -> float:
    if timeout_s is None:
        return envs.default_timeout_s()
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise SetupError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def _bound_hint(timeout_s) -> float:
    """The deadline of the first setup exchange: this rank's timeout if it is valid, else 10 s
    (the ranks have not yet agreed on one; a bad value is reported by that exchange)."""
    try:
        return _check_timeout(timeout_s)
    except SetupError:
        return 10.0


def _check_capacity(capacity_bytes) -> int:
    try:  # any integer type (numpy's too), never a float or a bool
        value = None if isinstance(capacity_bytes, bool) else operator.index(capacity_bytes)
    except TypeError:
        value = None
    if value is None or value <= 0:
        raise SetupError(f"capacity_bytes must be a positive int (bytes), got {capacity_bytes!r}")
    return value


def _check_channel_ids(channel_ids) -> tuple:
    if isinstance(channel_ids, (str, bytes)):
        raise SetupError(f"channel_ids must be a collection of ids, got the bare string {channel_ids!r} "
                         f"(it would be read letter by letter); pass ({channel_ids!r},)")
    try:
        ids = tuple(channel_ids)
    except TypeError:
        raise SetupError(f"channel_ids must be a collection of strings, got {channel_ids!r}") from None
    for cid in ids:
        if not isinstance(cid, str) or not cid:
            raise SetupError(f"channel ids are non-empty strings, got {cid!r} in channel_ids={channel_ids!r}")
    return ids


def detect_caps(group, device, capacity: int) -> TopologyCaps:
    """Gather topology facts (collective: exchanges device indices)."""
    import torch

    interpret = envs.triton_interpret()
    if device.type == "cpu":
        return TopologyCaps(group.size, True, "host", 2, capacity, interpret=True)
    idx = _exchange(group, device.index)
    peer = all(
        i == j or torch.cuda.can_device_access_peer(i, j) for i in idx for j in idx if i == device.index
    )
    peer = all(_exchange(group, peer))
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
        from sparkinfer.runtime.group import TorchGroup

        if hasattr(group, "all_gather") and hasattr(group, "size"):
            self.group, self.torch_group = group, None
        else:
            # every setup and teardown exchange is bounded (EXCHANGE_DEADLINES); the first by the
            # rank's own timeout, before the ranks have agreed that it is valid
            self.group = TorchGroup(group, timeout_s=EXCHANGE_DEADLINES * _bound_hint(timeout_s))
            self.torch_group = self.group.group
        # Check the arguments, then agree: one exchange gives every rank the same verdict
        # (a bad argument or a capacity that differs on one rank is SetupError everywhere,
        # never one rank raising while the others wait in the next exchange).
        err, capacity, ids = None, None, ()
        try:
            self.device = _resolve_device(device, self.torch_group)
            self.timeout_s = _check_timeout(timeout_s)
            capacity = _check_capacity(capacity_bytes)
            ids = _check_channel_ids(channel_ids)
        except SparkInferError as e:
            err = e
        views = _exchange(self.group, (None if err is None else f"{type(err).__name__}: {err}", capacity))
        if err is not None:
            try:
                raise err
            finally:
                err = None  # a local holding the error its traceback holds would be a cycle (dispatch.check_errors)
        bad = [(r, e) for r, (e, _) in enumerate(views) if e]
        if bad:
            raise SetupError("Communicator arguments rejected on " + "; ".join(f"rank {r} ({e})" for r, e in bad))
        caps_seen = [c for _, c in views]
        if len(set(caps_seen)) > 1:
            raise SetupError(f"ranks passed different capacity_bytes {caps_seen} (in rank order); every rank must "
                             "pass the same capacity, since each maps its peers' slabs of that size")
        self.timeout_ns = int(self.timeout_s * 1e9)
        if isinstance(self.group, TorchGroup):
            self.group.timeout_s = EXCHANGE_DEADLINES * self.timeout_s
        self.pool = None
        try:
            caps = detect_caps(self.group, self.device, capacity)
            self.pool = ChannelPool(self.group, self.device, capacity, backend=backend, streams=streams)
            self.streams = self.pool.streams
            if caps.peer_access:
                self.pool.prepare(ids)
        except BaseException as e:
            if self.pool is not None:
                self.pool.abandon()
            if isinstance(e, SparkInferError):
                raise
            raise SetupError(f"rank {self.group.rank}: Communicator setup failed ({type(e).__name__}: {e}); "
                             "nothing was left allocated on this rank") from e
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
        """Collective teardown of every channel (see ChannelPool.close).

        TeardownError on every rank if a phase failed somewhere (call close() again);
        after a peer died, TeardownError on the survivors and the communicator is
        closed for good (docs/design.md, "Error model")."""
        try:
            self.pool.close()
        finally:
            if self.pool.closed:
                torch_ops.detach(self.id)
