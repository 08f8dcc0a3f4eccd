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

Decode rows travel as columns (`DecodeRows`: one int64 array [R, 10], the record's
own layout) and a decode step's draws as one id array (`TokenRows`): the scheduler
writes them in bulk, the codecs copy them whole and the ranks read them in bulk. A
row as an object (`DecodeRow`, `RowResult`) is built only when indexed. With one
object a row, the four codecs of a batch-64 decode step took about 300 us of its 940
us host path on the 2-core CI machine (a profile of `sparkinfer bench scheduler`'s
host path; docs/serving.md).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sparkinfer.engine.request import SamplingParams, TokenLogprob
from sparkinfer.errors import ShapeError

__all__ = ["DecodeRow", "DecodeRows", "SamplingColumns", "PrefillChunk", "StepPlan", "RowResult", "TokenRows",
           "StepResult", "encode_plan", "decode_plan", "encode_result", "decode_result", "sampling_words",
           "RESULT_HEAD", "PLAN_HEAD"]


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


# Sampling fields ride as int64 words: temperature and top_p as their IEEE bits, top_k,
# seed, logprobs (-1: none).
_SAMPLING = 5
_ONE_BITS = int(np.float64(1.0).view(np.int64))  # top_p = 1.0 as its word
_ROW = 5 + _SAMPLING  # request, slot, position, token, prev, then the sampling words
_CHUNK = 5 + _SAMPLING


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _i2f(w: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(w)))[0]


def sampling_words(p: SamplingParams) -> list[int]:
    """The 5 int64 words of p's sampling fields (what a row's draws depend on)."""
    return [_f2i(p.temperature), _f2i(p.top_p), p.top_k, p.seed or 0, -1 if p.logprobs is None else p.logprobs]


class SamplingColumns:
    """N rows' sampling fields as columns of int64 words [N, 5] (`sampling_words`); the
    fields are views of them, not copies. Rows with equal words draw alike."""

    __slots__ = ("words", "_filtered")

    def __init__(self, words: np.ndarray, filtered: bool | None = None):
        self.words = words
        self._filtered = filtered  # `filtered`, when the caller knows it

    @classmethod
    def of(cls, params: list[SamplingParams]) -> SamplingColumns:
        return cls(np.array([sampling_words(p) for p in params], dtype=np.int64).reshape(-1, _SAMPLING))

    def __len__(self) -> int:
        return self.words.shape[0]

    @property
    def temperature(self) -> np.ndarray:  # fp64 [N]
        return self.words[:, 0].view(np.float64)

    @property
    def top_p(self) -> np.ndarray:  # fp64 [N]
        return self.words[:, 1].view(np.float64)

    @property
    def top_k(self) -> np.ndarray:
        return self.words[:, 2]

    @property
    def seed(self) -> np.ndarray:
        return self.words[:, 3]

    @property
    def logprobs(self) -> np.ndarray:  # -1: none
        return self.words[:, 4]

    @property
    def filtered(self) -> bool:
        """Whether any row applies top-k / top-p (`RowSampling.needs_filter`). Computed on the
        words (a double >= 0 orders as its bits do): 4 us a call on the 2-core CI machine,
        6.5 through the float views."""
        if self._filtered is None:
            w = self.words
            self._filtered = bool(((w[:, 0] > 0) & ((w[:, 1] < _ONE_BITS) | (w[:, 2] > 0))).any())
        return self._filtered

    def repeat(self, q: int) -> SamplingColumns:
        """Each row q times (a row of q tokens draws q times with its parameters)."""
        return self if q == 1 else SamplingColumns(np.repeat(self.words, q, axis=0))


class _Rows(Sequence):
    """A column store that reads as a tuple of row objects (built when indexed): equal to
    any sequence of equal rows, and `+` a tuple gives a tuple."""

    __slots__ = ()
    __hash__ = None

    def __eq__(self, other):
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __add__(self, other):
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}{tuple(self)!r}"


