"""The engine loop: requests in, step plans to the ranks, outputs back to each request.

    core = EngineCore(LocalExecutor(runner), caps, tokenizer=tok, eos_ids=(2,))
    handle = core.submit([1, 2, 3], SamplingParams(max_new_tokens=8))   # any thread
    while core.step(): ...                                              # the loop's thread

`submit` and `abort` may be called from any thread: they go through an inbox that
the loop drains at the start of each step, so the scheduler is only ever touched
by the loop. A step is: drain the inbox, `Scheduler.schedule`, the executor runs
the plan on every rank, `Scheduler.update`, then each request's new tokens are
detokenized, checked against its stop strings and pushed to its handle. If the
executor fails (a rank died or stalled), every request ends with an error naming
the cause and the core refuses new ones.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from sparkinfer.engine.client import RequestHandle, new_request_id
from sparkinfer.engine.detok import TextStream
from sparkinfer.engine.request import (
    MAX_SEED,
    EngineStats,
    FinishReason,
    FirstTimings,
    RequestOutput,
    RequestState,
    SamplingParams,
)
from sparkinfer.engine.scheduler import SchedRequest, Scheduler, SchedulerCaps, Update, check_prompt
from sparkinfer.errors import EngineFailed, ShapeError

__all__ = ["EngineCore", "LocalExecutor", "GenerationResult", "generate_static", "check_request"]


def check_request(prompt, params: SamplingParams, *, vocab_size: int | None, tokenizer,
                  max_context: int | None = None) -> list[int]:
    """The prompt as a list of ints, once it is one the engine can run: ShapeError for a
    token id outside the vocabulary or stop strings without a tokenizer; with
    max_context, the scheduler's own refusals (`Scheduler.check_prompt`) too."""
    prompt = [int(t) for t in prompt]
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt):
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        raise ShapeError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if params.stop and tokenizer is None:
        raise ShapeError(f"stop={params.stop!r}: stop strings need the checkpoint's tokenizer")
    if max_context is not None:
        check_prompt(len(prompt), max_context)
    return prompt


class LocalExecutor:
    """Runs plans on a `ModelRunner` in this process (one rank, or every rank running its
    own identical core)."""

    def __init__(self, runner):
        self.runner = runner

    def execute(self, plan):
        return self.runner.execute(plan)

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Live:
    handle: RequestHandle
    text: TextStream | None
    sched: SchedRequest
    completion: int = 0
    prompt_tokens: int = 0
    submitted: float = 0.0  # perf_counter at receipt
    admitted: float | None = None  # at the start of the first step that ran its prompt, until its first token
    pickup: float | None = None  # the caller's send to the receipt (FirstTimings.pickup_s)


