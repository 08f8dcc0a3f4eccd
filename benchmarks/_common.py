"""Shared helpers of the benchmark and GPU-evidence scripts in benchmarks/.

    from _common import ensure_repo_on_path, metadata, append_rows, Graph, time_calls, median

- Provenance: `metadata()` (GPU name, driver, versions, commit, date, command),
  `append_rows()` (JSON rows, each carrying that metadata).
- Timing: `Graph` (a function captured into a CUDA graph, or a CPU stand-in for
  dry runs), `time_calls()` (seconds of back-to-back calls, CUDA events on GPUs),
  `median()`.
- Exact collective payloads: `payload()`, `payload_sum()`, `Collective`: small integers, so a
  sum over ranks is exact in bf16/fp16/fp32 and results compare with torch.equal.
- Comm rank plumbing: `Ctx` (streams, capture scopes, sync on CUDA or CPU ranks),
  `step()` (load, poison, run, compare), `read_epoch()`, `CountingBackend` (live slabs
  and peer mappings), `free_device_bytes()` (cudaMemGetInfo after emptying torch's cache).

Nothing here imports torch, Triton or sparkinfer at import time: scripts are
re-imported by every spawned rank, and CPU ranks must set TRITON_INTERPRET
before Triton is first imported.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

__all__ = [
    "REPO_ROOT", "ensure_repo_on_path", "gpu_info", "versions", "git_commit", "metadata",
    "append_rows", "median", "Graph", "time_calls", "payload", "payload_sum", "poison", "Collective", "Ctx", "step", "read_epoch",
    "CountingBackend", "free_device_bytes",
]

REPO_ROOT = Path(__file__).resolve().parent.parent


def ensure_repo_on_path() -> None:
    """Make `import sparkinfer` work when a script runs as `python3 benchmarks/x.py`
    without an installed package (spawned ranks inherit sys.path)."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def gpu_info() -> dict:
    """{"gpu": name of GPU 0 or "cpu", "gpu_count", "driver"}, from nvidia-smi when it
    answers (so the calling process creates no CUDA context), else from torch."""
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        rows = [[f.strip() for f in line.split(",")] for line in smi.splitlines() if line.strip()]
        return {"gpu": rows[0][0], "gpu_count": len(rows), "driver": rows[0][-1]}
    import torch

    if not torch.cuda.is_available():
        return {"gpu": "cpu", "gpu_count": 0, "driver": None}
    return {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(), "driver": None}


def versions() -> dict:
    """Versions of python, torch, triton, CUDA, NCCL and cuda-bindings (None where absent)."""
    import importlib.metadata as im

    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("triton", "cuda-bindings", "numpy"):
        try:
            out[dist] = im.version(dist)
        except im.PackageNotFoundError:
            out[dist] = None
    try:
        v = torch.cuda.nccl.version() if torch.version.cuda else None
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else v
    except Exception:  # noqa: BLE001 - provenance only
        out["nccl"] = None
    return out


def git_commit() -> dict:
    """{"commit": $SPARKINFER_COMMIT if set (a copied tree may carry a stale .git), else
    HEAD; "dirty": bool, or None when the commit came from the environment}."""
    head = os.environ.get("SPARKINFER_COMMIT") or _run(["git", "rev-parse", "HEAD"])
    if head is None or os.environ.get("SPARKINFER_COMMIT"):
        return {"commit": head, "dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"commit": head, "dirty": bool(status)}


def metadata(argv: list[str] | None = None) -> dict:
    """Everything a result row needs to be traced back to a machine and a commit."""
    argv = sys.argv if argv is None else argv
    return {
        **gpu_info(),
        **versions(),
        **git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python3"] + list(argv)),
        "host": os.uname().nodename,
    }


def append_rows(path: str | os.PathLike, rows: list[dict], meta: dict) -> Path:
    """Append `rows` (each merged with `meta`) to the JSON list at `path`, atomically.

    The file is a JSON list of flat objects; earlier runs are kept, so one file
    holds the history of a benchmark. Returns the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old: list = []
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = []
        if not isinstance(old, list):
            old = [old]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(old + [{**meta, **r} for r in rows], indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def median(xs) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


class Graph:
    """`fn` captured once into a CUDA graph, then replayed; on CPU, a stand-in that re-runs it.

    fn: callable() that launches work on fixed buffers (it must not allocate
        what a replay reads: captured addresses are frozen).
    stream: the capture stream (a torch.cuda.Stream, not the default stream); on
        CPU any hashable stream key of `cpu_streams`.
    scope: optional callable(replaying: bool) -> context manager. It is entered
        around the warm-up and the capture (replaying=False), and on CPU around
        every replay (replaying=True), e.g.
        `lambda r: comm.pool.capture(stream, "target", reuse=r)`.
    cpu_streams: the CpuStreams to drive on CPU (it marks the stand-in capture as
        capturing, so capture-only checks still run); None on CUDA.
    warmup: eager calls of fn on `stream` inside the scope before capturing
        (compiles kernels; compiling during capture is refused).

    Allocates the graph's private memory pool; synchronizes the device at capture.
    `replay()` launches on the current stream (CUDA) and never syncs.
    """

    def __init__(self, fn, stream, *, scope=None, cpu_streams=None, warmup: int = 1):
        self.fn, self.stream, self.cpu_streams = fn, stream, cpu_streams
        self.scope = scope if scope is not None else (lambda replaying: contextlib.nullcontext())
        self.graph = None
        if cpu_streams is not None:
            with self.scope(False):
                with cpu_streams.use(stream):
                    for _ in range(warmup):
                        fn()
                with cpu_streams.capture(stream):
                    fn()
            return
        import torch

        with self.scope(False):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn()
            stream.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                fn()
        self.graph = g

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        if self.cpu_streams is None:
            raise RuntimeError("this Graph was released")
        with self.scope(True), self.cpu_streams.use(self.stream):
            self.fn()

    def release(self) -> None:
        """Drop the CUDA graph (and its memory pool reference)."""
        self.graph = None


def time_calls(call, n: int, *, cuda: bool) -> list[float]:
    """Seconds taken by each of `n` back-to-back `call()`s.

    cuda=True: CUDA events on the current stream around each call, one device
    sync at the end (the first call may absorb skew between ranks: use a median).
    cuda=False: wall clock."""
    if not cuda:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
        return out
    import torch

    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        call()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e-3 for a, b in ev]


def graph_op_us(fn, stream, *, scope=None, ops: int = 20, reps: int = 15) -> float:
    """Microseconds per call of `fn` (CUDA) in a graph of `ops` back-to-back calls:
    the median of `reps` replays over `ops`. fn runs once eagerly first, then the
    graph is captured on `stream` (Graph, with `scope`), replayed once, and timed."""
    import torch

    fn()
    torch.cuda.synchronize()
    g = Graph(lambda: [fn() for _ in range(ops)], stream, scope=scope)
    g.replay()
    torch.cuda.synchronize()
    ts = time_calls(g.replay, reps, cuda=True)
    g.release()
    return median(ts) / ops * 1e6


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
