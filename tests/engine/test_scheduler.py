"""The scheduler as pure policy: plans for given arrivals, with results faked.

A fake model answers every decode row with one token (its position, so tokens are
predictable) and every prompt's last chunk with its first token; stop tokens,
lengths, aborts and the queue bound are driven from that.
"""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer.engine.plan import RowResult, StepResult, TokenRows
from sparkinfer.engine.request import FinishReason, RequestState, SamplingParams
from sparkinfer.engine.scheduler import SchedRequest, Scheduler, SchedulerCaps
from sparkinfer.errors import CapacityError, EngineOverloaded, ShapeError


def _fake(plan, spec_tokens: int = 1) -> StepResult:
    """Decode row -> tokens position + 1 .. (spec_tokens of them); last chunk -> its end."""
    dec = tuple(RowResult(tuple(r.position + 1 + j for j in range(spec_tokens))) for r in plan.decode)
    pre = tuple(RowResult((c.start + len(c.tokens),) if c.last else ()) for c in plan.prefill)
    return StepResult(plan.step, dec, pre)


def _fake_ids(plan) -> StepResult:
    """`_fake` with the decode rows' tokens as one id array, as a decode step's ranks send them."""
    return StepResult(plan.step, TokenRows(plan.decode.position + 1), _fake(plan).prefill)


def _req(i, n, new=4, stops=()):
    """Request i: n prompt tokens of its own (no two requests share a prefix: prefix reuse,
    test_prefix_reuse.py, would start one after the other's chunks)."""
    return SchedRequest(i, list(range(1000 * i + 100, 1000 * i + 100 + n)), SamplingParams(max_new_tokens=new),
                        frozenset(stops))


def _run(s: Scheduler, spec_tokens=1, limit=1000):
    plans = []
    while (plan := s.schedule()) is not None and limit:
        plans.append(plan)
        s.update(plan, _fake(plan, spec_tokens))
        limit -= 1
    return plans


def test_fifo_admission_slot_reuse_and_tokens():
    s = Scheduler(SchedulerCaps(slots=2, max_context=64, chunk=8, step_tokens=64))
    reqs = [_req(i, 5 + i, new=3) for i in range(4)]
    for r in reqs:
        s.add(r)
    plans = _run(s)
    # the first two take slots 0 and 1, the next ones wait and reuse them in arrival order
    first = {c.request: c.slot for p in plans for c in p.prefill}
    assert first == {0: 0, 1: 1, 2: 0, 3: 1}
    starts = [c.request for p in plans for c in p.prefill]
    assert starts == sorted(starts), "admission is first come, first served"
    for r in reqs:
        assert r.state is RequestState.FINISHED and r.finish is FinishReason.LENGTH
        n = len(r.prompt)
        assert r.out == [n, n + 1, n + 2]  # first token from the prefill, then one per decode step
    assert s.free == [0, 1] and not s.active


def test_chunks_start_at_multiples_of_the_chunk_whatever_the_budget():
    for budget in (1, 5, 8, 13, 100):
        s = Scheduler(SchedulerCaps(slots=3, max_context=128, chunk=8, step_tokens=budget))
        for i, n in enumerate((21, 3, 17)):
            s.add(_req(i, n, new=2))
        plans = _run(s)
        chunks = [c for p in plans for c in p.prefill]
        for c in chunks:
            assert c.start % 8 == 0 and len(c.tokens) <= 8
        for p in plans:  # the budget holds, except that one chunk always runs
            tokens = sum(len(c.tokens) for c in p.prefill)
            assert tokens <= budget or len(p.prefill) == 1
        by_req = {}
        for c in chunks:
            by_req.setdefault(c.request, []).append((c.start, len(c.tokens), c.last))
        assert by_req[0] == [(0, 8, False), (8, 8, False), (16, 5, True)]


