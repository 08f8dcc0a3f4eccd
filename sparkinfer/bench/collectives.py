"""Exact collective payloads and comm rank plumbing, shared by the comm benchmark
and benchmarks/gpu_checks.py.

- `payload()`, `payload_sum()`, `Collective`: small integers, so a sum over ranks
  is exact in bf16/fp16/fp32 and results compare with torch.equal.
- `Ctx` (streams, capture scopes, sync on CUDA or CPU ranks), `step()` (load,
  poison, run, compare), `read_epoch()`, `CountingBackend` (live slabs and peer
  mappings), `free_device_bytes()` (cudaMemGetInfo after emptying torch's cache).

Nothing here imports torch at import time.
"""

from __future__ import annotations

import contextlib

from sparkinfer.bench.timing import Graph

__all__ = ["payload", "payload_sum", "poison", "Collective", "Ctx", "step", "read_epoch", "CountingBackend",
           "free_device_bytes"]


def payload(n: int, rank: int, seed: int, dtype, device):
    """[n] rank-encoded small integers in [-30, 30]: sums over up to 8 ranks are
    exact in bf16 (8-bit mantissa), fp16 and fp32."""
    import torch

    i = torch.arange(n, device=device, dtype=torch.int32)
    return ((i * 7 + seed * 13 + rank * 5) % 61 - 30).to(dtype)


def payload_sum(n: int, world_size: int, seed: int, dtype, device):
    """Exact sum over ranks 0..W-1 of payload(n, r, seed), in `dtype`."""
    import torch

    acc = torch.zeros(n, device=device, dtype=torch.float32)
    for r in range(world_size):
        acc += payload(n, r, seed, torch.float32, device)
    return acc.to(dtype)


def poison(*tensors) -> None:
    """Fill float outputs with NaN so a kernel that skips writing them is caught."""
    for t in tensors:
        t.fill_(float("nan"))


