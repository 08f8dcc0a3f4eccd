"""What the HTTP layer knows beyond the engine: whether it admits requests, the
requests it is serving, and why it stops.

    state = ServerState(engine, ServerLimits())
    tracker = state.submit(prompt_ids, params)        # APIError 400 / 429 / 503 from the engine's refusals
    async with aclosing(tracker.outputs()) as outs:   # metrics as outputs arrive
        async for out in outs: ...
    tracker.close()                                   # idempotent: aborts the request if it has not finished

    choices = state.submit_choices([(prompt_ids, params_0), (prompt_ids, params_1)])  # all accepted, or none
    async with aclosing(choices.outputs()) as outs:   # (choice index, output) as they come
        async for i, out in outs: ...

Stopping. `request_stop()` (SIGINT/SIGTERM; a flag, safe from a signal handler)
and an unhealthy engine (`engine.stats().healthy` False, polled by `supervise`)
both end the same way: stop admitting (new requests and /health answer 503), let
in-flight requests finish for a grace period (`grace_s` on a stop, `failure_grace_s`
after a failure: the engine has already ended them with errors), abort what is left,
wait for their last events, then call `on_exit` (the server's shutdown). A second
`request_stop()` skips the grace period. After a failure `failure` holds the
engine's message, and the server exits non-zero with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass

from sparkinfer.engine.request import FinishReason, RequestOutput, SamplingParams
from sparkinfer.errors import CapacityError, EngineFailed, EngineOverloaded, ShapeError
from sparkinfer.serve.metrics import ServeMetrics
from sparkinfer.serve.protocol import APIError

__all__ = ["ServerLimits", "ServerState", "Tracker", "Choices"]


@dataclass(frozen=True)
class ServerLimits:
    """grace_s: on SIGINT/SIGTERM, how long in-flight requests may run before they are
    aborted. failure_grace_s: the same after the engine failed (its requests already
    ended with errors; this only lets their last events reach the clients).
    flush_s: after aborting, how long the aborted requests get to send their last
    event. poll_s: how often the supervisor reads the engine's health and the stop
    flag (a failure turns /health 503 within poll_s)."""

    grace_s: float = 30.0
    failure_grace_s: float = 5.0
    flush_s: float = 5.0
    poll_s: float = 0.1


class Tracker:
    """One accepted request as the server follows it: feeds the metrics as its outputs
    arrive and aborts it in the engine if it is closed before it finished (the client
    went away, or the server is stopping)."""

    def __init__(self, state: ServerState, handle, arrival: float):
        self.state, self.handle, self.arrival = state, handle, arrival
        self.done = False  # the last output was seen, or the request was aborted
        self._first = self._last = None

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    async def outputs(self):
        """The request's outputs, the last one `finished`; closing it early aborts."""
        try:
            async with contextlib.aclosing(aiter(self.handle)) as outs:
                async for out in outs:
                    self._saw(out)
                    yield out
                    if out.finished:
                        return
        finally:
            self.close()

    def _saw(self, out: RequestOutput) -> None:
        # time.monotonic, the clock of the engine's stamps: the way back ends at the TTFT's own end, so the
        # parts add up to at most the TTFT (a later read for the way back once summed 2.2 ms past it)
        m, now, n = self.state.metrics, time.monotonic(), len(out.token_ids)
        if n:
            if self._first is None:
                self._first = now
                m.ttft.observe(now - self.arrival)
                t = out.timings
                if t is not None:
                    m.queue_time.observe(t.queue_s)
                    m.prefill_time.observe(t.prefill_s)
                    if t.pickup_s is not None:
                        m.pickup_time.observe(t.pickup_s)
                    if t.emitted_at is not None:
                        m.return_time.observe(max(0.0, now - t.emitted_at))
                m.cached_prompt_tokens.inc(out.cached_tokens)
                if n > 1:  # tokens that came with the first (a reader behind gets outputs merged)
                    m.observe_tokens(n - 1, 0.0)
            else:
                m.observe_tokens(n, now - self._last)
            self._last = now
            m.generation_tokens.inc(n)
        if out.finished:
            self.done = True
            m.e2e.observe(now - self.arrival)
            m.outcome((out.finish_reason or FinishReason.ERROR).value)

    def close(self, *, counted: bool = True) -> None:
        """counted: an unfinished request counts as an abort (False: withdrawn before the
        server accepted its HTTP request, which is counted as refused)."""
        if not self.done:
            self.done = True
            self.state.engine.abort(self.request_id)
            if counted:
                self.state.metrics.outcome("abort")
        self.state.in_flight.pop(self.request_id, None)


