"""Prefix reuse as scheduling policy (results faked): a request takes the free slot
whose kept prompt shares its longest prefix of whole chunks, starts after them, and
never reuses what it must compute itself (its last prompt token, generated tokens'
entries, a slot another request wrote). The bits of the model's outputs under reuse
are checked on CPU ranks in test_prefix_reuse_ranks.py."""

from __future__ import annotations

from sparkinfer.engine.request import SamplingParams
from sparkinfer.engine.scheduler import SchedRequest, Scheduler, SchedulerCaps
from tests.engine.test_scheduler import _fake

C = 8


def _serve(s: Scheduler, *reqs: SchedRequest) -> list:
    """Add `reqs`, step until every request finished; the plans' prefill chunks (request,
    slot, start) in order."""
    for r in reqs:
        s.add(r)
    chunks = []
    while (plan := s.schedule()) is not None:
        chunks += [(c.request, c.slot, c.start) for c in plan.prefill]
        s.update(plan, _fake(plan))
    return chunks


def _req(i: int, prompt: list[int], new: int = 2) -> SchedRequest:
    return SchedRequest(i, list(prompt), SamplingParams(max_new_tokens=new), frozenset())


def _caps(**kw) -> SchedulerCaps:
    return SchedulerCaps(**{"slots": 3, "max_context": 128, "chunk": C, "step_tokens": 64, **kw})


def test_a_chats_next_turn_starts_after_the_last_prompts_whole_chunks():
    s = Scheduler(_caps())
    turn1 = list(range(1, 21))  # 20 tokens: 2 whole chunks kept (16), the last 4 recomputed
    a = _req(0, turn1)
    assert _serve(s, a) == [(0, 0, 0), (0, 0, 8), (0, 0, 16)] and a.reused == 0
    turn2 = turn1 + [70, 71] + list(range(30, 45))  # the reply and a new message after it
    b = _req(1, turn2)
    assert _serve(s, b) == [(1, 0, 16), (1, 0, 24), (1, 0, 32)] and b.reused == 16
    # what b leaves: its own whole prompt chunks (32 of 37), the 16 it found included
    c = _req(2, turn2 + [5])
    assert _serve(s, c)[0] == (2, 0, 32) and c.reused == 32


def test_the_last_prompt_token_always_runs_and_generated_tokens_are_never_reused():
    s = Scheduler(_caps())
    p = list(range(1, 17))  # exactly 2 chunks
    _serve(s, _req(0, p, new=5))
    same = _req(1, p)  # the same prompt: its last chunk runs again (its last token gives the first token)
    assert _serve(s, same) == [(1, 0, 8)] and same.reused == 8
    # a prompt made of p and the first generated tokens: only p's chunks are kept (a decode
    # step wrote the generated tokens' entries, with other kernels than a prompt chunk's)
    s2 = Scheduler(_caps())
    a = _req(0, list(range(1, 13)), new=9)
    _serve(s2, a)
    longer = _req(1, a.prompt + a.out + [1, 2, 3])
    assert _serve(s2, longer)[0] == (1, 0, 8) and longer.reused == 8


def test_the_longest_kept_prefix_wins_else_the_slot_freed_longest_ago():
    s = Scheduler(_caps())
    base = list(range(1, 9))
    short, long_ = base + [50] * 8 + [1], base + [60] * 8 + [61] * 8 + [2]
    # three requests in three slots, freed in order 0, 1, 2 (their lengths)
    _serve(s, _req(0, short, new=1), _req(1, long_, new=2), _req(2, [9] * 20, new=3))
    assert s._freed_at[0] < s._freed_at[1] < s._freed_at[2]
    r = _req(3, long_[:-1] + [3, 4])  # shares 24 tokens with slot 1's, 8 with slot 0's
    assert _serve(s, r)[0] == (3, 1, 24) and r.reused == 24
    # a prompt that shares nothing takes the slot freed longest ago (slot 0), leaving slot 2's
    fresh = _req(4, [77] * 12)
    assert _serve(s, fresh)[0] == (4, 0, 0) and fresh.reused == 0
    again = _req(5, [9] * 20)
    assert _serve(s, again)[0] == (5, 2, 16)


