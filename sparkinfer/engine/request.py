"""What a caller hands the engine and what it gets back: sampling parameters, a
request's state, and the outputs it streams.

Legend: V vocabulary.

    handle = engine.submit(prompt_ids, SamplingParams(temperature=0.7, seed=1, max_new_tokens=64))
    for out in handle:                  # or: async for out in handle
        print(out.text, end="")
    handle.finish_reason                # FinishReason.STOP / LENGTH / ABORT / ERROR

These types are plain data: the HTTP front end (`sparkinfer.serve`) and the
tests use them without touching ranks or kernels.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from sparkinfer.errors import ShapeError

__all__ = ["SamplingParams", "RequestState", "FinishReason", "TokenLogprob", "RequestOutput", "FirstTimings",
           "EngineStats", "merge_outputs", "MAX_LOGPROBS", "MAX_SEED", "MAX_TOP_K"]

# top-n logprobs a request may ask for (OpenAI's completions API allows 5, chat 20).
MAX_LOGPROBS = 20
# Seeds are 63-bit: they travel to every rank in an int64 field of the step plan.
MAX_SEED = (1 << 63) - 1
# The largest top_k a row carries (int32 on the device). A k at or above the vocabulary
# keeps every token, so a larger one is stored as this and means the same; unclamped,
# 2**32 + 1 wrapped to 1 (top-1 sampling) and 2**63 stopped the engine (OverflowError).
MAX_TOP_K = (1 << 31) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request draws its tokens.

    temperature: 0 is greedy (the first maximum); > 0 divides the logits.
    top_p: keep the smallest set of most likely tokens whose probability reaches
        top_p (1.0 keeps all). top_k: keep the k most likely (0, or k at or above
        the vocabulary, keeps all; stored as at most MAX_TOP_K).
    seed: the request's generator: token n is drawn with uniforms that depend on
        (seed, n) alone, so a seeded request samples the same tokens whatever else
        runs. None: the engine draws a seed at submission.
    max_new_tokens: new tokens at most. stop_ids: tokens that end the request
        (kept in its output). stop: strings that end it, matched on the detokenized
        text as it grows (the text stops before the match). ignore_eos: do not stop
        at the checkpoint's end-of-sequence tokens.
    logprobs: None for none; n >= 0 for the chosen token's log-probability and the
        n most likely tokens' (from the model's distribution before temperature and
        filtering).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0
    max_new_tokens: int = 32
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        bad = []
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            bad.append(f"temperature={self.temperature!r} (a finite number >= 0)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad.append(f"top_p={self.top_p!r} (in (0, 1])")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad.append(f"top_k={self.top_k!r} (an int >= 0; 0 keeps every token)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            bad.append(f"seed={self.seed!r} (an int in [0, 2**63), or None)")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad.append(f"max_new_tokens={self.max_new_tokens!r} (an int >= 1)")
        if not all(_is_int(t) and t >= 0 for t in self.stop_ids):
            bad.append(f"stop_ids={self.stop_ids!r} (token ids >= 0)")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad.append(f"stop={self.stop!r} (non-empty strings)")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad.append(f"logprobs={self.logprobs!r} (None, or an int in 0..{MAX_LOGPROBS})")
        if bad:
            raise ShapeError("SamplingParams: " + "; ".join(bad))
        object.__setattr__(self, "top_k", min(self.top_k, MAX_TOP_K))
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class RequestState(str, enum.Enum):
    """WAITING for a cache slot; PREFILLING its prompt (in chunks); RUNNING (decoding);
    FINISHED (see its FinishReason)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """STOP: a stop token, an end-of-sequence token or a stop string. LENGTH:
    max_new_tokens, or the context (cache positions) is full. ABORT: the caller
    aborted it. ERROR: the engine failed (a rank died or stalled); the output's
    `error` says what happened."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class TokenLogprob:
    """token_id: the chosen token; logprob: its log-probability; top: the n most
    likely (token id, log-probability) pairs, most likely first (n = the request's
    `logprobs`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class FirstTimings(NamedTuple):
    """Where a request's time to its first token went inside the engine, on its first
    output with tokens. queue_s: the engine's receipt to the start of the step that
    first ran its prompt; prefill_s: from there to this output. pickup_s: the caller's
    send to the engine's receipt, over the engine process's pipe and past the step in
    progress (None for an engine in the caller's process). emitted_at: `time.monotonic()`
    when the engine made this output (one clock for every process of a host), so the
    receiver's monotonic time less it is the way back (flush, pipe, reader thread)."""

    queue_s: float
    prefill_s: float
    pickup_s: float | None = None
    emitted_at: float | None = None


@dataclass(frozen=True)
class RequestOutput:
    """One increment of a request's output, as it streams.

    token_ids: the new tokens since the previous output; text: their new text (the
    detokenized text grows by this much; "" without a tokenizer; text held back
    while it may be the start of a stop string comes in a later output);
    logprobs: one per new token when the request asked for them, else None.
    finished / finish_reason / error: set on the last output of the request.
    prompt_tokens, completion_tokens: counts so far (for `usage`).
    timings: `FirstTimings` on a request's first output with tokens, else None.
    cached_tokens: prompt tokens whose cache entries the request found in its slot
    (prefix reuse, `engine/scheduler.py`), not computed again.
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: FirstTimings | None = None
    cached_tokens: int = 0


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput | None:
    """Consecutive outputs of one request as one: their tokens, text and logprobs joined,
    the last one's finish and counts. None for none."""
    if len(outs) <= 1:
        return outs[0] if outs else None
    last = outs[-1]
    lps = None if all(o.logprobs is None for o in outs) else tuple(t for o in outs for t in o.logprobs or ())
    return RequestOutput(last.request_id, tuple(t for o in outs for t in o.token_ids), "".join(o.text for o in outs),
                         lps, last.finished, last.finish_reason, last.error, last.prompt_tokens, last.completion_tokens,
                         next((o.timings for o in outs if o.timings is not None), None), last.cached_tokens)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and /health. running: requests holding a cache slot
    (prefilling or decoding); waiting: requests queued for one; slots_used /
    slots_total: cache slots; max_waiting: the queue bound beyond which submit
    refuses (EngineOverloaded); healthy: False once the engine failed (error says
    why); steps: engine steps run so far; mixed_steps: those whose prompt chunks ran
    beside decode rows in one forward (mixed steps); engine_cpu_s: CPU seconds the
    engine process has used (scheduler, detokenization, the pipe; 0 where the engine
    runs in the caller's process)."""

    running: int = 0
    waiting: int = 0
    slots_used: int = 0
    slots_total: int = 0
    max_waiting: int = 0
    healthy: bool = True
    error: str | None = None
    steps: int = 0
    mixed_steps: int = 0
    engine_cpu_s: float = 0.0
    extra: dict = field(default_factory=dict)
