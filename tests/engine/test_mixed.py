"""Mixed steps (`Engine.launch_mixed`): a step's decode rows and the prompt chunks the
last plan announced in one forward, so the experts' weights are read once for both.
Each row keeps the bits it gets in a step of its own kind (decode rows: `linear` and a
decode graph; chunks: `gemm` and a prefill forward), and a served schedule gives each
request its tokens alone. On CPU ranks through the interpreter (steps launched ahead
forced on); on a GPU the serving benchmark runs them in CUDA graphs."""

import numpy as np
import pytest
import torch

from sparkinfer.engine import EngineConfig, SamplingParams
from sparkinfer.engine.plan import SamplingColumns
from sparkinfer.engine.session import ModelSession
from sparkinfer.errors import CapacityError
from sparkinfer.runtime import run_ranks
from tests.engine.test_continuous import SCHEDULE, _run

CHUNK, CONTEXT = 8, 32
HOT, GREEDY = SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.0)


def _one_forward(world, path):
    """A mixed launch against the same rows as a decode step and a prefill forward."""
    cfg = EngineConfig(model=str(path), max_batch=3, prefill_chunk=CHUNK, step_tokens=4 * CHUNK, mixed_steps=True)
    s = ModelSession.for_config(world, cfg, CONTEXT)
    eng, dec = s.engine, s.decoder
    try:
        for slot, prompt in ((0, [3, 4, 5, 6, 7]), (1, [9, 8, 7])):
            eng.prefill_rows([(prompt, 0, slot)], CHUNK)
        k0, v0 = dec.cache.k.clone(), dec.cache.v.clone()
        cols = SamplingColumns.of([HOT, GREEDY])
        slots, pos, toks = np.array([0, 1]), np.array([5, 3]), np.array([11, 12])
        chunks = [([20, 21, 22, 23, 24, 25, 26, 27], 0, 2), ([28, 29, 30], CHUNK, 2)]  # a prompt of two chunks
        lg, ids = eng.launch_decode(slots, pos, cols, tokens=toks)
        solo = (lg.clone(), ids.clone())
        pf = eng.prefill_rows(chunks, CHUNK)[1:].clone()
        solo_chunk = (pf, eng.sample_many(pf, [HOT], [CHUNK + 3]))
        solo_cache = dec.cache.k[:, :3].clone(), dec.cache.v[:, :3].clone()
        dec.cache.k.copy_(k0)
        dec.cache.v.copy_(v0)
        lg, ids = eng.launch_mixed(slots, pos, cols, chunks, SamplingColumns.of([GREEDY, HOT]), CHUNK, tokens=toks)
        d = eng.bucket(2)
        mixed = (lg[:2].clone(), ids[:2].clone(), lg[d + 1:d + 2].clone(), ids[d + 1:d + 2].tolist())
        mixed_cache = dec.cache.k[:, :3].clone(), dec.cache.v[:, :3].clone()
        try:
            eng.launch_mixed(slots, pos, cols, chunks * 3, SamplingColumns.of([HOT] * 6), CHUNK, tokens=toks)
            over = None
        except CapacityError as e:
            over = str(e)
        return solo, solo_chunk, solo_cache, mixed, mixed_cache, over
    finally:
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe-tiny", "glm4_moe-tiny"])
def test_a_mixed_step_gives_each_row_its_own_kind_of_bits(paths, family):
    check_one_forward(run_ranks(_one_forward, 1, backend="cpu", args=(paths[family],), timeout_s=900)[0])


def check_one_forward(result) -> None:
    """The assertions of `_one_forward`'s result, on any device."""
    solo, solo_chunk, solo_cache, mixed, mixed_cache, over = result
    assert torch.isfinite(solo[0]).all() and solo[0].abs().max() > 0
    assert torch.equal(mixed[0], solo[0]) and torch.equal(mixed[1], solo[1]), "decode rows in a mixed step"
    assert torch.equal(mixed[2], solo_chunk[0]) and mixed[3] == solo_chunk[1], "a prompt's last chunk"
    assert torch.equal(mixed_cache[0], solo_cache[0]) and torch.equal(mixed_cache[1], solo_cache[1]), "cache"
    assert over is not None and "mixed step" in over, "six chunks where two rows fit must be refused"


def _served(world, path):
    cfg = EngineConfig(model=str(path), tp=world.world_size, max_batch=2, prefill_chunk=CHUNK, step_tokens=CHUNK,
                       mixed_steps=True)
    s = ModelSession.for_config(world, cfg, CONTEXT)
    try:
        ref, runner = s.runner(), s.runner(mixed=True)
        ref.lookahead, runner.lookahead = False, True  # on the CPU too (default: GPU only)
        alone = [_run(ref, [(0, p, params, None)])[0][0] for _, p, params, abort in SCHEDULE if abort is None]
        hooked = []  # engine.profile's hook: "pre" before each launch ahead, then "post" or "none"
        runner.launch_hook = hooked.append
        tokens, _, reasons, plans = _run(runner, SCHEDULE, announce=runner.announce_tokens)
        marked = sum(r.mixed for r in plans.results)  # the results that say their chunks ran mixed
        paired = len(hooked) % 2 == 0 and set(hooked[::2]) == {"pre"} and set(hooked[1::2]) <= {"post", "none"}
        launched = (runner.ahead_launched, hooked.count("post"), paired)
        return alone, tokens, list(plans), (runner.announce_tokens, runner.mixed_launched, runner.chunks_taken, marked,
                                            launched)
    finally:
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("family,world", [("qwen3_moe-tiny", 1), ("mixtral-tiny", 2)])
def test_announced_chunks_run_beside_decode_rows_and_change_no_token(paths, family, world):
    check_served(run_ranks(_served, world, backend="cpu", args=(paths[family],), timeout_s=900))


def check_served(results) -> None:
    """The assertions of every rank's `_served` result, on any device."""
    alone, tokens, plans, (announce, mixed, taken, marked, (ahead, posts, paired)) = results[0]
    assert announce >= CHUNK and mixed > 0 and taken > 0 and marked == taken, (announce, mixed, taken, marked)
    assert ahead > 0 and posts == ahead and paired, "a launch ahead is one pre, then its post (or none)"
    assert any(p.next_prefill for p in plans) and any(p.decode and p.prefill for p in plans)
    for other in results[1:]:
        assert other[1] == tokens
    kept = [i for i, s in enumerate(SCHEDULE) if s[3] is None]
    for a, i in zip(alone, kept):
        assert tokens[i] == a, f"request {i}: tokens with announced chunks differ from alone"