class Collective:
    """One collective call on fixed buffers, with its exact expected result.

    comm: a sparkinfer.comm.Communicator.
    kind: "ar" all_reduce (x: [n] -> out: [n]), "rs" reduce_scatter ([n] -> [n / W]),
          "ag" all_gather ([n] -> [W * n]).
    algorithm: all_reduce only ("auto", "oneshot", "twoshot", "nccl").
    Allocates x and out once; `call()` launches on the current stream without
    allocating (graph-safe once warmed up).
    """

    def __init__(self, comm, kind: str, n: int, dtype, algorithm: str = "auto"):
        import torch

        W = comm.world_size
        self.comm, self.kind, self.n, self.dtype, self.algorithm = comm, kind, n, dtype, algorithm
        n_out = {"ar": n, "rs": n // W, "ag": n * W}[kind]
        self.x = torch.zeros(n, dtype=dtype, device=comm.device)
        self.out = torch.zeros(n_out, dtype=dtype, device=comm.device)

    @property
    def name(self) -> str:
        tag = f"ar:{self.algorithm}" if self.kind == "ar" else self.kind
        return f"{tag}:n={self.n}:{str(self.dtype).removeprefix('torch.')}"

    def call(self) -> None:
        if self.kind == "ar":
            self.comm.all_reduce(self.x, out=self.out, algorithm=self.algorithm)
        elif self.kind == "rs":
            self.comm.reduce_scatter(self.x, out=self.out)
        else:
            self.comm.all_gather(self.x, out=self.out)

    def load(self, seed: int) -> None:
        """x = this rank's payload for `seed` (on the current stream)."""
        self.x.copy_(payload(self.n, self.comm.rank, seed, self.dtype, self.comm.device))

    def expected(self, seed: int):
        import torch

        W, r, dev = self.comm.world_size, self.comm.rank, self.comm.device
        if self.kind == "ag":
            return torch.cat([payload(self.n, q, seed, self.dtype, dev) for q in range(W)])
        total = payload_sum(self.n, W, seed, self.dtype, dev)
        if self.kind == "rs":
            m = self.n // W
            return total[r * m:(r + 1) * m]
        return total

    def mismatch(self, seed: int) -> str | None:
        """None if out equals the expected result exactly, else a short description."""
        import torch

        want = self.expected(seed)
        if torch.equal(self.out, want):
            return None
        bad = (self.out != want) | torch.isnan(self.out)
        i = int(bad.nonzero()[0, 0]) if bool(bad.any()) else -1
        return (f"{self.name} seed={seed}: {int(bad.sum())}/{want.numel()} elements differ; first at {i}: "
                f"got {float(self.out[i])}, want {float(want[i])}")


class Ctx:
    """Stream plumbing of one comm rank that reads the same on CUDA and CPU ranks.

    world: the launcher's World; comm: its Communicator. `stream()` makes a side
    stream (a key on CPU), `graph()` captures inside comm.pool.capture."""

    def __init__(self, world, comm):
        import torch

        self.torch, self.comm, self.cuda = torch, comm, world.backend == "cuda"
        self.cpu_streams = None if self.cuda else comm.streams
        self._n = 0

    def stream(self):
        self._n += 1
        return self.torch.cuda.Stream() if self.cuda else f"side{self._n}"

    def on(self, s):
        """Make `s` current (CUDA: ordered after the default stream's pending work)."""
        if not self.cuda:
            return self.comm.streams.use(s)
        s.wait_stream(self.torch.cuda.current_stream())
        return self.torch.cuda.stream(s)

    def use(self, s):
        """Make `s` current for a replay (CUDA only: the CPU stand-in picks its own stream)."""
        return self.torch.cuda.stream(s) if self.cuda else contextlib.nullcontext()

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def graph(self, fn, s, channel_id: str, warmup: int = 1) -> Graph:
        scope = lambda replaying: self.comm.pool.capture(s, channel_id, reuse=replaying)  # noqa: E731
        return Graph(fn, s, scope=scope, cpu_streams=self.cpu_streams, warmup=warmup)

    def eager_on_channel(self, s, channel_id: str, fn):
        """Eager calls on a graph's channel: inside its scope, on its stream."""
        with self.comm.pool.capture(s, channel_id, reuse=True), self.on(s):
            fn()
        if self.cuda:
            self.torch.cuda.current_stream().wait_stream(s)


def step(ctx, colls, seed, run, label, fails) -> None:
    """Load payloads for `seed`, poison outputs, run, compare every output exactly."""
    for c in colls:
        c.load(seed)
        poison(c.out)
    run()
    ctx.sync()
    for c in colls:
        bad = c.mismatch(seed)
        if bad:
            fails.append(f"{label}: {bad}")


def read_epoch(channel) -> int | None:
    """The channel's epoch word (header word 0 of this rank's slab); a debugging read."""
    try:
        import ctypes

        import torch

        if channel.slab.keep is not None:  # host slab
            return ctypes.c_int64.from_address(channel.slab.ptr).value
        try:
            from cuda.bindings import runtime as rt
        except ImportError:  # older cuda-python
            from cuda import cudart as rt

        buf = torch.zeros(1, dtype=torch.int64)
        err = rt.cudaMemcpy(buf.data_ptr(), channel.slab.ptr, 8, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)[0]
        return int(buf[0]) if int(err) == 0 else None
    except Exception:  # noqa: BLE001
        return None


class CountingBackend:
    """A slab backend that counts live slabs and open peer mappings (IPC imports on CUDA)."""

    def __init__(self, inner):
        self.inner, self.name, self.device_type = inner, inner.name, inner.device_type
        self.slabs = self.mappings = self.allocated = self.opened = 0
        self.seal = inner.seal

    def allocate(self, nbytes):
        s = self.inner.allocate(nbytes)
        self.slabs, self.allocated = self.slabs + 1, self.allocated + 1
        return s

    def open(self, peer, handle, nbytes):
        m = self.inner.open(peer, handle, nbytes)
        self.mappings, self.opened = self.mappings + 1, self.opened + 1
        return m

    def close(self, mapping):
        self.inner.close(mapping)  # counted only once it succeeded
        self.mappings -= 1

    def free(self, slab):
        self.inner.free(slab)
        self.slabs -= 1


def free_device_bytes(cuda: bool) -> int | None:
    """Free device memory (cudaMemGetInfo: slabs live outside torch's allocator)."""
    if not cuda:
        return None
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])
