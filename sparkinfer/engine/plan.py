"""The step plan: what every rank runs in one engine step, and what comes back.

Legend: R decode rows, C prefill chunks, k draft tokens per speculative round.

The scheduler (`scheduler.py`) decides; a plan says, in plain values, which slots
decode which token at which position with which sampling, and which prompt chunks
prefill into which slots. Every rank applies the same plan to its decoder
(`runner.py`) and so runs the same kernels and collectives in the same order; the
result (sampled tokens, log-probabilities) of any rank is every rank's, since the
logits are the same bits everywhere.

`encode_plan` / `decode_plan` (and the result pair) turn them into one flat int64
array and back: the record a shared-memory ring carries to the other ranks, with
no pickling per step.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from sparkinfer.engine.request import SamplingParams, TokenLogprob
from sparkinfer.errors import ShapeError

__all__ = ["DecodeRow", "PrefillChunk", "StepPlan", "RowResult", "StepResult", "encode_plan", "decode_plan",
           "encode_result", "decode_result"]


@dataclass(frozen=True)
class DecodeRow:
    """One decoding request: `token` (its last sampled token, not yet in the cache) at
    `position` in `slot`; `prev` the token before it (a speculative round's draft
    forward re-writes it). `request` is the engine's integer id of the request."""

    request: int
    slot: int
    position: int
    token: int
    prev: int
    params: SamplingParams


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens at positions start.. into `slot`; `last`: the prompt's final chunk,
    after which the request's first new token is drawn (with `params`)."""

    request: int
    slot: int
    start: int
    tokens: tuple[int, ...]
    last: bool
    params: SamplingParams


