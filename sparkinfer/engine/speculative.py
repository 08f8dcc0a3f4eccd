"""Speculative decoding: a draft model proposes k tokens, the target verifies k + 1
positions in one forward.

    spec = SpeculativeEngine(target_engine, draft_engine, k=3)
    result = spec.generate(prompts, SamplingParams(max_new_tokens=64))

A round, per live sequence whose last token t sits at position p (not yet in any
cache) after token u at p - 1:
1. draft: one forward of [u, t] at [p - 1, p] (re-writing u's cache entry, so a
   round that accepted every proposal leaves no hole), then k - 1 forwards of
   one token: proposals d_1..d_k;
2. target: one forward of [t, d_1..d_k] at [p, p + k]: predictions y_0..y_k;
3. greedy: accept the longest prefix with d_j = y_{j-1} (m tokens), then y_m.
   Sampling: accept d_j with probability min(1, P(d_j) / Q(d_j)); at the first
   rejection draw from max(P - Q, 0) renormalized; after k acceptances draw the
   bonus from P (the standard rule; the output is distributed as the target's).
Caches need no rollback: positions past the accepted ones are rewritten before
any query can attend to them (attention reads positions <= the query's).
Draft and target steps are CUDA graphs on their engines' channels ("draft",
"target"), one per (bucket, Q).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparkinfer.engine.engine import Engine, GenerationResult
from sparkinfer.engine.sampling import SamplingParams, probabilities
from sparkinfer.errors import CapacityError, ShapeError

__all__ = ["SpeculativeEngine", "SpeculativeResult"]


@dataclass
class SpeculativeResult(GenerationResult):
    """GenerationResult plus rounds, proposed and accepted draft tokens."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class SpeculativeEngine:
    """target, draft: Engines over the same ranks, vocabularies and slots (their
    caches must hold max_len + k positions); k: draft tokens per round (>= 1)."""

    def __init__(self, target: Engine, draft: Engine, k: int):
        if k < 1:
            raise ShapeError(f"k={k}; a speculative round proposes at least one token")
        if draft.max_batch < target.max_batch:
            raise CapacityError(f"the draft engine takes {draft.max_batch} sequences, the target {target.max_batch}")
        if target.dec.spec.vocab_size != draft.dec.spec.vocab_size:
            raise ShapeError(f"target vocabulary {target.dec.spec.vocab_size} != draft "
                             f"{draft.dec.spec.vocab_size}: a draft must share the target's tokenizer")
        self.target, self.draft, self.k = target, draft, k

    def _accept(self, prop: list[int], verify_logits, draft_probs, params, r: int) -> list[int]:
        """New tokens of row r: the accepted proposals and one target token."""
        k = self.k
        if params.temperature == 0:
            y = verify_logits.argmax(dim=-1).tolist()
            m = 0
            while m < k and prop[m] == y[m]:
                m += 1
            return prop[:m] + [y[m]]
        p = probabilities(verify_logits, params)  # [k + 1, V]
        out = []
        for j in range(k):
            q = draft_probs[j][r]
            d = prop[j]
            if torch.rand(()).item() * q[d].item() <= p[j, d].item():  # u < P(d) / Q(d)
                out.append(d)
                continue
            resid = (p[j] - q).clamp_(min=0)
            total = resid.sum()
            dist = resid / total if total > 0 else p[j]
            return out + [int(torch.multinomial(dist, 1).item())]
        return out + [int(torch.multinomial(p[k], 1).item())]

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, *,
                 on_token=None) -> SpeculativeResult:
        """New tokens for each prompt, every rank alike; greedy output equals the target's plain greedy output."""
        params = params or SamplingParams()
        tgt, dft, k = self.target, self.draft, self.k
        tgt.check_prompts(prompts, extra=k + 2)
        dft.check_prompts(prompts, extra=k + 2)
        torch.manual_seed(params.seed)
        res = SpeculativeResult([[] for _ in prompts])
        t0 = time.perf_counter()
        last, prev = [], []
        for i, p in enumerate(prompts):
            logits = tgt.prefill(p, i)
            if len(p) > 1:
                dft.prefill(p[:-1], i)  # the round's first draft forward writes p[-1] itself
            last.append(int(torch.multinomial(probabilities(logits, params)[0], 1).item())
                        if params.temperature > 0 else int(logits[0].argmax()))
            prev.append(p[-1])
        res.prefill_s = time.perf_counter() - t0
        lengths = [len(p) for p in prompts]  # position of each sequence's `last` token
        limit = min(tgt.dec.cache.max_len, dft.dec.cache.max_len) - k - 1
        live = []
        for i in range(len(prompts)):
            if self._emit(res, i, [last[i]], params, on_token) and lengths[i] < limit:
                live.append(i)
        t0 = time.perf_counter()
        while live:
            pos = [lengths[i] for i in live]
            n, sampling = len(live), params.temperature > 0
            logits, ids = dft.step([[prev[i], last[i]] for i in live], [p - 1 for p in pos], live, params)
            props = [[ids[2 * r + 1]] for r in range(n)]
            draft_probs = [probabilities(logits.view(n, 2, -1)[:, 1], params)] if sampling else []
            for j in range(1, k):
                logits, ids = dft.step([[p[-1]] for p in props], [q + j for q in pos], live, params)
                for r in range(n):
                    props[r].append(ids[r])
                if sampling:
                    draft_probs.append(probabilities(logits, params))
            logits, _ = tgt.step([[last[i]] + props[r] for r, i in enumerate(live)], pos, live, params)
            logits = logits.view(len(live), k + 1, -1)
            res.rounds += 1
            for r, i in enumerate(list(live)):
                new = self._accept(props[r], logits[r], draft_probs, params, r)
                res.proposed += k
                res.accepted += len(new) - 1
                prev[i] = new[-2] if len(new) > 1 else last[i]
                last[i] = new[-1]
                lengths[i] += len(new)
                if not self._emit(res, i, new, params, on_token) or lengths[i] >= limit:
                    live.remove(i)
            res.decode_steps += 1
        if tgt.device.type == "cuda":
            torch.cuda.synchronize(tgt.device)
        res.decode_s = time.perf_counter() - t0
        res.decode_tokens = sum(len(t) for t in res.tokens) - len(prompts)
        return res

    @staticmethod
    def _emit(res, i: int, new: list[int], params: SamplingParams, on_token) -> bool:
        """Append new tokens to sequence i up to a stop token or max_new_tokens; False once it is done."""
        for tok in new:
            res.tokens[i].append(tok)
            if on_token is not None:
                on_token(i, tok)
            if tok in params.stop_ids or len(res.tokens[i]) >= params.max_new_tokens:
                return False
        return True
