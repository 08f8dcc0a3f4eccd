"""Applies a step plan to one rank's model: the decode rows (a graph replay, or a
speculative round), then the prefill chunks. Every rank runs the same plan through
its runner and gets the same result.

Legend: R decode rows, k draft tokens per round, V vocabulary, P a row's position
(of its last sampled token, not yet in the cache).

A speculative round over rows whose last token t sits at P after token u at P - 1:
1. draft: one forward of [u, t] at [P - 1, P] (re-writing u's cache entry, so a
   round that accepted every proposal leaves no hole), then k - 1 forwards of one
   token: proposals d_1..d_k for positions P + 1..P + k;
2. target: one forward of [t, d_1..d_k] at [P, P + k]: its draws y_0..y_k;
3. greedy rows accept the longest prefix with d_j = y_{j-1} (m tokens), then y_m.
   Sampled rows accept d_j with probability min(1, p(d_j) / q(d_j)); at the first
   rejection they draw from max(p - q, 0) renormalized; after k acceptances the
   bonus is y_k (the standard rule: the output is distributed as the target's).
   Every draw uses the row's counter-based uniforms (`sampler.py`): streams DRAFT,
   TARGET, ACCEPT and RESIDUAL at the drawn token's position.
Caches need no rollback: positions past the accepted ones are rewritten before any
query attends to them (attention reads positions <= the query's).

A plain decode step is host work in bulk over the plan's columns (`DecodeRows`): the
step launched ahead is taken by one compare of whole rows, the next one is launched
from the rows advanced by one position, and the draws go back as one id array
(`TokenRows`). With objects a row (a list a row for the launch, a SamplingParams a row
for the sampling inputs, a RowResult a row) a rank's share of a batch-64 step (the plan
decoded, run, the result encoded) took 280 us on the 2-core CI machine; in bulk it
takes 66-77 us at any batch (`sparkinfer bench scheduler`, `rank_us`; docs/serving.md).
"""

from __future__ import annotations

import numpy as np
import torch

from sparkinfer.engine.plan import (
    DecodeRow,
    DecodeRows,
    PrefillChunk,
    RowResult,
    SamplingColumns,
    StepPlan,
    StepResult,
    TokenRows,
    sampling_words,
)
from sparkinfer.engine.request import SamplingParams, TokenLogprob
from sparkinfer.engine.sampler import STREAM_ACCEPT, STREAM_RESIDUAL, row_probabilities, uniforms
from sparkinfer.errors import CapacityError, ShapeError

__all__ = ["ModelRunner"]


