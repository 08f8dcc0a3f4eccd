"""Step plans and results survive the flat int64 record the ranks receive."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer.engine.plan import (
    DecodeRow,
    PrefillChunk,
    RowResult,
    StepPlan,
    StepResult,
    decode_plan,
    decode_result,
    encode_plan,
    encode_result,
)
from sparkinfer.engine.request import SamplingParams, TokenLogprob
from sparkinfer.errors import ShapeError

_params = st.builds(SamplingParams, temperature=st.floats(0, 5), top_p=st.floats(0.01, 1), top_k=st.integers(0, 100),
                    seed=st.integers(0, 2**63 - 1), logprobs=st.none() | st.integers(0, 20))
_ids = st.integers(0, 2**31)
_rows = st.lists(st.builds(DecodeRow, _ids, st.integers(0, 128), _ids, _ids, _ids, _params), max_size=5)
_chunks = st.lists(st.builds(PrefillChunk, _ids, st.integers(0, 128), _ids, st.lists(_ids, min_size=1,
                                                                                      max_size=9).map(tuple),
                             st.booleans(), _params), max_size=4)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**40), _rows, _chunks, st.booleans())
def test_plan_round_trip(step, rows, chunks, shutdown):
    plan = StepPlan(step, tuple(rows), tuple(chunks), shutdown)
    rec = encode_plan(plan)
    back = decode_plan(rec.tobytes() + b"\0" * 64)  # a ring slot is longer than the record
    for a, b in zip(plan.decode + plan.prefill, back.decode + back.prefill):
        assert a.params.temperature == b.params.temperature and a.params.top_p == b.params.top_p
        assert (a.params.top_k, a.params.seed, a.params.logprobs) == (b.params.top_k, b.params.seed,
                                                                       b.params.logprobs)
    strip = lambda p: [(x.request, x.slot, getattr(x, "position", None), getattr(x, "tokens", None))  # noqa: E731
                       for x in p.decode + p.prefill]
    assert strip(back) == strip(plan) and back.step == step and back.shutdown == shutdown


_lp = st.builds(TokenLogprob, _ids, st.floats(-50, 0), st.just(((3, -0.5), (9, -1.25))))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(_ids, max_size=4), max_size=5), st.booleans(), st.integers(0, 9))
def test_result_round_trip(token_lists, with_lp, proposed):
    rows = tuple(RowResult(tuple(t), tuple(TokenLogprob(x, -0.25, ((x, -0.25), (1, -2.0))) for x in t)
                           if with_lp else None) for t in token_lists)
    res = StepResult(4, rows[:2], rows[2:], proposed, proposed // 2)
    back = decode_result(encode_result(res).tobytes())
    assert back == res


def test_not_a_record():
    with pytest.raises(ShapeError, match="not a step-plan record"):
        decode_plan(bytes(64))
    with pytest.raises(ShapeError, match="not a step-result record"):
        decode_result(encode_plan(StepPlan(1)))