class Choices:
    """The engine requests of one HTTP request, a Tracker per choice (OpenAI's `n`),
    followed and closed together."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def __len__(self) -> int:
        return len(self.trackers)

    @property
    def request_id(self) -> str:
        return self.trackers[0].request_id

    async def outputs(self):
        """(choice index, output) of every choice as they arrive, until each has finished;
        closing it early closes (aborts) every choice."""
        if len(self.trackers) == 1:  # no tasks for the common case
            async with contextlib.aclosing(self.trackers[0].outputs()) as outs:
                async for out in outs:
                    yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def follow(i: int, tracker: Tracker) -> None:
            try:
                async with contextlib.aclosing(tracker.outputs()) as outs:
                    async for out in outs:
                        queue.put_nowait((i, out, None))
                queue.put_nowait((i, None, None))
            except Exception as e:  # noqa: BLE001 - re-raised by the reader
                queue.put_nowait((i, None, e))

        tasks = [asyncio.create_task(follow(i, t)) for i, t in enumerate(self.trackers)]
        try:
            live = len(tasks)
            while live:
                i, out, err = await queue.get()
                if err is not None:
                    raise err
                if out is None:
                    live -= 1
                else:
                    yield i, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


class ServerState:
    """The engine, the metrics, the requests in flight and the stop logic of one app."""

    def __init__(self, engine, limits: ServerLimits | None = None):
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.in_flight: dict[str, Tracker] = {}
        self.metrics = ServeMetrics(engine, in_flight=lambda: len(self.in_flight))
        self.admitting = True
        self.failure: str | None = None  # the engine's error, once it failed
        self.stops_requested = 0  # request_stop() calls: 1 drains, 2 aborts at once
        self.on_exit = lambda: None  # set by the server: begin its shutdown

    # ------------------------------------------------------------ admission
    def check_admitting(self) -> None:
        if self.failure is not None:
            raise APIError(503, f"the engine failed: {self.failure}", type="service_unavailable",
                           code="engine_failed")
        if not self.admitting:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")

    def submit(self, prompt: list[int], params: SamplingParams, *, prompt_field: str = "prompt",
               count: bool = True) -> Tracker:
        """Submit to the engine and follow the request. Refusals become APIErrors:
        EngineOverloaded 429 with Retry-After; CapacityError and ShapeError 400 naming
        `prompt_field`; EngineFailed 503 (and the server stops). count: add the prompt
        to the prompt-token counter (submit_choices counts once all are accepted)."""
        self.check_admitting()
        arrival = time.monotonic()
        try:
            handle = self.engine.submit(prompt, params)
        except EngineOverloaded as e:
            retry = max(1, math.ceil(e.retry_after_s))  # Retry-After is whole seconds
            raise APIError(429, f"the server is at capacity: {e}; retry after {retry} s", type="rate_limit_error",
                           code="engine_overloaded", headers={"Retry-After": str(retry)}) from None
        except CapacityError as e:
            raise APIError(400, str(e), param=prompt_field, code="context_length_exceeded") from None
        except ShapeError as e:
            raise APIError(400, str(e), param=prompt_field) from None
        except EngineFailed as e:
            self.fail(str(e))
            raise APIError(503, f"the engine failed: {e}", type="service_unavailable", code="engine_failed") from None
        tracker = Tracker(self, handle, arrival)
        self.in_flight[handle.request_id] = tracker
        if count:
            self.metrics.prompt_tokens.inc(len(prompt))
        return tracker

    def submit_choices(self, choices: list[tuple[list[int], SamplingParams]], *,
                       prompt_field: str = "prompt") -> Choices:
        """Submit one engine request per choice, (prompt, params): all are accepted, or
        the ones already submitted are aborted and the refusal is raised (a 429 turns
        away the whole request, never part of it)."""
        trackers: list[Tracker] = []
        try:
            for prompt, p in choices:
                trackers.append(self.submit(prompt, p, prompt_field=prompt_field, count=False))
        except APIError:
            for tracker in trackers:
                tracker.close(counted=False)
            raise
        self.metrics.prompt_tokens.inc(sum(len(prompt) for prompt, _ in choices))
        return Choices(trackers)

    # ------------------------------------------------------------ health and stopping
    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of GET /health: 200 only while the engine is healthy and
        the server admits requests."""
        s = self.engine.stats()
        if self.failure is not None or not s.healthy:
            return 503, {"status": "failed", "error": self.failure or s.error}
        if not self.admitting:
            return 503, {"status": "stopping"}
        return 200, {"status": "ok", "running": s.running, "waiting": s.waiting}

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            self.admitting = False
            print(f"sparkinfer serve: the engine failed: {message}", file=sys.stderr, flush=True)

    def request_stop(self) -> None:
        """Begin a graceful stop; a second call aborts in-flight requests at once. Only
        counts, so it is safe from a signal handler (which may interrupt a thread
        holding the engine's locks)."""
        self.stops_requested += 1

    async def supervise(self) -> None:
        """Poll the stop flag and the engine's health every poll_s; on either, stop."""
        while True:
            await asyncio.sleep(self.limits.poll_s)
            if self.failure is None:
                try:
                    s = self.engine.stats()
                    healthy, error = s.healthy, s.error
                except Exception as e:  # noqa: BLE001 - an engine that cannot report has failed
                    healthy, error = False, f"stats() raised {type(e).__name__}: {e}"
                if not healthy:
                    self.fail(error or "the engine reported itself unhealthy")
            if self.failure is not None or self.stops_requested:
                await self._stop()
                return

    async def _stop(self) -> None:
        self.admitting = False
        grace = self.limits.failure_grace_s if self.failure is not None else self.limits.grace_s
        await self._until_idle(grace, interruptible=True)
        for tracker in list(self.in_flight.values()):
            self.engine.abort(tracker.request_id)  # ends with ABORT: its handler sends the error
        await self._until_idle(self.limits.flush_s, interruptible=False)
        self.on_exit()

    async def _until_idle(self, timeout_s: float, *, interruptible: bool) -> None:
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            if interruptible and self.stops_requested > 1:
                return
            await asyncio.sleep(0.05)
