"""The engine as its callers see it: submit, abort, stream a request's outputs.

    engine = ServingEngine.launch(EngineConfig(model="ckpt/", tp=2))   # starts the ranks
    handle = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=16))
    for out in handle: ...            # blocking, from any thread
    async for out in handle: ...      # from an asyncio task
    engine.abort(handle.request_id)   # its slot is free within one step
    engine.close()

`EngineClient` is the protocol the HTTP front end codes against (it never sees
ranks or tensors); `RequestHandle` is the one implementation of a request's
stream, shared by every engine. Handles are fed from the engine's thread and read
from any thread or event loop.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque
from typing import Protocol

from sparkinfer.engine.request import (
    EngineStats,
    FinishReason,
    RequestOutput,
    RequestState,
    SamplingParams,
    merge_outputs,
)

__all__ = ["EngineClient", "RequestHandle", "new_request_id", "push_outputs"]


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestHandle:
    """One submitted request: its id, state and the outputs it streams.

    Iterate it (blocking) or `async for` it (in one event loop) to receive each
    `RequestOutput` once; the last one has `finished` set. `state`,
    `finish_reason` and `error` are readable at any time. Written by the engine's
    thread through `_push`; thread-safe."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams):
        self.request_id, self.prompt, self.params = request_id, list(prompt), params
        self.state = RequestState.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self._items: deque[RequestOutput] = deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    # ---------------------------------------------------------------- engine side
    def _push(self, out: RequestOutput) -> None:
        push_outputs(((self, out),))

    def _append(self, out: RequestOutput) -> list:
        """Queue `out` and return the (loop, event) of each reader to wake (push_outputs wakes them)."""
        with self._cond:
            if out.finished:
                self.state = RequestState.FINISHED
                self.finish_reason, self.error = out.finish_reason, out.error
            self._items.append(out)
            self._cond.notify_all()
            return list(self._waiters)

    def _push_fields(self, fields: tuple) -> None:
        """`_push(RequestOutput(*fields))`: the engine's loop gives an output's fields, which a
        relay to another process sends as they are (a RequestOutput took 1 us to build on the
        2-core CI machine)."""
        self._push(RequestOutput(*fields))

    # ---------------------------------------------------------------- reader side
    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output (blocking up to `timeout` seconds; None if none came)."""
        with self._cond:
            if not self._items and not self._cond.wait_for(lambda: bool(self._items), timeout):
                return None
            return self._items.popleft()

    def __iter__(self):
        while True:
            out = self.get()
            yield out
            if out.finished:
                return

    async def __aiter__(self):
        """Outputs that queued up while the reader was busy come as one (their tokens,
        text and logprobs joined): a server behind on a stream sends one chunk, not a
        backlog of them."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        try:
            while True:
                with self._cond:
                    out = merge_outputs([self._items.popleft() for _ in range(len(self._items))])
                    if out is None:
                        event.clear()
                if out is None:
                    await event.wait()
                    continue
                yield out
                if out.finished:
                    return
        finally:
            with self._cond:
                self._waiters.remove((loop, event))

    def result(self) -> list[RequestOutput]:
        """Every remaining output, blocking until the request finishes."""
        return list(self)


def push_outputs(pairs) -> None:
    """Push each (handle, output) of `pairs`, then wake each event loop that reads any of
    them once: one `call_soon_threadsafe` (a write to the loop's wake-up pipe) a loop
    for a step's outputs, not one a request (64 a step at batch 64)."""
    wake: dict = {}
    for handle, out in pairs:
        for loop, event in handle._append(out):
            wake.setdefault(loop, []).append(event)
    for loop, events in wake.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # the reader's loop closed (its client went away)
            pass


def _set_all(events) -> None:
    for event in events:
        event.set()


class EngineClient(Protocol):
    """What `sparkinfer.serve` needs of an engine.

    model_name: the name served under /v1/models. tokenizer: the checkpoint's
    (`encode`, `decode`, `apply_chat_template`), or None. max_context: prompt +
    new tokens a request may hold (cache positions). eos_token_ids: the
    checkpoint's end-of-sequence tokens.

    submit() never blocks on the model: it validates and queues, raising
    CapacityError (a prompt that cannot fit), ShapeError (an empty prompt or a
    token id outside the vocabulary), EngineOverloaded (the waiting queue is full)
    or EngineFailed (the engine stopped). abort() of an unknown or finished id does
    nothing. stats() is a cheap snapshot. close() stops admitting, aborts what is
    in flight and shuts the ranks down (collectively)."""

    model_name: str
    tokenizer: object
    max_context: int
    eos_token_ids: tuple[int, ...]

    def submit(self, prompt: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestHandle: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...