def test_a_slot_taken_by_another_request_keeps_nothing_of_the_first():
    s = Scheduler(_caps(slots=1))
    p = list(range(1, 25))
    _serve(s, _req(0, p))
    assert _serve(s, _req(1, [5] * 10)) == [(1, 0, 0), (1, 0, 8)]  # writes over slot 0
    r = _req(2, p)
    assert _serve(s, r)[0] == (2, 0, 0) and r.reused == 0


def test_an_aborted_prompt_keeps_only_the_chunks_that_ran():
    s = Scheduler(_caps(step_tokens=C))  # one chunk a step
    p = list(range(1, 41))
    s.add(_req(0, p))
    for _ in range(2):  # two of its five chunks
        plan = s.schedule()
        s.update(plan, _fake(plan))
    s.abort(0)
    r = _req(1, p)
    assert _serve(s, r)[0] == (1, 0, 16) and r.reused == 16


def test_no_reuse_when_off_or_speculative():
    p = list(range(1, 25))
    for caps in (_caps(reuse_prefix=False), _caps(speculative=True)):
        s = Scheduler(caps)
        _serve(s, _req(0, p))
        r = _req(1, p + [1])
        assert _serve(s, r)[0] == (1, 1, 0) and r.reused == 0  # slot 1: never used, so taken first


def test_outputs_and_usage_say_how_many_prompt_tokens_were_found():
    from sparkinfer.engine.core import EngineCore
    from sparkinfer.serve.handlers import _usage

    class Answers:  # every plan answered at once
        def execute(self, plan):
            return _fake(plan)

    core = EngineCore(Answers(), _caps())
    first = core.submit(list(range(1, 21)), SamplingParams(max_new_tokens=2))
    while core.step():
        pass
    second = core.submit(list(range(1, 21)) + [5, 6], SamplingParams(max_new_tokens=2))
    while core.step():
        pass
    outs, again = first.result(), second.result()
    assert {o.cached_tokens for o in outs} == {0} and {o.cached_tokens for o in again} == {16}
    usage = _usage([again[-1]]).model_dump()
    assert usage == {"prompt_tokens": 22, "completion_tokens": 2, "total_tokens": 24,
                     "prompt_tokens_details": {"cached_tokens": 16}}


def test_a_running_requests_prompt_chunks_are_copied_into_a_new_slot():
    """A system prompt many conversations share: a request admitted while another with
    the same first chunks runs copies them (`StepPlan.copies`, before anything of the plan
    runs) and starts after them; a kept prefix in a free slot of the same length wins
    (no copy)."""
    from sparkinfer.engine.plan import decode_plan, encode_plan

    s = Scheduler(_caps(step_tokens=C))  # one chunk a step
    system = list(range(1, 17))  # two chunks
    a = _req(0, system + [40] * 10, new=20)
    s.add(a)
    copies: list = []
    while a.prefilled < 16:  # a's two system chunks run
        plan = s.schedule()
        s.update(plan, _fake(plan))
    b = _req(1, system + [50] * 5)
    s.add(b)
    plan = s.schedule()
    assert plan.copies == ((0, 1, 16),) and b.slot == 1 and b.reused == 16
    assert [(c.request, c.start) for c in plan.prefill] == [(0, 16)]  # a's last chunk first, in admission order
    assert decode_plan(encode_plan(plan)).copies == plan.copies  # through the ranks' ring record
    copies.append(plan.copies)
    s.update(plan, _fake(plan))
    while (plan := s.schedule()) is not None:
        copies.append(plan.copies)
        s.update(plan, _fake(plan))
    assert copies[1:] == [()] * (len(copies) - 1)  # one copy, in the plan that admitted b
    # both finished: slot 0 keeps a's 24, slot 1 b's 16; a request sharing 16 with both takes the
    # lower of them in place (a tie), copying nothing
    c = _req(2, system + [60] * 3)
    s.add(c)
    plan = s.schedule()
    assert plan.copies == () and c.reused == 16 and c.slot == 0


def test_no_copy_from_a_request_whose_chunks_have_not_run():
    s = Scheduler(_caps(step_tokens=C))
    system = list(range(1, 17))
    s.add(_req(0, system + [1] * 4))
    s.add(_req(1, system + [2] * 4))  # admitted in the same plan as the first: nothing to copy yet
    plan = s.schedule()
    assert plan.copies == () and [(c.request, c.slot, c.start) for c in plan.prefill] == [(0, 0, 0)]
