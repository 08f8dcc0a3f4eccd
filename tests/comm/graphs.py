"""Graph plumbing shared by the collective tests: the eager -> capture -> replay ->
new inputs -> replay sequence, on CPU ranks (a stand-in capture) and on 2 GPUs."""

import os

import pytest
import torch


class Captured:
    """`fn` captured once inside comm.pool.capture(stream, channel_id) after an eager
    warm-up on that stream, then replayed. CPU ranks stand in: "capture" runs fn with
    the stream marked capturing (so capture-only rules apply), a replay re-runs it."""

    def __init__(self, comm, fn, channel_id: str):
        import torch

        self.comm, self.fn, self.cid, self.cuda = comm, fn, channel_id, comm.device.type == "cuda"
        self.stream = torch.cuda.Stream() if self.cuda else f"{channel_id}_stream"
        with comm.pool.capture(self.stream, channel_id):
            if self.cuda:
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    fn()
                self.stream.synchronize()
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=self.stream):
                    fn()
            else:
                with comm.streams.use(self.stream):
                    fn()
                with comm.streams.capture(self.stream):
                    fn()

    def replay(self):
        import torch

        if self.cuda:
            self.graph.replay()
            torch.cuda.synchronize()
        else:
            with self.comm.pool.capture(self.stream, self.cid, reuse=True), self.comm.streams.use(self.stream):
                self.fn()


def pack(t):
    """A tensor as (numpy bytes, dtype, shape): torch's queue pickling shares file
    descriptors that die with the rank process."""
    return t.contiguous().view(torch.uint8).numpy().copy(), t.dtype, tuple(t.shape)


def unpack(p):
    raw, dtype, shape = p
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def bits_diff(a, b, what):
    """Where two results of one input differ: counts, rows, the largest difference in ulps."""
    ia = a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32).long()
    ib = b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32).long()
    bad = ia != ib
    if not bad.any():
        return None
    return dict(what=what, bad=int(bad.sum()), numel=bad.numel(),
                rows=sorted({int(i) for i in bad.nonzero()[:, 0].tolist()})[:16],
                cols=bad.nonzero()[:8, -1].tolist(), max_ulps=int((ia - ib)[bad].abs().max()))


def worst_ulps(actual, ref) -> float:
    """Largest |actual - ref| in units of eps(actual's dtype) * |ref| (failure reports)."""
    a, r = actual.float(), ref.float()
    return round(float(((a - r).abs() / (torch.finfo(actual.dtype).eps * r.abs() + 1e-30)).max()), 2)


def graph_steps(comm, run, load, results, seed: int) -> dict:
    """eager -> capture -> replay -> new inputs -> replay. load(seed) writes the
    inputs in place; run() launches the ops on fixed buffers; results() snapshots
    the outputs. Returns {step: results()}. Raises the collective error a kernel
    recorded during any step (comm.synchronize)."""
    steps = {}
    load(seed)
    run()
    steps["eager"] = results()
    comm.synchronize()  # an error a kernel recorded (a timeout: who was stuck) fails here, typed
    load(seed)
    g = Captured(comm, run, "g")
    load(seed)
    g.replay()
    steps["replay"] = results()
    comm.synchronize()  # a replay's errors reach no Python call on their own
    load(seed + 1)
    g.replay()
    steps["replay_new_inputs"] = results()
    comm.synchronize()
    del g
    return steps


GRAPH_BACKENDS = [
    pytest.param("cpu", id="cpu_ranks"),
    pytest.param("cuda", id="2gpus", marks=[pytest.mark.gpu2, pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2 or os.environ.get("TRITON_INTERPRET") == "1",
        reason="needs 2 GPUs with compiled kernels (TRITON_INTERPRET unset)")]),
]
