"""Step plans and results survive the flat int64 record the ranks receive, and their
column forms read as the rows they hold."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer.engine.plan import (
    RESULT_HEAD,
    DecodeRow,
    DecodeRows,
    PrefillChunk,
    RowResult,
    SamplingColumns,
    StepPlan,
    StepResult,
    TokenRows,
    decode_plan,
    decode_result,
    encode_plan,
    encode_result,
)
from sparkinfer.engine.request import SamplingParams, TokenLogprob
from sparkinfer.engine.sampler import RowSampling
from sparkinfer.errors import ShapeError

_params = st.builds(SamplingParams, temperature=st.floats(0, 5), top_p=st.floats(0.01, 1), top_k=st.integers(0, 100),
                    seed=st.integers(0, 2**63 - 1), logprobs=st.none() | st.integers(0, 20))
_ids = st.integers(0, 2**31)
_rows = st.lists(st.builds(DecodeRow, _ids, st.integers(0, 128), _ids, _ids, _ids, _params), max_size=5)
_chunks = st.lists(st.builds(PrefillChunk, _ids, st.integers(0, 128), _ids, st.lists(_ids, min_size=1,
                                                                                      max_size=9).map(tuple),
                             st.booleans(), _params), max_size=4)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**40), _rows, _chunks, st.booleans(), _chunks)
def test_plan_round_trip(step, rows, chunks, shutdown, announced):
    plan = StepPlan(step, tuple(rows), tuple(chunks), shutdown, tuple(announced))
    rec = encode_plan(plan)
    back = decode_plan(rec.tobytes() + b"\0" * 64)  # a ring slot is longer than the record
    assert [(c.request, c.slot, c.start, c.tokens, c.last) for c in back.next_prefill] == \
        [(c.request, c.slot, c.start, c.tokens, c.last) for c in announced]
    for a, b in zip(plan.decode + plan.prefill + plan.next_prefill, back.decode + back.prefill + back.next_prefill):
        assert a.params.temperature == b.params.temperature and a.params.top_p == b.params.top_p
        assert (a.params.top_k, a.params.seed, a.params.logprobs) == (b.params.top_k, b.params.seed,
                                                                       b.params.logprobs)
    strip = lambda p: [(x.request, x.slot, getattr(x, "position", None), getattr(x, "tokens", None))  # noqa: E731
                       for x in p.decode + p.prefill]
    assert strip(back) == strip(plan) and back.step == step and back.shutdown == shutdown
    assert isinstance(back.decode, DecodeRows) and np.array_equal(back.decode.cols, plan.decode.cols)
    assert [(r.token, r.prev) for r in back.decode] == [(r.token, r.prev) for r in rows]


@settings(max_examples=50, deadline=None)
@given(st.lists(_params, max_size=6))
def test_sampling_columns_filter_as_the_params_do(params):
    cols = SamplingColumns.of(params)
    assert cols.filtered == RowSampling.needs_filter(params)
    assert cols.temperature.tolist() == [p.temperature for p in params] and cols.top_k.tolist() == [
        p.top_k for p in params]


def test_decode_rows_read_as_a_tuple_of_rows():
    hot = SamplingParams(temperature=0.5, top_k=3, seed=9, logprobs=2)
    rows = (DecodeRow(4, 0, 10, 7, 6, SamplingParams()), DecodeRow(5, 2, 3, 1, 9, hot))
    plan = StepPlan(1, rows)
    assert isinstance(plan.decode, DecodeRows) and len(plan.decode) == 2 and plan.decode.logprobs_wanted
    assert plan.decode.slot.tolist() == [0, 2] and plan.decode[1].params.top_k == 3 and plan.decode[-1].prev == 9
    assert plan.decode[1:][0].request == 5 and plan.decode + () == tuple(plan.decode)
    assert [(r.request, r.slot, r.position, r.token, r.prev) for r in plan.decode] == [(4, 0, 10, 7, 6),
                                                                                      (5, 2, 3, 1, 9)]
    assert not StepPlan(2).decode and StepPlan(2).empty


@pytest.mark.parametrize("chunks", [0, 2], ids=["decode_step", "with_prefill"])
def test_one_token_rows_travel_as_one_id_array(chunks):
    ids = np.array([5, 0, 2**40, 7], dtype=np.int64)
    pre = tuple(RowResult((i,) if i % 2 else ()) for i in range(chunks))
    res = StepResult(9, TokenRows(ids), pre, 3, 1)
    rec = encode_result(res)
    assert len(rec) == RESULT_HEAD + len(ids) + sum(3 + len(r.tokens) for r in pre)  # the ids, one word each
    back = decode_result(rec.tobytes())
    assert isinstance(back.decode, TokenRows) and back.decode.ids.tolist() == ids.tolist()
    assert back == res == StepResult(9, tuple(RowResult((int(t),)) for t in ids), pre, 3, 1)
    assert back.decode[2] == RowResult((2**40,)) and back.prefill == pre


_lp = st.builds(TokenLogprob, _ids, st.floats(-50, 0), st.just(((3, -0.5), (9, -1.25))))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(_ids, max_size=4), max_size=5), st.booleans(), st.integers(0, 9))
def test_result_round_trip(token_lists, with_lp, proposed):
    rows = tuple(RowResult(tuple(t), tuple(TokenLogprob(x, -0.25, ((x, -0.25), (1, -2.0))) for x in t)
                           if with_lp else None) for t in token_lists)
    res = StepResult(4, rows[:2], rows[2:], proposed, proposed // 2, mixed=bool(proposed % 2))
    back = decode_result(encode_result(res).tobytes())
    assert back == res and back.mixed == bool(proposed % 2)


def test_not_a_record():
    with pytest.raises(ShapeError, match="not a step-plan record"):
        decode_plan(bytes(64))
    with pytest.raises(ShapeError, match="not a step-result record"):
        decode_result(encode_plan(StepPlan(1)))