def test_decode_keeps_stepping_while_a_long_prompt_prefills():
    s = Scheduler(SchedulerCaps(slots=2, max_context=512, chunk=16, step_tokens=16))
    s.add(_req(0, 4, new=20))
    s.update(p := s.schedule(), _fake(p))  # request 0 prefills and gets its first token
    s.add(_req(1, 160, new=2))
    plans = _run(s, limit=10)
    assert all(len(p.decode) == 1 and p.decode[0].request == 0 for p in plans[:10])
    assert [len(p.prefill) for p in plans[:10]] == [1] * 10  # 160 / 16 chunks, one a step


def test_prefill_waits_for_a_fuller_forward_only_while_requests_decode():
    s = Scheduler(SchedulerCaps(slots=4, max_context=256, chunk=16, step_tokens=64, prefill_wait_steps=3))
    s.add(_req(0, 4, new=30))
    p = s.schedule()
    assert len(p.prefill) == 1 and not p.decode  # nothing decodes: no wait
    s.update(p, _fake(p))
    s.add(_req(1, 20, new=2))  # 2 chunks of a forward's 4, while request 0 decodes: they wait 3 steps
    waited = []
    for _ in range(4):
        p = s.schedule()
        waited.append((len(p.decode), len(p.prefill)))
        s.update(p, _fake(p))
    assert waited == [(1, 0), (1, 0), (1, 0), (1, 2)]
    s.add(_req(2, 64, new=2))  # 4 chunks fill a forward: no wait
    p = s.schedule()
    assert [c.request for c in p.prefill] == [2] * 4


def test_announced_chunks_wait_for_a_full_mixed_step():
    """With `announce` and W > 0, a full forward is the announce budget's chunks (what a
    mixed step holds), not step_tokens': 2 of 4 chunks wait W steps, then are announced;
    4 are announced at once."""
    s = Scheduler(SchedulerCaps(slots=4, max_context=256, chunk=16, step_tokens=128, prefill_wait_steps=2,
                                announce=64))
    s.add(_req(0, 4, new=30))
    p = s.schedule()
    assert len(p.prefill) == 1 and not p.decode  # nothing decodes: at once
    s.update(p, _fake(p))
    s.add(_req(1, 32, new=2))  # 2 chunks of a mixed step's 4
    seen = []
    for _ in range(4):
        p = s.schedule()
        seen.append((len(p.decode), len(p.prefill), len(p.next_prefill)))
        s.update(p, _fake(p))
    assert seen == [(1, 0, 0), (1, 0, 0), (1, 0, 2), (1, 2, 0)]
    s.add(_req(2, 64, new=2))  # 4 chunks fill a mixed step: announced at once
    p = s.schedule()
    assert [c.request for c in p.next_prefill] == [2] * 4


def test_stops_and_context_limit():
    s = Scheduler(SchedulerCaps(slots=2, max_context=12, chunk=8))
    a = _req(0, 4, new=50, stops={6})      # tokens 4, 5, 6: stops at 6 (kept)
    b = _req(1, 8, new=50)                 # context 12: tokens 8..11, then full
    s.add(a)
    s.add(b)
    _run(s)
    assert a.out == [4, 5, 6] and a.finish is FinishReason.STOP
    assert b.out == [8, 9, 10, 11] and b.finish is FinishReason.LENGTH


def test_speculative_results_are_cut_at_the_stop():
    s = Scheduler(SchedulerCaps(slots=1, max_context=64, chunk=8, speculative=True))
    r = _req(0, 4, new=50, stops={7})
    s.add(r)
    _run(s, spec_tokens=3)  # 4, then 5 6 7 in one round: the round's tokens after 7 are dropped
    assert r.out == [4, 5, 6, 7] and r.finish is FinishReason.STOP


def test_abort_frees_the_slot_for_the_next_step():
    s = Scheduler(SchedulerCaps(slots=1, max_context=64, chunk=8))
    s.add(_req(0, 4, new=50))
    s.add(_req(1, 4, new=2))
    s.update(p := s.schedule(), _fake(p))
    assert s.abort(0).finish is FinishReason.ABORT
    plan = s.schedule()
    assert [c.request for c in plan.prefill] == [1] and plan.prefill[0].slot == 0 and not plan.decode
    assert s.abort(0) is None and s.abort(99) is None  # unknown or finished: nothing


