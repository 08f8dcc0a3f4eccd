"""A deterministic engine behind the `EngineClient` protocol, for the server's tests.

    engine = FakeEngine(max_batch=4, max_waiting=8, step_s=0.002)
    handle = engine.submit([104, 105], SamplingParams(max_new_tokens=5))

The "model" is a byte tokenizer (ids 0..255 are bytes, EOS = 257) and a rule:
token n of a request is its prompt's token n mod len(prompt), and after one pass
over the prompt comes EOS (unless ignore_eos). So "hello" answers "hello" then
stops, or "hellohel" at max_tokens=8 with ignore_eos, whatever else runs: an
output depends on its prompt alone, like a batch-invariant greedy engine.

A background thread runs a step every `step_s`: admit waiting requests into free
slots (max_batch), give each running request one token. It does what the real
engine does for the server: the bounded waiting queue (EngineOverloaded), stop
strings (text held back while it may begin one, cut before it), stop ids, EOS,
max_new_tokens and context length, logprobs, abort within a step, and failure
(`fail(rank)`: every in-flight request ends with ERROR, stats turn unhealthy,
submit raises EngineFailed). `pause()` / `resume()` hold the tokens (requests are
still admitted into free slots), so a test can fill the slots and the queue, or
hold a request in flight, without racing the engine. Everything it saw is recorded:
`submitted` (id, prompt, params) and `aborted` ids.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from sparkinfer.engine.client import RequestHandle, new_request_id, push_outputs
from sparkinfer.engine.request import (
    EngineStats,
    FinishReason,
    RequestOutput,
    RequestState,
    SamplingParams,
    TokenLogprob,
)
from sparkinfer.errors import CapacityError, EngineFailed, EngineOverloaded, LifecycleError, ShapeError
from sparkinfer.models.tokenizer import ChatTemplateError

EOS = 257
VOCAB = 258


class ByteTokenizer:
    """ids = UTF-8 bytes; the tiny checkpoints' chat template ("role: content" lines, then
    "assistant: "), or none (chat=False: ChatTemplateError, as a checkpoint without one)."""

    def __init__(self, chat: bool = True):
        self.chat = chat

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not self.chat:
            raise ChatTemplateError("fake has no chat template: send a prompt to /v1/completions instead")
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


def expected_text(prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
    """What the fake answers to a text prompt, before stop strings."""
    ids = list(prompt.encode())
    n = max_tokens if ignore_eos else min(max_tokens, len(ids))
    return bytes(ids[i % len(ids)] for i in range(n)).decode(errors="replace")


@dataclass
class _Live:
    handle: RequestHandle
    generated: list[int] = field(default_factory=list)
    sent_chars: int = 0


class FakeEngine:
    """See the module docstring. step_s: seconds per step; max_context: positions per request."""

    eos_token_ids = (EOS,)

    def __init__(self, *, max_batch: int = 8, max_waiting: int = 64, max_context: int = 256, step_s: float = 0.002,
                 name: str = "fake-model", tokenizer=None, retry_after_s: float = 1.5):
        self.model_name, self.max_context = name, max_context
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        self.max_batch, self.max_waiting, self.step_s = max_batch, max_waiting, step_s
        self.retry_after_s = retry_after_s
        self.submitted: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self._waiting: deque[_Live] = deque()
        self._running: dict[str, _Live] = {}
        self._lock = threading.Condition()
        self._go = threading.Event()
        self._outbox: list | None = None  # a step's outputs, pushed together at its end
        self._go.set()
        self._closed = False
        self._error: str | None = None
        self._rank: int | None = None
        self._steps = 0
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ EngineClient
    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        prompt = list(prompt)
        with self._lock:
            if self._closed:
                raise LifecycleError("the fake engine is closed")
            if self._error is not None:
                raise EngineFailed(f"the engine failed: {self._error}", rank=self._rank)
            if not prompt or not all(0 <= t < VOCAB for t in prompt):
                raise ShapeError(f"prompt ids must be in [0, {VOCAB}) and at least one; got {prompt[:8]}...")
            if len(prompt) >= self.max_context:
                raise CapacityError(f"a prompt of {len(prompt)} tokens leaves no room in a context of "
                                    f"{self.max_context}")
            if len(self._waiting) >= self.max_waiting:
                raise EngineOverloaded(f"{len(self._waiting)} requests wait already (max_waiting)",
                                       retry_after_s=self.retry_after_s)
            handle = RequestHandle(request_id or new_request_id(), prompt, params)
            self.submitted.append((handle.request_id, prompt, params))
            self._waiting.append(_Live(handle))
            self._lock.notify_all()
            return handle

    def abort(self, request_id: str) -> None:
        with self._lock:
            live = self._running.pop(request_id, None)
            if live is None:
                live = next((w for w in self._waiting if w.handle.request_id == request_id), None)
                if live is not None:
                    self._waiting.remove(live)
            if live is not None:
                self.aborted.append(request_id)
                self._finish(live, FinishReason.ABORT, [])

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(running=len(self._running), waiting=len(self._waiting),
                               slots_used=len(self._running), slots_total=self.max_batch,
                               max_waiting=self.max_waiting, healthy=self._error is None, error=self._error,
                               steps=self._steps, mixed_steps=self._steps // 2)  # half: a number to carry

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for live in [*self._running.values(), *self._waiting]:
                self._finish(live, FinishReason.ABORT, [])
            self._running.clear()
            self._waiting.clear()
            self._lock.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------ test controls
    def pause(self) -> None:
        self._go.clear()

    def resume(self) -> None:
        with self._lock:
            self._go.set()
            self._lock.notify_all()

    def fail(self, rank: int) -> None:
        """A rank dies: every in-flight request ends with ERROR, the engine turns unhealthy."""
        with self._lock:
            self._error, self._rank = f"rank {rank} died (exit code -9)", rank
            for live in [*self._running.values(), *self._waiting]:
                self._finish(live, FinishReason.ERROR, [], error=self._error)
            self._running.clear()
            self._waiting.clear()

    # ------------------------------------------------------------ the "model"
    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                busy = self._error is None and (self._running or self._waiting)
                if busy:
                    self._admit()
                if not (busy and self._go.is_set()):
                    self._lock.wait(timeout=0.01)
                    continue
                self._step()
            time.sleep(self.step_s)  # the step's "compute", outside the lock

    def _admit(self) -> None:
        """Waiting requests into free slots (also while paused, so a test can fill the
        slots and then the queue without racing the steps)."""
        while self._waiting and len(self._running) < self.max_batch:
            live = self._waiting.popleft()
            live.handle.state = RequestState.RUNNING
            self._running[live.handle.request_id] = live

    def _step(self) -> None:
        """Every running request's next token, pushed together as the serving engine's reader
        pushes a step's outputs (`push_outputs`)."""
        self._steps += 1
        self._outbox = []
        try:
            for rid, live in list(self._running.items()):
                reason = self._next_token(live)
                if reason is not None:
                    del self._running[rid]
        finally:
            outbox, self._outbox = self._outbox, None
            push_outputs(outbox)

    def _push(self, handle, out: RequestOutput) -> None:
        if self._outbox is not None:
            self._outbox.append((handle, out))
        else:
            handle._push(out)

    def _next_token(self, live: _Live) -> FinishReason | None:
        h, p = live.handle, live.handle.params
        n = len(live.generated)
        tok = EOS if n == len(h.prompt) and not p.ignore_eos else h.prompt[n % len(h.prompt)]
        live.generated.append(tok)
        text = self.tokenizer.decode(live.generated)
        reason = None
        if tok == EOS or tok in p.stop_ids:
            reason = FinishReason.STOP
        cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, reason = text[:cut], FinishReason.STOP
        elif reason is None and (n + 1 >= p.max_new_tokens or len(h.prompt) + n + 1 >= self.max_context):
            reason = FinishReason.LENGTH
        hold = 0 if reason is not None else max((k for s in p.stop for k in range(1, len(s))
                                                 if text.endswith(s[:k])), default=0)
        delta, live.sent_chars = text[live.sent_chars:len(text) - hold], max(live.sent_chars, len(text) - hold)
        lp = None
        if p.logprobs is not None:
            top = tuple((t % VOCAB, -0.25 - i) for i, t in enumerate(range(tok, tok + p.logprobs)))
            lp = (TokenLogprob(tok, -0.25, top),)
        if reason is not None:
            self._finish(live, reason, [tok], text=delta, logprobs=lp)
        else:
            self._push(h, RequestOutput(h.request_id, (tok,), delta, lp, prompt_tokens=len(h.prompt),
                                        completion_tokens=len(live.generated)))
        return reason

    def _finish(self, live: _Live, reason: FinishReason, ids: list[int], *, text: str = "", logprobs=None,
                error: str | None = None) -> None:
        h = live.handle
        self._push(h, RequestOutput(h.request_id, tuple(ids), text, logprobs, finished=True, finish_reason=reason,
                                    error=error, prompt_tokens=len(h.prompt), completion_tokens=len(live.generated)))