class ModelRunner:
    """target: the `Engine` of the model; draft: the draft model's `Engine` (same slots
    and vocabulary) for speculative rounds of k proposals, or None. keep_logits:
    return each new token's fp32 logits (checks; in-process only). max_context: the
    positions a request may use (default: what the caches hold). prefill_chunk: prompt
    tokens per prefill row (default: the decoders' max_tokens, one row a forward); a
    step's chunks share forwards of up to max_tokens // prefill_chunk rows.
    lookahead: after each step, launch the next step's decode of the rows that continue
    before reading this step's ids (`_look_ahead`), so the GPU never waits for the
    host between steps (not with a draft: a round's rows need the host's accept rule).
    None: on a GPU only; on the CPU a launch runs the forward before it returns, so
    launching ahead overlaps nothing and only adds the forwards of rows that ended.
    mixed: with lookahead, a plan's announced chunks (`StepPlan.next_prefill`) run in
    the step launched ahead, one forward with its decode rows (`Engine.launch_mixed`).
    Not thread-safe: one plan at a time."""

    def __init__(self, target, draft=None, k: int = 0, *, keep_logits: bool = False,
                 max_context: int | None = None, prefill_chunk: int | None = None, lookahead: bool | None = None,
                 mixed: bool = False):
        if draft is not None:
            if k < 1:
                raise ShapeError(f"k={k}; a speculative round proposes at least one token")
            if draft.max_batch < target.max_batch:
                raise CapacityError(f"the draft engine takes {draft.max_batch} sequences, the target "
                                    f"{target.max_batch}")
            if target.dec.spec.vocab_size != draft.dec.spec.vocab_size:
                raise ShapeError(f"target vocabulary {target.dec.spec.vocab_size} != draft "
                                 f"{draft.dec.spec.vocab_size}: a draft must share the target's tokenizer")
        self.target, self.draft, self.k = target, draft, (k if draft is not None else 0)
        self.keep_logits = keep_logits
        self.max_batch = target.max_batch
        # positions a request may use: the verify forward writes up to P + k
        caches = [target.dec.cache.max_len] + ([draft.dec.cache.max_len] if draft is not None else [])
        self.max_context = min(caches) - (self.k + 2 if draft is not None else 0)
        if max_context is not None:  # a cache rounded up to whole prefill chunks holds more
            self.max_context = min(self.max_context, max_context)
        most = target.dec.max_tokens if draft is None else min(target.dec.max_tokens, draft.dec.max_tokens)
        if prefill_chunk is not None and not 1 <= prefill_chunk <= most:
            raise CapacityError(f"prefill_chunk={prefill_chunk}: 1..the decoders' max_tokens={most}")
        self.prefill_chunk = prefill_chunk or most
        if lookahead is None:
            lookahead = torch.device(target.device).type == "cuda"
        self.lookahead = lookahead and draft is None
        self.mixed = mixed
        self._ahead: _Ahead | None = None
        self.ahead_launched = self.ahead_used = 0  # steps launched ahead; those a plan took
        self.mixed_launched = self.chunks_taken = 0  # of those, mixed steps; plans whose chunks they ran
        self.launch_hook = lambda kind: None  # "pre" / "post" a launch ahead, or "none" (engine.profile)

    def warm_up(self) -> None:
        """Capture every decode graph this runner can replay (collective)."""
        if self.draft is None:
            self.target.capture_all((1,), self.prefill_chunk, mixed=self.mixes)
        else:
            self.target.capture_all((self.k + 1,), self.prefill_chunk)
            self.draft.capture_all((1, 2), self.prefill_chunk)

    def execute(self, plan: StepPlan) -> StepResult:
        for src, dst, n in plan.copies:  # before this plan's chunks and the next one's launched ahead
            self.target.copy_prefix(src, dst, n)
        kept = {} if self.keep_logits else None
        ahead, self._ahead = self._ahead, None
        if self.draft is not None:
            decode = self._speculative(plan.decode) if plan.decode else ()
            step = _Launched(self.max_context)
            if plan.prefill:
                self._prefill_launch(plan.prefill, step)
                self._draft_prefill(plan.prefill)
            _, prefill, _ = step.finish(plan, kept)
            return StepResult(plan.step, decode, prefill, self.k * len(plan.decode),
                              sum(len(r.tokens) - 1 for r in decode), kept)
        step = _Launched(self.max_context)
        took = bool(plan.prefill) and self._take_chunks(plan.prefill, ahead, step)
        if plan.decode:
            self._decode(plan.decode, ahead, step)
        if plan.prefill and not took:
            self._prefill_launch(plan.prefill, step)
        # logprobs and kept logits read the decode step's logits, which the next launch overwrites
        reads_logits = (kept is not None or plan.decode.logprobs_wanted
                        or any(c.params.logprobs is not None for c in plan.prefill))
        if self.lookahead and not reads_logits:
            self._ahead = self._look_ahead(plan, step)
        decode, prefill, fed = step.finish(plan, kept)
        if self.lookahead and reads_logits:
            self._ahead = self._look_ahead(plan, step)
        if self._ahead is not None:
            self._ahead.feed(fed)
        return StepResult(plan.step, decode, prefill, 0, 0, kept, mixed=took)

    # ------------------------------------------------------------------ pieces
    def _decode(self, rows: DecodeRows, ahead: _Ahead | None, step: _Launched) -> None:
        """The decode rows' draws: the step launched ahead when it holds every row (same
        request, slot, position, tokens and sampling), else one launched now."""
        go = rows.position < self.max_context - 1  # [R]: the rows that continue after this step
        step.go = None if go.all() else go
        picked = ahead.pick(rows, self.target.launches) if ahead is not None else None
        if picked is not None:
            self.ahead_used += 1
            step.decode = (ahead.logits, ahead.ids, picked, ahead.host)
            if isinstance(picked, slice):  # these rows' sampling is the launch's: so is its filter
                step.filtered = ahead.sampling.filtered
            return
        logits, ids = self.target.launch_decode(rows.slot, rows.position, rows.sampling, tokens=rows.token)
        step.decode = (logits, ids, slice(0, len(rows)), _to_host(ids))

    def _look_ahead(self, plan: StepPlan, step: _Launched) -> _Ahead | None:
        """Launch the next step's decode before this one's ids reach the host: every row that
        continues (this step's decode rows and the chunks that end their prompts), fed its
        draw on the device. The next plan usually holds these rows, or some of them (a
        request finished); a row's draws do not depend on its neighbours (batch
        invariance), so the plan's rows take theirs from this launch. A row that ended
        wrote one cache entry past its end, which a later owner of the slot rewrites
        before reading (attention reads positions up to the query's)."""
        self.launch_hook("pre")
        nexts, feeds = [], []  # the next plan's rows as `DecodeRows` columns (tokens once fed)
        if step.decode is not None:
            _, ids, picked, _ = step.decode
            go = step.go
            rows = plan.decode.cols.copy() if go is None else plan.decode.cols[go]
            rows[:, _PREV] = rows[:, _TOKEN]
            rows[:, _POS] += 1
            nexts.append(rows)
            if len(rows):
                feeds.append(_gather(ids, picked if go is None else np.arange(ids.shape[0])[picked][go]))
        if step.prefill is not None:
            ends, ids, _ = step.prefill
            keep = [j for j, i in enumerate(ends) if _prompt_end(plan.prefill[i]) < self.max_context]
            chunks = [plan.prefill[ends[j]] for j in keep]
            nexts.append(np.array([[c.request, c.slot, _prompt_end(c), 0, c.tokens[-1], *sampling_words(c.params)]
                                   for c in chunks], dtype=np.int64).reshape(-1, 10))
            if keep:
                feeds.append(_gather(ids, slice(0, len(keep)) if keep[-1] == len(keep) - 1 else np.array(keep)))
        if not feeds:
            self.launch_hook("none")
            return None
        rows = nexts[0] if len(nexts) == 1 else np.concatenate(nexts)
        # the plan's own decode rows, every one continuing: their sampling, so their filter if known
        same = step.decode is not None and step.go is None and len(rows) == len(plan.decode)
        sampling = SamplingColumns(rows[:, 5:], step.filtered if same else None)
        fed = feeds[0] if len(feeds) == 1 else torch.cat(feeds)
        chunks = plan.next_prefill if self._mixes(plan.next_prefill, len(rows)) else ()
        if chunks:  # the next plan's chunks beside its decode rows: the experts are read once for both
            logits, ids = self.target.launch_mixed(
                rows[:, 1], rows[:, _POS], sampling, [(list(c.tokens), c.start, c.slot) for c in chunks],
                SamplingColumns.of([c.params for c in chunks]), self.prefill_chunk, device_tokens=fed)
        else:
            logits, ids = self.target.launch_decode(rows[:, 1], rows[:, _POS], sampling, device_tokens=fed)
        self.ahead_launched += 1
        self.launch_hook("post")
        host = _to_host(ids)
        ahead = _Ahead(rows, sampling, (logits, ids, host), self.target.launches, self.target.dec.cache.slots)
        if chunks:
            self.mixed_launched += 1
            d = self.target.bucket(len(rows))
            ahead.chunks = ({_chunk_key(c): j for j, c in enumerate(chunks)}, logits[d:], ids[d:], host, d)
        return ahead

    @property
    def mixes(self) -> bool:
        """Whether this runner runs a plan's announced chunks beside the next step's decode
        rows (`Engine.launch_mixed`): with steps launched ahead, on a decoder that can."""
        return self.mixed and self.lookahead and bool(self.target.mixed_rows(1, self.prefill_chunk))

    @property
    def announce_tokens(self) -> int:
        """Prompt tokens a plan may announce (`SchedulerCaps.announce`): what the mixed step
        beside the largest decode bucket holds; 0 when this runner does not mix."""
        if not self.mixes:
            return 0
        return max(self.target.mixed_rows(self.max_batch, self.prefill_chunk), default=0) * self.prefill_chunk

    def _mixes(self, chunks: tuple[PrefillChunk, ...], rows: int) -> bool:
        """Whether `chunks` run beside `rows` decode rows in one mixed step: a bucket holds
        them, every one fits a chunk row, and none asks for logprobs (read from logits
        the next launch would overwrite)."""
        if not chunks or not self.mixes:
            return False
        fits = [r for r in self.target.mixed_rows(rows, self.prefill_chunk) if r >= len(chunks)]
        return bool(fits) and all(len(c.tokens) <= self.prefill_chunk and c.params.logprobs is None
                                  and not self.keep_logits for c in chunks)

    def _take_chunks(self, chunks: tuple[PrefillChunk, ...], ahead: _Ahead | None, step: _Launched) -> bool:
        """The plan's chunks from the step launched ahead, when it ran every one of them
        (announced by the last plan) and its outputs are current."""
        if ahead is None or ahead.chunks is None or ahead.launches != self.target.launches:
            return False
        at, logits, ids, (host, ev), _ = ahead.chunks
        idx = [at.get(_chunk_key(c)) for c in chunks]
        if any(i is None for i in idx):
            return False
        ends = [i for i, c in enumerate(chunks) if c.last]
        if ends:
            sel = np.asarray([idx[i] for i in ends], dtype=np.int64)
            step.prefill = (ends, _gather(ids, sel), _gather(logits, sel))  # never a blocking copy
            step.prefill_host = (host, ev, sel + ahead.chunks[4])
        self.chunks_taken += 1
        return True

    def _forwards(self, engine, chunks: list[tuple]) -> list:
        """The prefill forwards of `chunks` (tokens, start, slot) through `engine`; each chunk's
        last-token logits [V]. Rows of Q tokens: the chunk size with graphs (one captured
        forward per row bucket), else the longest chunk (no padding to compute); a chunk
        whose padded row would pass the cache's end (start + Q > its positions: a cache not
        sized in whole chunks, `ModelSession` sizes it so) runs at its own length. Any Q
        gives a row the same bits (batch invariance). As many rows a forward as the largest
        bucket holds."""
        room = engine.dec.cache.max_len
        q = self.prefill_chunk if engine.graphs else max(len(c[0]) for c in chunks)
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(chunks):
            groups.setdefault(q if c[1] + q <= room else len(c[0]), []).append(i)
        out = [None] * len(chunks)
        for ql, idx in groups.items():
            most = engine.prefill_buckets(ql)[-1]
            for j in range(0, len(idx), most):
                part = idx[j:j + most]
                for i, lg in zip(part, engine.prefill_rows([chunks[i] for i in part], ql)):
                    out[i] = lg
        return out

    def _prefill_launch(self, chunks: tuple[PrefillChunk, ...], step: _Launched) -> None:
        """Every chunk of the step in as few forwards as the prefill buckets allow, then one
        draw (on the device) for the chunks that end their prompts."""
        logits = self._forwards(self.target, [(list(c.tokens), c.start, c.slot) for c in chunks])
        ends = [i for i, c in enumerate(chunks) if c.last]
        if not ends:
            return
        lg = torch.stack([logits[i] for i in ends])
        ids = self.target.sample_many(lg, [chunks[i].params for i in ends],
                                      [chunks[i].start + len(chunks[i].tokens) for i in ends], on_device=True)
        step.prefill = (ends, ids, lg)
        step.prefill_host = _to_host(ids)

    def _draft_prefill(self, chunks: tuple[PrefillChunk, ...]) -> None:
        """The chunks through the draft model. Its cache stops one short: a round's first draft
        forward writes the last prompt token."""
        rows = [(list(c.tokens[:-1] if c.last else c.tokens), c.start, c.slot) for c in chunks]
        rows = [r for r in rows if r[0]]
        if rows:
            self._forwards(self.draft, rows)

    def _speculative(self, rows: DecodeRows) -> tuple[RowResult, ...]:
        rows = tuple(rows)  # a round's host work is per row anyway (the accept rule)
        tgt, dft, k = self.target, self.draft, self.k
        n = len(rows)
        pos = [r.position for r in rows]
        slots = [r.slot for r in rows]
        params = [r.params for r in rows]
        sampled = [not p.greedy for p in params]
        logits, ids = dft.step([[r.prev, r.token] for r in rows], [p - 1 for p in pos], slots, params)
        props = [[ids[2 * i + 1]] for i in range(n)]
        q = [[] for _ in rows]  # the draft's distributions of sampled rows, per proposal
        _keep_probs(q, logits.view(n, 2, -1)[:, 1], params, sampled)
        for j in range(1, k):
            logits, ids = dft.step([[p[-1]] for p in props], [x + j for x in pos], slots, params)
            for i in range(n):
                props[i].append(ids[i])
            _keep_probs(q, logits, params, sampled)
        vlogits, vids = tgt.step([[r.token] + props[i] for i, r in enumerate(rows)], pos, slots, params)
        vlogits = vlogits.view(n, k + 1, -1)
        out = []
        for i, r in enumerate(rows):
            y = vids[i * (k + 1):(i + 1) * (k + 1)]
            new = _accept_sampled(props[i], q[i], vlogits[i], y, r) if sampled[i] else _accept_greedy(props[i], y)
            lps = _logprobs(vlogits[i, :len(new)], new, [r.params.logprobs] * len(new))
            out.append(RowResult(tuple(new), None if r.params.logprobs is None else tuple(lps)))
        return tuple(out)