class EngineCore:
    """executor: runs a StepPlan on every rank and returns rank 0's StepResult; caps:
    the scheduler's capacities; tokenizer: for text and stop strings (None: text
    stays empty and stop strings are refused); eos_ids: end-of-sequence tokens;
    vocab_size: token ids a prompt may hold (None: unchecked); handle_type: the
    `RequestHandle` class submit() returns (the engine process's relays each output
    to the caller's process)."""

    def __init__(self, executor, caps: SchedulerCaps, *, tokenizer=None, eos_ids=(), vocab_size: int | None = None,
                 handle_type=RequestHandle):
        self.executor, self.caps, self.tokenizer = executor, caps, tokenizer
        self.handle_type = handle_type
        self.eos_ids = tuple(eos_ids)
        self.vocab_size = vocab_size
        self.sched = Scheduler(caps)
        self._ids = itertools.count()
        self._live: dict[int, _Live] = {}
        self._by_key: dict[str, int] = {}
        self._inbox: list = []
        self._lock = threading.Condition()
        self._rng = random.SystemRandom()
        self._singles: dict[int, str] = {}  # each token's text alone, shared by the requests' TextStreams
        self.error: str | None = None
        self.steps = self.mixed_steps = 0
        self.sched_s = 0.0  # host time in schedule() + update() + output processing, summed

    # ------------------------------------------------------------------ callers (any thread)
    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None, *,
               sent_at: float | None = None) -> RequestHandle:
        """Queue a request; raises as `EngineClient.submit` says. Never blocks on the model.
        sent_at: the caller's `time.monotonic()` when it sent the request from another process."""
        pickup = None if sent_at is None else max(0.0, time.monotonic() - sent_at)
        if self.error is not None:
            raise EngineFailed(f"the engine stopped: {self.error}")
        prompt = check_request(prompt, params, vocab_size=self.vocab_size, tokenizer=self.tokenizer)
        if params.seed is None:
            params = replace(params, seed=self._rng.randrange(MAX_SEED))
        stops = set(params.stop_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        rid = next(self._ids)
        key = request_id or new_request_id()
        handle = self.handle_type(key, prompt, params)
        sr = SchedRequest(rid, prompt, params, frozenset(stops))
        text = TextStream(self.tokenizer, prompt, params.stop, self._singles) if self.tokenizer is not None else None
        with self._lock:
            self.sched.add(sr)  # raises CapacityError / EngineOverloaded before anything is kept
            self._live[rid] = _Live(handle, text, sr, 0, len(prompt), time.perf_counter(), pickup=pickup)
            self._by_key[key] = rid
            self._lock.notify_all()
        return handle

    def abort(self, request_id: str) -> None:
        with self._lock:
            rid = self._by_key.get(request_id)
            if rid is not None:
                self._inbox.append(rid)
                self._lock.notify_all()

    def stats(self) -> EngineStats:
        with self._lock:
            waiting = len(self.sched.waiting)
            active = len(self.sched.active)
        return EngineStats(running=active, waiting=waiting, slots_used=active, slots_total=self.caps.slots,
                           max_waiting=self.caps.max_waiting, healthy=self.error is None, error=self.error,
                           steps=self.steps, mixed_steps=self.mixed_steps)

    def wait_for_work(self, timeout: float) -> None:
        with self._lock:
            if not self.sched.has_work and not self._inbox:
                self._lock.wait(timeout)

    # ------------------------------------------------------------------ the loop
    def step(self) -> bool:
        """One engine step; False when there was nothing to do."""
        t0 = time.perf_counter()
        with self._lock:
            aborts, self._inbox = self._inbox, []
            for rid in aborts:
                r = self.sched.abort(rid)
                if r is not None:
                    self._finish(rid, FinishReason.ABORT)
            plan = self.sched.schedule()
            if plan is not None:
                for c in plan.prefill:  # admitted: the handle says so until its first token
                    live = self._live.get(c.request)
                    if live is not None and live.handle.state is RequestState.WAITING:
                        live.handle.state = RequestState.PREFILLING
                        live.admitted = t0
        if plan is None:
            return False
        t1 = time.perf_counter()
        result = self.executor.execute(plan)  # a failure propagates: the caller fail()s with its best cause
        t2 = time.perf_counter()
        with self._lock:
            updates = self.sched.update(plan, result)
            for u in updates:
                self._emit(u)
        self.steps += 1
        self.mixed_steps += result.mixed
        self.sched_s += (t1 - t0) + (time.perf_counter() - t2)
        self.last_result = result
        return True

    def _emit(self, u: Update) -> None:
        live = self._live.get(u.request)
        if live is None:
            return
        reason = u.finish
        text = ""
        if live.text is not None:
            text, stopped = live.text.push(u.tokens, final=reason is not None)
            if stopped and reason is None:
                reason = FinishReason.STOP
                self.sched.abort(u.request, FinishReason.STOP)  # frees the slot for the next step
        live.completion += len(u.tokens)
        timings = None
        if live.admitted is not None and u.tokens:  # the first tokens: how long it queued, how long it prefilled
            timings = FirstTimings(live.admitted - live.submitted, time.perf_counter() - live.admitted, live.pickup,
                                   time.monotonic())
            live.admitted = None
        handle = live.handle
        if handle.state is not RequestState.FINISHED:
            handle.state = RequestState.RUNNING
        if reason is not None:
            self._drop(u.request)
        # a RequestOutput's fields: the engine process's handles send them as they are
        handle._push_fields((handle.request_id, u.tokens, text, u.logprobs, reason is not None, reason, None,
                             live.prompt_tokens, live.completion, timings, live.sched.reused))

    def _finish(self, rid: int, reason: FinishReason, error: str | None = None) -> None:
        live = self._live.get(rid)
        if live is None:
            return
        self._drop(rid)
        live.handle._push(RequestOutput(live.handle.request_id, (), "", None, True, reason, error,
                                        len(live.sched.prompt), live.completion, None, live.sched.reused))

    def _drop(self, rid: int) -> None:
        live = self._live.pop(rid, None)
        if live is not None:
            self._by_key.pop(live.handle.request_id, None)

    def fail(self, error: str) -> None:
        """End every request with `error` and refuse new ones (idempotent)."""
        with self._lock:
            if self.error is None:
                self.error = error
            for r in self.sched.requests():
                self.sched.abort(r.id, FinishReason.ERROR)
            for rid in list(self._live):
                self._finish(rid, FinishReason.ERROR, self.error)
            self._lock.notify_all()


@dataclass
class GenerationResult:
    """tokens: the new tokens of each sequence; prefill_s: wall seconds until every
    sequence had its first token; decode_s: the rest; decode_steps: steps that
    decoded; decode_tokens: tokens those steps produced; logits: with keep_logits,
    each sequence's fp32 logits [new tokens, V] (row 0 from the prefill), on the CPU.
    Speculative runs also count rounds, proposed and accepted draft tokens."""

    tokens: list[list[int]]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def generate_static(runner, prompts: list[list[int]], params: SamplingParams, *, on_token=None) -> GenerationResult:
    """Every prompt submitted at once to an in-process core over `runner`, stepped until
    all finish (every rank runs the same calls, so every rank's core makes the same
    plans). on_token(seq, token) sees each new token."""
    caps = SchedulerCaps(slots=runner.max_batch, max_context=runner.max_context, chunk=runner.prefill_chunk,
                         step_tokens=max(runner.prefill_chunk, sum(len(p) for p in prompts)),
                         max_waiting=max(len(prompts), 1), announce=runner.announce_tokens)
    core = EngineCore(LocalExecutor(runner), caps)
    handles = [core.submit(p, params) for p in prompts]
    res = GenerationResult([[] for _ in prompts])
    kept: list[list] = [[] for _ in prompts]
    ids = {h.request_id: i for i, h in enumerate(handles)}
    dev = runner.target.device
    t0 = time.perf_counter()
    started = None
    while core.step():
        step = core.last_result
        if step.decode:
            res.decode_steps += 1
            res.rounds += runner.draft is not None
        res.proposed += step.proposed
        res.accepted += step.accepted
        for h in handles:
            while (out := h.get(timeout=0)) is not None:
                i = ids[out.request_id]
                if on_token is not None:
                    for t in out.token_ids:
                        on_token(i, t)
                res.tokens[i] += out.token_ids
        if step.logits is not None:
            for rid, rows in step.logits.items():
                kept[rid] += rows
        if started is None and all(res.tokens[i] for i in range(len(prompts))):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            started = time.perf_counter()
            res.prefill_s = started - t0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    res.decode_s = time.perf_counter() - (started or t0)
    res.decode_tokens = sum(len(t) for t in res.tokens) - len(prompts)
    if runner.keep_logits:
        res.logits = [torch.stack(k) for k in kept]
    comm = runner.target.comm
    if comm is not None:
        comm.check()
    return res
