"""Timing helpers of the benchmarks: medians, CUDA graphs, CUDA-event timings.

- `Graph`: a function captured into a CUDA graph, or a CPU stand-in for dry runs.
- `time_calls()`: seconds of back-to-back calls (CUDA events on GPUs).
- `graph_op_us()`: microseconds per call inside a graph of many calls.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import contextlib
import time

__all__ = ["median", "Graph", "time_calls", "graph_op_us", "sweep_op_us"]


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


def sweep_op_us(fn, cuda: bool, ops: int = 20) -> float:
    """A sweep's microseconds per call of `fn`: on a GPU `graph_op_us` (a graph of `ops`
    calls on a fresh stream, so a small shape's launch overhead is not timed); on the CPU
    the wall clock of one call (dry runs check logic, not speed)."""
    if cuda:
        import torch

        return graph_op_us(fn, torch.cuda.Stream(), ops=ops)
    return median(time_calls(fn, 1, cuda=False)) * 1e6
