"""Continuous batching: which requests decode and which prompt chunks prefill in each
engine step. Pure policy over plain values: it never touches tensors, ranks or text.

Legend: R decode rows of a step, C prompt tokens per chunk, k draft tokens per
speculative round.

    s = Scheduler(SchedulerCaps(slots=8, max_context=4096, chunk=256, step_tokens=512))
    s.add(SchedRequest(0, prompt, params, stops))
    plan = s.schedule()                  # a StepPlan, or None when there is nothing to do
    updates = s.update(plan, result)     # new tokens per request, and which finished

Policy:
- Admission is first come, first served: a waiting request takes a free cache slot
  (below: prefix reuse) as soon as one is free; nothing overtakes it (a long prompt at the head
  waits for a slot like any other). Beyond `max_waiting` queued requests, `add`
  refuses (EngineOverloaded): the queue never grows without bound.
- A step runs every decoding request once (one graph replay of R rows, or one
  speculative round), then prompt chunks of prefilling requests in admission order
  while the step's prompt-token budget lasts (at least one chunk per step, so a
  prompt always advances; a later prompt's chunk never runs before the chunk of an
  earlier one that did not fit); the budget bounds how long a step's prefill delays
  the running requests' next token (ITL).
- Announced chunks (`announce` > 0, set when the ranks run mixed steps): while requests
  decode, the chunks picked for a plan (at most `announce` tokens) are announced in it
  (`StepPlan.next_prefill`) and run in the next plan. A rank launches the next step's
  decode rows before that plan reaches it (`ModelRunner._look_ahead`), and with the
  announcement it launches the chunks in the same forward (`Engine.launch_mixed`), so
  the experts' weights are read once for both instead of again by a prefill forward of
  their own. A prompt's first token comes one step later than without; with nothing
  decoding, chunks run at once. Otherwise decode and prefill are separate forwards.
- A step's chunks run as the rows of one prefill forward (`ModelRunner`), whose cost is
  mostly reading every expert's weights once: on an H200 (prefill_h200.json) a forward
  of 8 chunks of 256 tokens took 6.9 ms and one of 1 chunk 2.9. So with
  `prefill_wait_steps` W > 0, while requests decode, prefill waits until its chunks fill
  a forward (step_tokens // C chunks) or the oldest has waited W steps; with nothing
  decoding it never waits (the GPU would idle). W = 0: every step prefills what it can
  (the serving default: W = 8 was no faster in `bench serve` on an H200,
  sweeps/serve_prefill_wait_h200.json, before mixed steps). With announced chunks a
  full forward is the announce budget's chunks (a mixed step's most), and the wait
  delays the announcement: a mixed step's marginal time per prompt token falls with
  its chunks (H200, Qwen3-30B-A3B, 8 layers, beside 64 decode rows: 3.32 / 2.53 /
  2.12 us for 1 / 2 / 4 chunks of 256 at add2f20, prefill_mixed_h200.json).
- A request's chunks start at multiples of C (0, C, 2C, ...), whatever else runs, so
  its prefill forwards and hence its logits depend on the request alone (batch
  invariance); the budget decides only how many chunks run in a step.
- A finished or aborted request frees its slot before the next step's admission.
- Prefix reuse (`reuse_prefix`): a freed slot keeps the cache entries its request's
  prompt chunks wrote (its first `prefilled` prompt tokens). A request admitted while
  such a slot is free takes the one whose kept prompt shares the longest prefix with
  its own, and starts prefilling after the shared whole chunks (at most its prompt
  less its last token, which must run for the first token's logits); otherwise the
  slot freed longest ago (a never-used one first), so recent prompts stay longest.
  A running request's prompt chunks serve too (a system prompt many conversations
  share): the plan copies them into the new request's slot (`StepPlan.copies`) before
  anything of it runs; its chunks never rewrite those positions.
  The next turn of a chat (its prompt: the last one, the reply, a new message) then
  prefills only from the last chunk boundary of the previous prompt. The kept entries
  are bitwise what the request would write itself: prompt chunks at the same
  multiples of C, each row's bits its own (generated tokens' entries, written by
  decode steps with other kernels, are never reused). Off with a draft model (its
  cache would need the same), and `SchedRequest.reused` says how many tokens a
  request found.

Each slot's decode row is kept in a table in the plan's column layout (`DecodeRows`),
written at admission and advanced as tokens come, so a step's rows are one masked
copy; a decode step's one-token results (`TokenRows`) advance it in bulk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from sparkinfer.engine.plan import DecodeRows, PrefillChunk, StepPlan, StepResult, TokenRows, sampling_words
from sparkinfer.engine.request import FinishReason, RequestState, SamplingParams, TokenLogprob
from sparkinfer.errors import CapacityError, EngineOverloaded, ShapeError

__all__ = ["SchedulerCaps", "SchedRequest", "Update", "Scheduler", "check_prompt"]


def check_prompt(n: int, max_context: int) -> None:
    """ShapeError for an empty prompt, CapacityError for one of n tokens that leaves no
    room for a new token in max_context positions."""
    if n == 0:
        raise ShapeError("the prompt is empty: give at least one token")
    if n + 1 > max_context:
        raise CapacityError(f"a prompt of {n} tokens leaves no room for a new token in a context of "
                            f"{max_context}; shorten it to at most {max_context - 1} "
                            "tokens or serve with a larger --max-context")


@dataclass(frozen=True)
class SchedulerCaps:
    """slots: cache slots for requests (max_batch). max_context: prompt + new tokens a
    request may hold. chunk: prompt tokens per prefill row (C). step_tokens:
    prompt tokens per step at most (at least one chunk runs). max_waiting: queue
    bound. speculative: decode rows run speculative rounds (their results carry
    1..k + 1 tokens). prefill_wait_steps: how long prefill may wait for a fuller
    forward while requests decode (0: never; see the module docstring). announce:
    prompt tokens a plan may announce for the next one (`StepPlan.next_prefill`; 0:
    none; see the module docstring). reuse_prefix: a request may start after the
    prompt chunks a freed slot kept (module docstring; never when speculative)."""

    slots: int
    max_context: int
    chunk: int = 256
    step_tokens: int = 512
    max_waiting: int = 64
    speculative: bool = False
    prefill_wait_steps: int = 0
    announce: int = 0
    reuse_prefix: bool = True

    def __post_init__(self):
        if self.slots < 1 or self.max_context < 2 or self.chunk < 1 or self.step_tokens < 1 or self.max_waiting < 0 \
                or self.prefill_wait_steps < 0:
            raise ShapeError(f"SchedulerCaps: slots={self.slots} (>= 1), max_context={self.max_context} (>= 2), "
                             f"chunk={self.chunk}, step_tokens={self.step_tokens} (>= 1), "
                             f"max_waiting={self.max_waiting}, prefill_wait_steps={self.prefill_wait_steps} (>= 0)")


@dataclass
class SchedRequest:
    """A request as the scheduler tracks it. id: the engine's integer id; stops: the
    token ids that end it (its stop_ids, plus the end-of-sequence ids unless
    ignore_eos); limit: the new tokens it may get (max_new_tokens, or fewer where the
    context ends first; set by `Scheduler.add`)."""

    id: int
    prompt: list[int]
    params: SamplingParams
    stops: frozenset = frozenset()
    state: RequestState = RequestState.WAITING
    slot: int = -1
    prefilled: int = 0
    out: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    limit: int = 0
    reused: int = 0
    first: tuple = ()  # its first chunk's tokens, once admitted (a later prompt's reuse candidates)


class Update(NamedTuple):
    """What one step did to one request: its new tokens (cut at a stop), their
    logprobs if asked, and the reason it finished (None while it runs). A named tuple:
    one is made per request per step."""

    request: int
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish: FinishReason | None


# Columns of the scheduler's row table (`DecodeRows` layout): a slot's decode row.
_POS, _TOKEN, _PREV = 2, 3, 4


class Scheduler:
    """The policy in the module docstring. Not thread-safe: the engine calls it from its
    one loop."""

    def __init__(self, caps: SchedulerCaps):
        self.caps = caps
        self.free = list(range(caps.slots))  # kept sorted (`_take_slot` picks among them)
        self.waiting: deque[SchedRequest] = deque()
        self.active: dict[int, SchedRequest] = {}  # holding a slot, in admission order
        self.steps = 0
        self.prefill_waited = 0  # steps the pending chunks have waited for a fuller forward
        # Each slot's decode row in the plan's layout, kept up to date as tokens come: a step's
        # rows are one masked copy, not a row object each (request, slot and sampling words
        # are written once, at admission). running: the slots whose request decodes.
        self._table = np.zeros((caps.slots, 10), dtype=np.int64)
        self._running = np.zeros(caps.slots, dtype=bool)
        self._announced: tuple[PrefillChunk, ...] = ()  # the last plan's next_prefill
        # prefix reuse: each free slot's kept (first chunk, prompt tokens), and the step it was
        # freed at (0: never used)
        self._kept: list[tuple[tuple, list[int]] | None] = [None] * caps.slots
        self._freed_at = [0] * caps.slots
        self._reuse = caps.reuse_prefix and not caps.speculative  # a draft's cache would need the same
        self._copies: list[tuple[int, int, int]] = []  # this plan's (source, destination, tokens)

    # ------------------------------------------------------------------ requests
    def add(self, req: SchedRequest) -> None:
        """Queue a request; CapacityError / ShapeError if it can never run, EngineOverloaded
        if the queue is full."""
        check_prompt(len(req.prompt), self.caps.max_context)
        if len(self.waiting) >= self.caps.max_waiting + max(0, len(self.free)):
            raise EngineOverloaded(f"{len(self.waiting)} requests are waiting (the bound is "
                                   f"{self.caps.max_waiting} beyond the free slots); retry later",
                                   retry_after_s=1.0)
        req.limit = min(req.params.max_new_tokens, self.caps.max_context - len(req.prompt))
        self.waiting.append(req)

    def abort(self, rid: int, reason: FinishReason = FinishReason.ABORT) -> SchedRequest | None:
        """End a waiting or active request now (its slot is free for the next step); the
        request, or None if it is unknown or already finished."""
        for r in self.waiting:
            if r.id == rid:
                self.waiting.remove(r)
                r.state, r.finish = RequestState.FINISHED, reason
                return r
        r = self.active.get(rid)
        if r is not None:
            self._release(r, reason)
        return r

    def _release(self, r: SchedRequest, reason: FinishReason) -> None:
        r.state, r.finish = RequestState.FINISHED, reason
        del self.active[r.id]
        self._running[r.slot] = False
        self.free.append(r.slot)
        self.free.sort()
        self._freed_at[r.slot] = self.steps + 1
        c = self.caps.chunk
        if self._reuse and r.prefilled >= c:  # whole chunks only: those are what a reuse takes
            self._kept[r.slot] = (r.first, r.prompt[:r.prefilled - r.prefilled % c])

    def _take_slot(self, r: SchedRequest) -> int:
        """The free slot for `r` (module docstring: the longest kept prefix of whole chunks,
        in place, or copied from a running request's prompt, else the slot freed longest
        ago); sets r.prefilled and r.reused to the tokens it finds. The slot's kept prompt
        is dropped: its request writes over it."""
        c, best, reused, source = self.caps.chunk, None, 0, None
        limit = len(r.prompt) - 1  # the last prompt token always runs: its logits give the first token
        if self._reuse and limit >= c:
            first = tuple(r.prompt[:c])
            kept = [(s, k[1]) for s in self.free if (k := self._kept[s]) is not None and k[0] == first]
            running = [(a.slot, a.prompt[:a.prefilled]) for a in self.active.values()
                       if a.prefilled >= c and a.first == first]
            for copy, candidates in ((False, kept), (True, running)):  # in place wins a tie
                for slot, prompt in candidates:
                    n = c
                    while n + c <= min(limit, len(prompt)) and r.prompt[n:n + c] == prompt[n:n + c]:
                        n += c
                    if n > reused:
                        best, reused, source = (None, n, slot) if copy else (slot, n, None)
        if best is None:
            best = min(self.free, key=lambda s: (self._freed_at[s], s))
        self.free.remove(best)
        self._kept[best] = None
        if source is not None:
            self._copies.append((source, best, reused))
        r.prefilled = r.reused = reused
        r.first = tuple(r.prompt[:c]) if self._reuse else ()
        return best

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def requests(self):
        """Every request not finished: waiting, then active."""
        return [*self.waiting, *self.active.values()]

    # ------------------------------------------------------------------ steps
    def schedule(self) -> StepPlan | None:
        self._copies = []
        while self.waiting and self.free:
            r = self.waiting.popleft()
            r.slot, r.state = self._take_slot(r), RequestState.PREFILLING
            self.active[r.id] = r
            self._table[r.slot] = [r.id, r.slot, 0, 0, 0, *sampling_words(r.params)]
        rows = DecodeRows(self._table[self._running])  # the decoding requests, in slot order
        # the chunks the last plan announced, of requests still prefilling
        ahead = tuple(c for c in self._announced if (r := self.active.get(c.request)) is not None
                      and r.state is RequestState.PREFILLING and c.slot == r.slot)
        self._announced = ()
        starts = {c.request: c.start + len(c.tokens) for c in ahead}
        announce = self.caps.announce > 0 and bool(rows)
        if announce:  # the next plan's chunks, from where the announced ones end
            chunks = self._chunks(min(self.caps.announce, self.caps.step_tokens), starts)
        else:
            left = self.caps.step_tokens - sum(len(c.tokens) for c in ahead)
            chunks = self._chunks(left, starts) if left > 0 or not ahead else []
        # a full forward: the chunks a mixed step holds where they are announced
        full = max(1, (min(self.caps.announce, self.caps.step_tokens) if announce else self.caps.step_tokens)
                   // self.caps.chunk)
        if rows and chunks and len(chunks) < full and self.prefill_waited < self.caps.prefill_wait_steps:
            self.prefill_waited += 1  # decode now; these chunks join a fuller forward later
            chunks = []
        elif chunks:
            self.prefill_waited = 0
        if announce and chunks:  # they run in the next plan, beside its decode rows
            self._announced, chunks = tuple(chunks), []
        prefill = ahead + tuple(chunks)
        if not rows and not prefill:
            return None
        self.steps += 1
        return StepPlan(self.steps, rows, prefill, next_prefill=self._announced, copies=tuple(self._copies))

    def _chunks(self, budget: int, planned: dict[int, int]) -> list[PrefillChunk]:
        """Prompt chunks in admission order while `budget` tokens last (at least one), each
        request from its prefilled position, or from planned[request] where a chunk of it
        is already planned."""
        chunks: list[PrefillChunk] = []
        for r in self.active.values():
            if r.state is not RequestState.PREFILLING:
                continue
            start = planned.get(r.id, r.prefilled)
            while start < len(r.prompt):
                end = min(start - start % self.caps.chunk + self.caps.chunk, len(r.prompt))
                if (chunks or planned) and end - start > budget:
                    break
                chunks.append(PrefillChunk(r.id, r.slot, start, tuple(r.prompt[start:end]), end == len(r.prompt),
                                           r.params))
                budget -= end - start
                start = end
            if budget <= 0 or start < len(r.prompt):  # a later prompt never overtakes one that did not fit
                break
        return chunks

    def update(self, plan: StepPlan, result: StepResult) -> list[Update]:
        """Apply a step's result: new tokens, stops, lengths. Returns one Update per request
        that got tokens or finished."""
        out = []
        active = self.active
        if isinstance(result.decode, TokenRows):  # one token a row: the table advances in bulk
            rows, ids = plan.decode.cols.copy(), result.decode.ids
            rows[:, _PREV] = rows[:, _TOKEN]
            rows[:, _TOKEN] = ids
            rows[:, _POS] += 1
            self._table[rows[:, 1]] = rows
            for rid, tok in zip(rows[:, 0].tolist(), ids.tolist()):
                r = active.get(rid)
                if r is not None:  # (aborted requests left between schedule and update)
                    out.append(self._append_one(r, tok))
        else:
            for rid, res in zip(plan.decode.request.tolist(), result.decode):
                r = active.get(rid)
                if r is not None:
                    out.append(self._append(r, res.tokens, res.logprobs))
                    self._track(r)
        for c, res in zip(plan.prefill, result.prefill):
            r = active.get(c.request)
            if r is None:
                continue
            r.prefilled = c.start + len(c.tokens)
            if c.last:
                r.state = RequestState.RUNNING
                out.append(self._append(r, res.tokens, res.logprobs))
                self._track(r)
        return out

    def _track(self, r: SchedRequest) -> None:
        """Write a running request's decode row (position, token, prev) into the table."""
        if r.state is RequestState.RUNNING:
            n = len(r.out)
            self._table[r.slot, _POS:_PREV + 1] = (len(r.prompt) + n - 1, r.out[-1],
                                                   r.out[-2] if n > 1 else r.prompt[-1])
            self._running[r.slot] = True

    def _append_one(self, r: SchedRequest, t: int) -> Update:
        """`_append` of one token without logprobs (a decode step's usual row)."""
        r.out.append(t)
        reason = None
        if t in r.stops:
            reason = FinishReason.STOP
        elif len(r.out) >= r.limit:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._release(r, reason)
        return Update(r.id, (t,), None, reason)

    def _append(self, r: SchedRequest, tokens, logprobs) -> Update:
        reason = None
        n = 0
        for t in tokens:
            r.out.append(t)
            n += 1
            if t in r.stops:
                reason = FinishReason.STOP
            elif len(r.out) >= r.limit:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        if reason is not None:
            self._release(r, reason)
        lps = tuple(logprobs[:n]) if logprobs is not None else None
        return Update(r.id, tuple(tokens[:n]), lps, reason)
