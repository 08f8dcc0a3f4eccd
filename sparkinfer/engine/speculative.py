"""Speculative decoding: a draft model proposes k tokens, the target verifies k + 1
positions in one forward (the round itself is `runner.ModelRunner._speculative`).

    spec = SpeculativeEngine(target_engine, draft_engine, k=3)
    result = spec.generate(prompts, SamplingParams(max_new_tokens=64))

Greedy output equals the target's plain greedy output; sampled output is distributed
as the target's. Draft and target steps are CUDA graphs on their engines' channels
("draft", "target"), one per (bucket, Q).
"""

from __future__ import annotations

from sparkinfer.engine.core import GenerationResult, generate_static
from sparkinfer.engine.engine import Engine
from sparkinfer.engine.request import SamplingParams
from sparkinfer.engine.runner import ModelRunner

__all__ = ["SpeculativeEngine", "SpeculativeResult"]

SpeculativeResult = GenerationResult  # rounds, proposed, accepted and acceptance are on every result


class SpeculativeEngine:
    """target, draft: Engines over the same ranks, vocabularies and slots (their caches
    must hold max_len + k + 2 positions); k: draft tokens per round (>= 1)."""

    def __init__(self, target: Engine, draft: Engine, k: int):
        self.runner = ModelRunner(target, draft, k)  # checks k, the slots and the vocabularies
        self.target, self.draft, self.k = target, draft, k

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, *,
                 on_token=None) -> GenerationResult:
        """New tokens for each prompt, every rank alike (a thin caller of the scheduler)."""
        return generate_static(self.runner, prompts, params or SamplingParams(), on_token=on_token)