def test_rejections():
    s = Scheduler(SchedulerCaps(slots=1, max_context=10, max_waiting=1))
    with pytest.raises(ShapeError, match="prompt is empty"):
        s.add(_req(0, 0))
    with pytest.raises(CapacityError, match="a prompt of 10 tokens .* at most 9"):
        s.add(_req(0, 10))
    s.add(_req(0, 3))  # takes the free slot at the next step
    s.add(_req(1, 3))  # the one waiting place
    with pytest.raises(EngineOverloaded, match="retry later") as e:
        s.add(_req(2, 3))
    assert e.value.retry_after_s > 0
    with pytest.raises(ShapeError, match="slots=0"):
        SchedulerCaps(slots=0, max_context=8)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 6), st.booleans()),
                min_size=1, max_size=12),
       st.integers(1, 3), st.integers(1, 50), st.integers(1, 4), st.integers(0, 3))
def test_random_arrivals_every_request_finishes_in_order(arrivals, slots, budget, spec_tokens, wait):
    """Requests arrive at random steps (with random lengths, aborts): every one ends once,
    slots are never shared, chunks start at multiples of C, admission keeps arrival order,
    with or without prefill waiting for fuller forwards; with chunks announced a plan
    ahead (odd `wait`), each plan's chunks are the ones the last plan announced that still
    prefill, then new ones."""
    s = Scheduler(SchedulerCaps(slots=slots, max_context=64, chunk=8, step_tokens=budget, max_waiting=100,
                                speculative=spec_tokens > 1, prefill_wait_steps=wait // 2, announce=16 * (wait % 2)))
    announced = ()
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    reqs, admitted, step = {}, [], 0
    while pending or s.has_work:
        while pending and pending[0][1][0] <= step:
            i, (_, n, new, abort) = pending.pop(0)
            reqs[i] = _req(i, n, new)
            s.add(reqs[i])
            if abort and i % 2:
                s.abort(i)
        plan = s.schedule()
        step += 1
        if plan is None:
            continue
        live = [c for c in announced if s.active.get(c.request) is not None and c.slot == s.active[c.request].slot]
        assert list(plan.prefill[:len(live)]) == live, "a plan runs what the last one announced first"
        assert not plan.next_prefill or (plan.decode and s.caps.announce), "announced only beside decode rows"
        announced = plan.next_prefill
        slots_used = [r.slot for r in plan.decode] + [c.slot for c in plan.prefill]
        owners = {}
        for row in plan.decode:
            owners.setdefault(row.slot, set()).add(row.request)
        for c in plan.prefill:
            owners.setdefault(c.slot, set()).add(c.request)
            assert c.start % 8 == 0
            if c.request not in admitted:
                admitted.append(c.request)
        assert all(len(o) == 1 for o in owners.values()) and max(slots_used) < slots
        s.update(plan, _fake(plan, spec_tokens))
        assert step < 2000
    assert all(r.state is RequestState.FINISHED for r in reqs.values())
    assert admitted == sorted(admitted, key=lambda i: (arrivals[i][0], i))
    for r in reqs.values():
        assert r.finish is FinishReason.ABORT or 1 <= len(r.out) <= r.params.max_new_tokens


def test_a_handle_reports_waiting_prefilling_running_finished():
    from sparkinfer.engine.core import EngineCore

    class Steady:  # every step takes at least 2 ms
        def execute(self, plan):
            time.sleep(0.002)
            return _fake(plan)

    core = EngineCore(Steady(), SchedulerCaps(slots=1, max_context=64, chunk=4, step_tokens=4))
    a = core.submit(list(range(10)), SamplingParams(max_new_tokens=2))
    b = core.submit([1, 2], SamplingParams(max_new_tokens=1))
    assert a.state is RequestState.WAITING and b.state is RequestState.WAITING
    core.step()  # a's first chunk of three
    assert a.state is RequestState.PREFILLING and b.state is RequestState.WAITING
    core.step()
    core.step()  # a's last chunk: its first token
    assert a.state is RequestState.RUNNING
    while core.step():
        pass
    assert a.finished and b.finished and a.finish_reason is FinishReason.LENGTH
    outs = a.result()
    assert [o.token_ids for o in outs] == [(10,), (11,)]
    # the first output says how long the request queued and prefilled; a: at once, then 3 steps of chunks;
    # b: queued behind a's 4 steps (one slot), then one step
    ta, tb = outs[0].timings, b.result()[0].timings
    assert outs[1].timings is None
    assert ta.queue_s >= 0 and ta.prefill_s >= 3 * 0.002 and tb.queue_s >= 4 * 0.002 and tb.prefill_s >= 0.002
    # in the caller's process: no pipe to cross; made at the engine's monotonic time, b after a
    assert ta.pickup_s is None and ta.emitted_at <= tb.emitted_at <= time.monotonic()
    # sent from another process at sent_at: the receipt says how long the way in took
    c = core.submit([1, 2], SamplingParams(max_new_tokens=1), sent_at=time.monotonic() - 0.5)
    while core.step():
        pass
    assert 0.5 <= c.result()[0].timings.pickup_s < 5


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 20), st.integers(1, 8), st.integers(0, 30),
                          st.booleans()), min_size=1, max_size=8), st.integers(1, 3))