class DecodeRows(_Rows):
    """R decode rows as the columns of one int64 array [R, 10]: request, slot, position,
    token, prev, then the sampling words. Indexing gives a `DecodeRow` (its params hold
    the sampling fields alone); the scheduler and the runner read the columns."""

    __slots__ = ("cols", "_logprobs")

    def __init__(self, cols: np.ndarray):
        self.cols = cols
        self._logprobs: bool | None = None

    @classmethod
    def of(cls, rows) -> DecodeRows:
        return cls(np.array([[r.request, r.slot, r.position, r.token, r.prev, *sampling_words(r.params)]
                             for r in rows], dtype=np.int64).reshape(-1, _ROW))

    def __len__(self) -> int:
        return self.cols.shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return DecodeRows(self.cols[i])
        return _row(self.cols[i].tolist())

    def __iter__(self):
        return map(_row, self.cols.tolist())

    request = property(lambda self: self.cols[:, 0])
    slot = property(lambda self: self.cols[:, 1])
    position = property(lambda self: self.cols[:, 2])
    token = property(lambda self: self.cols[:, 3])
    prev = property(lambda self: self.cols[:, 4])

    @property
    def sampling(self) -> SamplingColumns:
        return SamplingColumns(self.cols[:, 5:])

    @property
    def logprobs_wanted(self) -> bool:
        """Whether any row asks for logprobs."""
        if self._logprobs is None:
            self._logprobs = bool((self.cols[:, 9] >= 0).any())
        return self._logprobs


def _row(v: list[int]) -> DecodeRow:
    return DecodeRow(v[0], v[1], v[2], v[3], v[4], _sampling_from(v[5:]))


