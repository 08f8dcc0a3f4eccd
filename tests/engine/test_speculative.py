"""Greedy speculative decoding equals plain greedy decoding, token for token: each
family's tiny checkpoint (the decidable seeds of tests/models), a self-draft of the
target's first layer, k = 1, 3, 5 at TP = 1 and k = 3 at TP = 2 (CPU ranks), with a
max_new_tokens and a stop token that end sequences in the middle of a proposal."""

import pytest

from sparkinfer.engine import SamplingParams
from sparkinfer.engine.session import GenerateRequest, ModelSession
from sparkinfer.engine.speculative import SpeculativeEngine
from sparkinfer.models.presets import make_checkpoint
from sparkinfer.runtime import run_ranks
from tests.models.test_generation import PROMPTS, SEEDS

NEW = 10  # not a multiple of k + 1 for k = 1, 3, 5: the last round is cut short


def _worker(world, path, ks):
    req = GenerateRequest(str(path), PROMPTS, SamplingParams(max_new_tokens=NEW), max_len=40, self_draft=1,
                          spec_k=max(ks))
    s = ModelSession(world, req)
    try:
        plain = s.engine.generate(PROMPTS, req.params).tokens
        stop = plain[0][3]  # prompt 0 stops at this token's first place, mid-proposal; prompt 1 runs on
        stopped = s.engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, stop_ids=(stop,))).tokens
        out = {}
        for k in ks:
            spec = SpeculativeEngine(s.engine, s.speculative.draft, k)
            r1 = spec.generate(PROMPTS, req.params)
            r2 = spec.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, stop_ids=(stop,)))
            out[k] = (r1.tokens, r2.tokens, r1.proposed, r1.accepted)
        return plain, stopped, out
    finally:
        s.close()


CASES = [(fam, 1, (1, 3, 5)) for fam in SEEDS] + [(fam, 2, (3,)) for fam in SEEDS]


@pytest.mark.slow
@pytest.mark.parametrize("family,world,ks", CASES, ids=[f"{c[0]}_tp{c[1]}" for c in CASES])
def test_greedy_speculative_equals_greedy(tmp_path, family, world, ks):
    path = make_checkpoint(family, tmp_path / family, seed=SEEDS[family])
    results = run_ranks(_worker, world, backend="cpu", args=(path, ks), timeout_s=900)
    plain, stopped, out = results[0]
    first = plain[0].index(stopped[0][-1]) + 1
    assert all(len(t) == NEW for t in plain) and stopped[0] == plain[0][:first] and first < NEW
    for k, (tokens, tokens_stopped, proposed, accepted) in out.items():
        assert tokens == plain, f"k={k}"
        assert tokens_stopped == stopped, f"k={k} with a stop token"
        assert 0 <= accepted <= proposed
    assert all(r == results[0] for r in results[1:])  # every rank the same tokens