def test_one_token_rows_in_bulk_update_as_rows_of_results_do(arrivals, slots):
    """The decode step's id array (`TokenRows`, the table advanced in bulk) gives the plans,
    updates, stops and lengths that one RowResult a row gives."""
    pair = [Scheduler(SchedulerCaps(slots=slots, max_context=32, chunk=8, step_tokens=16)) for _ in range(2)]
    reqs = [{} for _ in pair]
    step = 0
    while step < 300:
        for i, (at, n, new, stop, abort) in enumerate(arrivals):
            for s, rs in zip(pair, reqs):
                if at == step:
                    rs[i] = _req(i, n, new, stops={stop + 10})
                    s.add(rs[i])
                if abort and at + 2 == step:
                    s.abort(i)
        plans = [s.schedule() for s in pair]
        if plans[0] is None:
            assert plans[1] is None and not pair[1].has_work
            if all(a[0] < step for a in arrivals):
                break
        else:
            a, b = plans
            assert np.array_equal(a.decode.cols, b.decode.cols) and a.prefill == b.prefill
            assert pair[0].update(a, _fake(a)) == pair[1].update(b, _fake_ids(b))
        step += 1
    assert [(r.out, r.finish) for r in reqs[0].values()] == [(r.out, r.finish) for r in reqs[1].values()]
    assert all(r.finish is not None for r in reqs[0].values())


def test_announced_chunks_run_in_the_next_plan_beside_decode_rows():
    """With `announce`, a prompt admitted while another request decodes is announced by one
    plan and prefilled by the next (where a rank can run it beside the decode rows it
    launched ahead); with nothing decoding it prefills at once; an aborted request's
    announced chunks do not run."""
    s = Scheduler(SchedulerCaps(slots=3, max_context=64, chunk=8, step_tokens=64, announce=16))
    s.add(_req(0, 5, new=6))
    p1 = s.schedule()
    assert [c.request for c in p1.prefill] == [0] and not p1.next_prefill  # nothing decodes: at once
    s.update(p1, _fake(p1))
    r1 = _req(1, 12, new=2)
    s.add(r1)  # two chunks: 8 + 4, within the 16 announced tokens
    s.add(_req(2, 20, new=2))  # its first chunk passes the 16
    p2 = s.schedule()
    assert len(p2.decode) == 1 and not p2.prefill
    assert [(c.request, c.start) for c in p2.next_prefill] == [(1, 0), (1, 8)]
    s.update(p2, _fake(p2))
    p3 = s.schedule()
    assert p3.prefill == p2.next_prefill and [(c.request, c.start) for c in p3.next_prefill] == [(2, 0), (2, 8)]
    s.update(p3, _fake(p3))
    s.abort(2)
    p4 = s.schedule()
    assert not p4.prefill and not p4.next_prefill and len(p4.decode) == 2
    s.update(p4, _fake(p4))
    assert r1.out == [12, 13] and r1.finish is FinishReason.LENGTH