_NO_ROWS = DecodeRows(np.zeros((0, _ROW), dtype=np.int64))
_NO_ROWS.cols.setflags(write=False)  # shared by every plan without decode rows
_NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class StepPlan:
    """Decode rows first (one step of the running batch), then prefill chunks in order.
    `shutdown` asks the ranks to leave their loop (no rows). `decode` is held as
    `DecodeRows` whatever sequence of `DecodeRow`s it is given. next_prefill: the
    chunks the next plan will prefill (announced, so a rank may run them beside the
    next step's decode rows that it launches ahead; the next plan still lists them).
    copies: (source slot, destination slot, tokens): the cache entries of positions
    [0, tokens) copied from one slot to another, in order, before anything else of the
    plan runs (prefix reuse from a running request, `scheduler.py`)."""

    step: int
    decode: DecodeRows = field(default_factory=lambda: _NO_ROWS)
    prefill: tuple[PrefillChunk, ...] = ()
    shutdown: bool = False
    next_prefill: tuple[PrefillChunk, ...] = ()
    copies: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self):
        if not isinstance(self.decode, DecodeRows):
            object.__setattr__(self, "decode", DecodeRows.of(self.decode) if self.decode else _NO_ROWS)
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "next_prefill", tuple(self.next_prefill))
        object.__setattr__(self, "copies", tuple(tuple(c) for c in self.copies))

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass(frozen=True)
class RowResult:
    """The new tokens of one row (1, or 1..k + 1 from a speculative round; none for a
    prefill chunk that is not its prompt's last) and, when asked, their logprobs."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None


class TokenRows(_Rows):
    """The results of R decode rows that drew one token each and asked no logprobs, as
    int64 ids [R]; indexing gives a `RowResult`."""

    __slots__ = ("ids",)

    def __init__(self, ids: np.ndarray):
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return TokenRows(self.ids[i])
        return RowResult((int(self.ids[i]),))

    def __iter__(self):
        return (RowResult((t,)) for t in self.ids.tolist())


@dataclass(frozen=True)
class StepResult:
    """`decode[i]` belongs to plan.decode[i], `prefill[j]` to plan.prefill[j]. proposed /
    accepted: draft tokens of this step's speculative rounds. logits: with
    keep_logits (in-process only), {request: [fp32 [V] per new token]}. mixed: the
    step's prompt chunks ran in the forward of the decode rows launched before it
    (`ModelRunner`, mixed steps)."""

    step: int
    decode: tuple[RowResult, ...] | TokenRows = ()
    prefill: tuple[RowResult, ...] = ()
    proposed: int = 0
    accepted: int = 0
    logits: dict | None = None
    mixed: bool = False


# ---------------------------------------------------------------------- codec
# Plan record: [MAGIC, step, shutdown, R, C, total chunk tokens, N, K], then the R rows'
# columns (_ROW words a row), C + N chunks of _CHUNK words (the plan's, then the N it
# announces), their tokens, then K copies of 3 words (source, destination, tokens).
_MAGIC = 0x53504B50  # "SPKP"
PLAN_HEAD = 8  # words of the plan record's header


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
    chunks = plan.prefill + plan.next_prefill
    head = [_MAGIC, plan.step, int(plan.shutdown), len(plan.decode), len(plan.prefill),
            sum(len(c.tokens) for c in chunks), len(plan.next_prefill), len(plan.copies)]
    if not chunks and not plan.copies:  # a decode step: the header and the rows' columns
        return np.concatenate((np.asarray(head, dtype=np.int64), plan.decode.cols.ravel()))
    words = []
    for c in chunks:
        words += [c.request, c.slot, c.start, len(c.tokens), int(c.last)] + sampling_words(c.params)
    for c in chunks:
        words += c.tokens
    for c in plan.copies:
        words += c
    return np.concatenate((np.asarray(head, dtype=np.int64), plan.decode.cols.ravel(),
                           np.asarray(words, dtype=np.int64)))


def decode_plan(rec) -> StepPlan:
    """The plan of an `encode_plan` record (any int64 buffer of at least its length; its
    rows are views into it)."""
    w = np.frombuffer(rec, dtype=np.int64) if not isinstance(rec, np.ndarray) else rec
    if int(w[0]) != _MAGIC:
        raise ShapeError(f"decode_plan: not a step-plan record (first word {int(w[0]):#x})")
    step, shutdown, nr, nc, _, nn, nk = w[1:PLAN_HEAD].tolist()
    o = PLAN_HEAD
    rows = DecodeRows(w[o:o + nr * _ROW].reshape(nr, _ROW))
    o += nr * _ROW
    if not nc and not nn and not nk:
        return StepPlan(step, rows, (), bool(shutdown))
    heads = w[o:o + (nc + nn) * _CHUNK].reshape(nc + nn, _CHUNK).tolist()
    o += (nc + nn) * _CHUNK
    chunks = []
    for v in heads:
        toks = tuple(w[o:o + v[3]].tolist())
        o += v[3]
        chunks.append(PrefillChunk(v[0], v[1], v[2], toks, bool(v[4]), _sampling_from(v[5:])))
    copies = tuple(map(tuple, w[o:o + 3 * nk].reshape(nk, 3).tolist()))
    return StepPlan(step, rows, tuple(chunks[:nc]), bool(shutdown), tuple(chunks[nc:]), copies)


# Result record: [MAGIC, step, proposed, accepted, R, C, one], then with one = 1 the R
# decode rows' ids (`TokenRows`), then per row (every row with one = 0, else the
# prefill rows): [n tokens, has logprobs, top n], its tokens, and with logprobs per
# token [logprob bits, then top n (id, logprob bits) pairs].
_RMAGIC = 0x53504B52  # "SPKR"
RESULT_HEAD = 8  # words of the result record's header


def encode_result(res: StepResult) -> np.ndarray:
    one = isinstance(res.decode, TokenRows)
    head = np.asarray([_RMAGIC, res.step, res.proposed, res.accepted, len(res.decode), len(res.prefill), int(one),
                       int(res.mixed)], dtype=np.int64)
    if one and not res.prefill:  # a decode step
        return np.concatenate((head, res.decode.ids))
    words = []
    for r in (res.prefill if one else (*res.decode, *res.prefill)):
        lp = r.logprobs
        top = len(lp[0].top) if lp else 0
        words += [len(r.tokens), int(lp is not None), top]
        words += list(r.tokens)
        for t in lp or ():
            words.append(_f2i(t.logprob))
            for i, v in t.top:
                words += [i, _f2i(v)]
    return np.concatenate((head, res.decode.ids if one else _NO_IDS, np.asarray(words, dtype=np.int64)))


def decode_result(rec) -> StepResult:
    """The result of an `encode_result` record (its `TokenRows` are views into it)."""
    w = np.frombuffer(rec, dtype=np.int64) if not isinstance(rec, np.ndarray) else rec
    if int(w[0]) != _RMAGIC:
        raise ShapeError(f"decode_result: not a step-result record (first word {int(w[0]):#x})")
    step, proposed, accepted, nr, nc, one, mixed = w[1:RESULT_HEAD].tolist()
    mixed = bool(mixed)
    o = RESULT_HEAD
    ids = None
    if one:
        ids = TokenRows(w[o:o + nr])
        o += nr
        if not nc:
            return StepResult(step, ids, (), proposed, accepted, mixed=mixed)
    out = []
    for _ in range(nc if one else nr + nc):
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
    if one:
        return StepResult(step, ids, tuple(out), proposed, accepted, mixed=mixed)
    return StepResult(step, tuple(out[:nr]), tuple(out[nr:]), proposed, accepted, mixed=mixed)