@dataclass(frozen=True)
class StepPlan:
    """Decode rows first (one step of the running batch), then prefill chunks in order.
    `shutdown` asks the ranks to leave their loop (no rows)."""

    step: int
    decode: tuple[DecodeRow, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    shutdown: bool = False

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass(frozen=True)
class RowResult:
    """The new tokens of one row (1, or 1..k + 1 from a speculative round; none for a
    prefill chunk that is not its prompt's last) and, when asked, their logprobs."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class StepResult:
    """`decode[i]` belongs to plan.decode[i], `prefill[j]` to plan.prefill[j]. proposed /
    accepted: draft tokens of this step's speculative rounds. logits: with
    keep_logits (in-process only), {request: [fp32 [V] per new token]}."""

    step: int
    decode: tuple[RowResult, ...] = ()
    prefill: tuple[RowResult, ...] = ()
    proposed: int = 0
    accepted: int = 0
    logits: dict | None = None


# ---------------------------------------------------------------------- codec
# Plan record: [MAGIC, step, shutdown, R, C, total chunk tokens], then R rows of
# _ROW words, C chunks of _CHUNK words, then the chunks' tokens. Sampling fields
# ride as words too (floats as their IEEE bits).
_MAGIC = 0x53504B50  # "SPKP"
_SAMPLING = 5  # temperature, top_p, top_k, seed, logprobs (-1: none)
_ROW = 5 + _SAMPLING
_CHUNK = 5 + _SAMPLING


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _i2f(w: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(w)))[0]


def _sampling_words(p: SamplingParams) -> list[int]:
    return [_f2i(p.temperature), _f2i(p.top_p), p.top_k, p.seed or 0, -1 if p.logprobs is None else p.logprobs]


_PARAMS: dict[tuple, SamplingParams] = {}  # a step's rows repeat the same few sampling words


def _sampling_from(w) -> SamplingParams:
    key = tuple(w)
    p = _PARAMS.get(key)
    if p is None:
        if len(_PARAMS) > 4096:  # seeds differ per request: bound the memo, not the requests
            _PARAMS.clear()
        p = _PARAMS[key] = SamplingParams(temperature=_i2f(w[0]), top_p=_i2f(w[1]), top_k=int(w[2]), seed=int(w[3]),
                                          logprobs=None if w[4] < 0 else int(w[4]))
    return p


def encode_plan(plan: StepPlan) -> np.ndarray:
    """int64 [n] record of a plan."""
    words = [_MAGIC, plan.step, int(plan.shutdown), len(plan.decode), len(plan.prefill),
             sum(len(c.tokens) for c in plan.prefill)]
    for r in plan.decode:
        words += [r.request, r.slot, r.position, r.token, r.prev] + _sampling_words(r.params)
    for c in plan.prefill:
        words += [c.request, c.slot, c.start, len(c.tokens), int(c.last)] + _sampling_words(c.params)
    for c in plan.prefill:
        words += c.tokens
    return np.asarray(words, dtype=np.int64)


def decode_plan(rec) -> StepPlan:
    """The plan of an `encode_plan` record (any int64 buffer of at least its length)."""
    w = np.frombuffer(rec, dtype=np.int64) if not isinstance(rec, np.ndarray) else rec
    if int(w[0]) != _MAGIC:
        raise ShapeError(f"decode_plan: not a step-plan record (first word {int(w[0]):#x})")
    step, shutdown, nr, nc, _ = (int(x) for x in w[1:6])
    o = 6
    rows = [DecodeRow(v[0], v[1], v[2], v[3], v[4], _sampling_from(v[5:]))
            for v in w[o:o + nr * _ROW].reshape(nr, _ROW).tolist()]
    o += nr * _ROW
    heads = w[o:o + nc * _CHUNK].reshape(nc, _CHUNK).tolist()
    o += nc * _CHUNK
    chunks = []
    for v in heads:
        toks = tuple(w[o:o + v[3]].tolist())
        o += v[3]
        chunks.append(PrefillChunk(v[0], v[1], v[2], toks, bool(v[4]), _sampling_from(v[5:])))
    return StepPlan(step, tuple(rows), tuple(chunks), bool(shutdown))


# Result record: [MAGIC, step, proposed, accepted, R, C], then per row: [n tokens,
# has logprobs, top n], its tokens, and with logprobs per token [logprob bits, then
# top n (id, logprob bits) pairs].
_RMAGIC = 0x53504B52  # "SPKR"


def encode_result(res: StepResult) -> np.ndarray:
    words = [_RMAGIC, res.step, res.proposed, res.accepted, len(res.decode), len(res.prefill)]
    for r in (*res.decode, *res.prefill):
        lp = r.logprobs
        top = len(lp[0].top) if lp else 0
        words += [len(r.tokens), int(lp is not None), top]
        words += list(r.tokens)
        for t in lp or ():
            words.append(_f2i(t.logprob))
            for i, v in t.top:
                words += [i, _f2i(v)]
    return np.asarray(words, dtype=np.int64)


def decode_result(rec) -> StepResult:
    w = np.frombuffer(rec, dtype=np.int64) if not isinstance(rec, np.ndarray) else rec
    if int(w[0]) != _RMAGIC:
        raise ShapeError(f"decode_result: not a step-result record (first word {int(w[0]):#x})")
    step, proposed, accepted, nr, nc = (int(x) for x in w[1:6])
    o = 6
    out = []
    for _ in range(nr + nc):
        n, has, top = (int(x) for x in w[o:o + 3])
        o += 3
        toks = tuple(w[o:o + n].tolist())
        o += n
        lps = None
        if has:
            lps = []
            for t in toks:
                lp = _i2f(w[o])
                pairs = w[o + 1:o + 1 + 2 * top].tolist()
                o += 1 + 2 * top
                lps.append(TokenLogprob(t, lp, tuple((pairs[2 * i], _i2f(pairs[2 * i + 1])) for i in range(top))))
            lps = tuple(lps)
        out.append(RowResult(toks, lps))
    return StepResult(step, tuple(out[:nr]), tuple(out[nr:]), proposed, accepted)