_POS, _TOKEN, _PREV = 2, 3, 4  # `DecodeRows` columns


def _chunk_key(c: PrefillChunk) -> tuple:
    return c.request, c.slot, c.start, c.tokens


def _prompt_end(c: PrefillChunk) -> int:
    return c.start + len(c.tokens)


def _gather(ids: torch.Tensor, idx: np.ndarray | slice) -> torch.Tensor:
    """ids[idx] (rows) on the device: a view for a slice (the usual step), else one
    index_select, its index copied from pinned memory (torch.tensor cannot pin an array numpy
    owns): a pageable copy waits for the stream, the step launched ahead too (at f0db8a7 each
    plan after a mixed step blocked 3.6 ms so, sweeps/serve_step_profile_h100.json)."""
    if isinstance(idx, slice):
        return ids[idx]
    idx = np.asarray(idx, dtype=np.int64)
    index = torch.empty(idx.shape[0], dtype=torch.int64, pin_memory=ids.device.type == "cuda")
    index.numpy()[:] = idx
    return ids.index_select(0, index.to(ids.device, non_blocking=True))


def _to_host(ids: torch.Tensor):
    """A copy of ids on the host, taken in stream order (before a later launch overwrites
    them) without waiting: (tensor, event to wait on, or None on the CPU)."""
    if ids.device.type != "cuda":
        return ids.clone(), None
    host = ids.to("cpu", non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return host, ev


def _host_ids(host) -> np.ndarray:
    """int64 [n]: the ids of a `_to_host` copy, once it has landed (with a third item, an
    index array: those of them)."""
    t, ev = host[:2]
    if ev is not None:
        ev.synchronize()
    return t.numpy() if len(host) == 2 else t.numpy()[host[2]]


class _Ahead:
    """A decode step launched before its plan: `rows`, the plan rows it expects (`DecodeRows`
    columns; their tokens once `feed` gives them) and their `sampling` as launched, its
    device logits and ids with the ids' host copy (`out`), the engine's launch count after
    it (its outputs are current while the count holds) and the cache's slot count."""

    def __init__(self, rows: np.ndarray, sampling: SamplingColumns, out: tuple, launches: int, slots: int):
        self.rows, self.sampling, self.slots = rows, sampling, slots
        self.logits, self.ids, self.host = out
        self.launches = launches
        self.fed = False
        # with announced chunks beside the rows: ({chunk key: j}, logits, ids from the
        # rows' bucket D on, the ids' host copy, D)
        self.chunks: tuple | None = None

    def feed(self, tokens: np.ndarray) -> None:
        """The rows' tokens: the draws of the step before, once read back."""
        self.rows[:, _TOKEN] = tokens
        self.fed = True

    def pick(self, rows: DecodeRows, launches: int) -> np.ndarray | slice | None:
        """Each plan row's index here (a slice when they are these rows in order), or None if
        any row is not one of these. One compare of whole rows; a slot not held maps to -1,
        the last row, whose slot differs."""
        if launches != self.launches or not self.fed:
            return None
        if len(rows) == len(self.rows) and (self.rows == rows.cols).all():  # the usual step: all, in order
            return slice(0, len(rows))
        at = np.full(self.slots, -1, dtype=np.int64)  # slot -> row here, -1: none
        at[self.rows[:, 1]] = np.arange(len(self.rows))
        idx = at[rows.slot]
        return idx if (self.rows[idx] == rows.cols).all() else None


class _Launched:
    """One step's launched work, read back by `finish`: decode (logits, ids, row indices
    into them, host copy of the ids) with `go` (the decode rows that continue after the
    step, None for all) and `filtered`, and prefill (the chunks that end their prompts,
    their ids, their logits)."""

    def __init__(self, max_context: int):
        self.max_context = max_context
        self.decode: tuple | None = None
        self.go: np.ndarray | None = None
        self.filtered: bool | None = None  # whether the decode rows filter, when known
        self.prefill: tuple | None = None
        self.prefill_host = None

    def finish(self, plan: StepPlan, kept):
        """The plan's RowResults (decode, prefill) and the draws fed to the step launched
        ahead (in `_look_ahead`'s row order), int64 [n]."""
        decode: tuple[RowResult, ...] | TokenRows = ()
        fed = []
        if self.decode is not None:
            logits, _, picked, host = self.decode
            ids = _host_ids(host)[picked]
            if kept is not None or plan.decode.logprobs_wanted:
                decode = _results(plan.decode, _gather(logits, picked), ids.tolist(), kept)
            else:
                decode = TokenRows(ids)
            fed.append(ids if self.go is None else ids[self.go])
        prefill = [RowResult()] * len(plan.prefill)
        if self.prefill is not None:
            ends, _, lg = self.prefill
            ids = _host_ids(self.prefill_host).tolist()
            done = _results([plan.prefill[i] for i in ends], lg, ids, kept)
            more = []
            for j, i in enumerate(ends):
                prefill[i] = done[j]
                if _prompt_end(plan.prefill[i]) < self.max_context:
                    more.append(ids[j])
            fed.append(np.array(more, dtype=np.int64))
        return decode, tuple(prefill), fed[0] if len(fed) == 1 else np.concatenate(fed or [np.zeros(0, np.int64)])


def _results(rows, logits, ids: list[int], kept) -> tuple[RowResult, ...]:
    lps = _logprobs(logits, ids, [r.params.logprobs for r in rows])
    if kept is not None:
        for i, r in enumerate(rows):
            kept[r.request] = [logits[i].float().cpu()]
    return tuple(RowResult((ids[i],), None if lps[i] is None else (lps[i],)) for i in range(len(rows)))


def _keep_probs(q: list, logits, params: list[SamplingParams], sampled: list[bool]) -> None:
    for i, s in enumerate(sampled):
        if s:
            q[i].append(row_probabilities(logits[i:i + 1], params[i])[0].cpu())


def _accept_greedy(props: list[int], y: list[int]) -> list[int]:
    m = 0
    while m < len(props) and props[m] == y[m]:
        m += 1
    return props[:m] + [y[m]]


def _accept_sampled(props: list[int], q: list, vlogits, y: list[int], row: DecodeRow) -> list[int]:
    """Accepted proposals and one more token for a sampled row (see the module docstring)."""
    p_all = row_probabilities(vlogits, row.params).cpu()  # [k + 1, V]
    seed = row.params.seed or 0
    out = []
    for j, d in enumerate(props):
        at = row.position + 1 + j  # the position this proposal would take
        p, qj = p_all[j], q[j]
        u = float(uniforms(seed, at, STREAM_ACCEPT, 1)[0])
        if u * float(qj[d]) <= float(p[d]):
            out.append(d)
            continue
        resid = (p - qj).clamp_(min=0)
        if float(resid.sum()) > 0:
            g = -torch.log(-torch.log(uniforms(seed, at, STREAM_RESIDUAL, resid.shape[0])))
            return out + [int((torch.log(resid) + g).argmax())]
        return out + [y[j]]  # p == q: the target's own draw is a draw from p
    return out + [y[len(props)]]


def _logprobs(logits: torch.Tensor, chosen: list[int], tops: list) -> list[TokenLogprob | None]:
    """Per row: None where tops[i] is None, else the chosen token's log-probability and
    the tops[i] most likely (from the raw logits, before temperature). One sync."""
    want = [i for i, n in enumerate(tops) if n is not None]
    out: list[TokenLogprob | None] = [None] * len(tops)
    if not want:
        return out
    idx = torch.tensor(want, device=logits.device)
    ls = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
    ch = ls.gather(1, torch.tensor([chosen[i] for i in want], device=logits.device)[:, None])[:, 0].tolist()
    n_top = max(tops[i] for i in want)
    tv, ti = ls.topk(max(n_top, 1), dim=-1) if n_top else (None, None)
    tv = tv.tolist() if tv is not None else None
    ti = ti.tolist() if ti is not None else None
    for a, i in enumerate(want):
        top = tuple(zip(ti[a][:tops[i]], tv[a][:tops[i]])) if tops[i] else ()
        out[i] = TokenLogprob(chosen[i], ch[a], top)
    return out
