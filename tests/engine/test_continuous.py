"""Continuous batching on CPU ranks: requests arrive at given steps beside each other and
give the tokens and logits they give alone, bitwise.

Every rank runs the same in-process core (the serving engine's driver is tested in
test_serving.py): four requests, two cache slots, 8-token prefill chunks, so a prompt
of 11 tokens prefills in two steps while another request decodes; one greedy, two
seeded samplers (top-k, top-p), one aborted at step 3 whose slot the waiting one
takes. Each family at one configuration (TP 1, TP 2, TP 2 + DCP 2) keeps the runs to
about 30 interpreted forwards each. At TP 1 the same schedule also runs speculatively
(a self-draft of one layer, k = 2): its greedy request gives the plain tokens.
"""

import pytest
import torch

from sparkinfer.engine import EngineConfig, FinishReason, SamplingParams
from sparkinfer.engine.core import EngineCore, LocalExecutor
from sparkinfer.engine.runner import ModelRunner
from sparkinfer.engine.scheduler import SchedulerCaps
from sparkinfer.engine.session import ModelSession
from sparkinfer.runtime import run_ranks

CHUNK, SLOTS, CONTEXT = 8, 2, 32
# (arrival step, prompt, params, abort at step)
SCHEDULE = [
    (0, [7, 33, 90, 12, 55, 1, 2, 3, 99, 100, 42], SamplingParams(max_new_tokens=4), None),
    (0, [5, 6, 7, 8, 9, 10], SamplingParams(max_new_tokens=50), 3),
    (1, [60, 61, 62, 63, 64], SamplingParams(temperature=0.9, top_k=20, seed=7, max_new_tokens=4), None),
    (2, [11, 22, 33, 44, 55, 66, 77, 88, 99], SamplingParams(temperature=1.1, top_p=0.8, seed=3, max_new_tokens=3),
     None),
]
CASES = [("qwen3_moe-tiny", 1, 1), ("glm4_moe-tiny", 2, 1), ("mixtral-tiny", 2, 2)]


class _Plans(list):
    """The plans a core ran, in order, and their results (`results`)."""

    def __init__(self):
        super().__init__()
        self.results = []


class _Recorder:
    """A LocalExecutor that keeps every plan and its result."""

    def __init__(self, runner):
        self.inner, self.plans = LocalExecutor(runner), _Plans()

    def execute(self, plan):
        self.plans.append(plan)
        res = self.inner.execute(plan)
        self.plans.results.append(res)
        return res


def _run(runner, schedule, speculative=False, announce=0, slots=SLOTS):
    """Step a fresh core through `schedule`: (tokens, logits, finish reasons, plans) per request."""
    caps = SchedulerCaps(slots=slots, max_context=runner.max_context, chunk=CHUNK, step_tokens=CHUNK,
                         speculative=speculative, announce=announce)
    ex = _Recorder(runner)
    core = EngineCore(ex, caps)
    handles, tokens, reasons, logits = {}, {}, {}, {}
    step = 0
    while True:
        for i, (at, prompt, params, abort) in enumerate(schedule):
            if at == step:
                handles[i] = core.submit(prompt, params)
            if abort == step:
                core.abort(handles[i].request_id)
        busy = core.step()
        if busy and core.last_result.logits:
            for rid, rows in core.last_result.logits.items():
                logits.setdefault(rid, []).extend(rows)
        for i, h in handles.items():
            while (out := h.get(timeout=0)) is not None:
                tokens.setdefault(i, []).extend(out.token_ids)
                if out.finished:
                    reasons[i] = out.finish_reason
        step += 1
        if not busy and len(reasons) == len(schedule):
            break
        assert step < 200
    order = list(handles)  # submission order = the core's integer ids
    return tokens, {order[rid]: torch.stack(v) for rid, v in logits.items()}, reasons, ex.plans


def _worker(world, path, dcp):
    cfg = EngineConfig(model=str(path), tp=world.world_size, dcp=dcp, max_batch=SLOTS, prefill_chunk=CHUNK,
                       step_tokens=CHUNK,
                       self_draft=1 if world.world_size == 1 else 0, spec_k=2)
    s = ModelSession.for_config(world, cfg, CONTEXT)
    try:
        # alone: each step read back before the next is launched; mixed: each step's decode
        # launched ahead of its plan (logits kept, so launched after the reads); fast: launched
        # before the reads (no logits kept), as served
        ref = ModelRunner(s.engine, keep_logits=True, lookahead=False)
        alone = [_run(ref, [(0, p, params, None)]) for _, p, params, abort in SCHEDULE if abort is None]
        runner = ModelRunner(s.engine, keep_logits=True, lookahead=True)  # on the CPU too (default: GPU only)
        mixed = _run(runner, SCHEDULE)
        fast = None
        if world.world_size == 2 and dcp == 1:
            quick = ModelRunner(s.engine, lookahead=True)
            fast = (_run(quick, SCHEDULE)[0], quick.ahead_used)
        spec = _run(s.runner(), SCHEDULE, speculative=True) if s.speculative is not None else None
        return alone, mixed, spec, (ref.ahead_launched, runner.ahead_used, fast)
    finally:
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("family,world,dcp", CASES, ids=[f"{c[0]}_tp{c[1]}_dcp{c[2]}" for c in CASES])
def test_requests_give_their_solo_tokens_and_logits_beside_others(paths, family, world, dcp):
    check_results(run_ranks(_worker, world, backend="cpu", args=(paths[family], dcp), timeout_s=900))


def check_results(results) -> None:
    """The assertions of one launch's results (every rank's), on any device."""
    alone, (tokens, logits, reasons, plans), spec, (ref_ahead, used, fast) = results[0]
    assert ref_ahead == 0 and used > 0, "the mixed run took no step launched ahead"
    if fast is not None:
        assert fast[0] == tokens and fast[1] > 0, "steps launched before their reads give other tokens"
    for other in results[1:]:  # every rank ran the same plans and got the same bits
        assert other[1][0] == tokens and all(torch.equal(other[1][1][i].cpu(), logits[i].cpu()) for i in logits)
    kept = [i for i, s in enumerate(SCHEDULE) if s[3] is None]
    for (a_tokens, a_logits, _, _), i in zip(alone, kept):
        assert tokens[i] == a_tokens[0], f"request {i}: tokens beside others differ from alone"
        assert torch.equal(logits[i].cpu(), a_logits[0].cpu()), f"request {i}: logits beside others differ from alone"
        assert reasons[i] is FinishReason.LENGTH and len(tokens[i]) == SCHEDULE[i][2].max_new_tokens
    assert reasons[1] is FinishReason.ABORT
    # admission in arrival order; the aborted request's slot goes to the waiting one at the next step
    first = [(n, c.request, c.slot) for n, p in enumerate(plans) for c in p.prefill if c.start == 0]
    assert [r for _, r, _ in first] == [0, 1, 2, 3]
    # request 1 (slot 1) is aborted before step 3: request 2, waiting since step 1, takes slot 1 at step 3
    assert first[2] == (3, 2, 1), "the aborted request's slot is taken in the step after the abort"
    assert all(c.start % CHUNK == 0 for p in plans for c in p.prefill)
    assert any(p.decode and p.prefill for p in plans), "a prompt prefilled while another request decoded"
    if spec is not None:
        s_tokens, _, s_reasons, s_plans = spec
        assert s_tokens[0] == tokens[0], "speculative greedy tokens under continuous batching"
        assert s_reasons[1] is FinishReason.ABORT and all(len(s_tokens[i]) == len(tokens[i]) for i in kept)
