"""Shared experts on an auxiliary stream, under the contract of
`sparkinfer.moe.plan_supports_aux_stream_overlap`.

    out = moe_with_shared_experts(x, router=..., routed=..., shared=..., overlap_safe=safe,
                                  streams=CudaStreamOps(device), aux=aux_stream)

The order, on the main stream M and the auxiliary stream A:
1. A waits for an event recorded on M (x is ready);
2. the shared experts are submitted on A, first, so they start while M routes;
3. the router runs on M;
4. where the plan is not overlap-safe (a kernel that needs every SM resident),
   M waits for A before the routed MoE launch; where it is safe, M launches the
   routed MoE at once and waits for A only before adding the shared output.
Events only: no host sync, and the same order inside a CUDA graph capture
(A forks from and joins the capturing stream). `enabled=False` (or aux None)
runs everything on M in the same order, for A/B runs and debugging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["StreamOps", "CudaStreamOps", "moe_with_shared_experts"]


class StreamOps(Protocol):
    def current(self): ...

    def record(self, stream): ...

    def wait(self, stream, event) -> None: ...

    def use(self, stream): ...


class CudaStreamOps:
    """StreamOps over torch.cuda streams and events of `device`."""

    def __init__(self, device):
        import torch

        self._torch = torch
        self.device = torch.device(device)

    def current(self):
        return self._torch.cuda.current_stream(self.device)

    def record(self, stream):
        return stream.record_event()

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def use(self, stream):
        return self._torch.cuda.stream(stream)


def moe_with_shared_experts(x, *, router: Callable, routed: Callable, shared: Callable, overlap_safe: bool,
                            streams: StreamOps | None = None, aux=None, enabled: bool = True):
    """routed(x, router(x)) + shared(x), with shared on `aux` per the module's order.

    x: [T, H]; router(x) -> logits [T, E]; routed(x, logits) -> [T, H]; shared(x) -> [T, H].
    Allocates what the callables allocate; no host sync; capture-legal."""
    if not enabled or aux is None or streams is None:
        logits = router(x)
        return routed(x, logits) + shared(x)
    main = streams.current()
    streams.wait(aux, streams.record(main))
    with streams.use(aux):
        s = shared(x)
    logits = router(x)
    if not overlap_safe:
        streams.wait(main, streams.record(aux))
    out = routed(x, logits)
    if overlap_safe:
        streams.wait(main, streams.record(aux))
    if hasattr(s, "record_stream"):
        s.record_stream(main)  # made on aux, read and freed on main: keep the allocator from reusing it early
    return out + s
