"""The step launched ahead of its plan (`runner._Ahead`) is taken only by a plan whose
decode rows it holds: same request, slot, position, fed token, previous token and
sampling, and no launch since. The model-level check (lookahead on and off give the
same bits) is in test_continuous."""

import numpy as np

from sparkinfer.engine.plan import DecodeRow, DecodeRows, SamplingColumns, sampling_words
from sparkinfer.engine.request import SamplingParams
from sparkinfer.engine.runner import _Ahead

GREEDY, HOT = SamplingParams(), SamplingParams(temperature=0.8, seed=5)


def _ahead(launches=7):
    # rows (request 0, slot, position, prev 0, sampling) as `_look_ahead` launches them in a
    # cache of 8 slots, fed tokens 11, 12, 13
    rows = np.array([[0, slot, pos, 0, 0, *sampling_words(p)] for slot, pos, p in ((0, 5, GREEDY), (3, 9, HOT),
                                                                                   (1, 2, GREEDY))])
    a = _Ahead(rows, SamplingColumns(rows[:, 5:]), (None, None, None), launches, 8)
    a.feed(np.array([11, 12, 13]))
    return a


def _row(slot, position, token, params=GREEDY, request=0):
    return DecodeRow(request, slot, position, token, 0, params)


def _pick(a, rows, launches):
    """The launched rows each plan row takes, as a list (`pick` gives a slice for all, in order)."""
    picked = a.pick(DecodeRows.of(rows), launches)
    return None if picked is None else np.arange(len(a.rows))[picked].tolist()


def test_a_plan_of_the_same_rows_in_any_order_or_fewer_takes_it():
    a = _ahead()
    assert _pick(a, (_row(0, 5, 11), _row(3, 9, 12, HOT), _row(1, 2, 13)), 7) == [0, 1, 2]
    assert a.pick(DecodeRows.of((_row(0, 5, 11), _row(3, 9, 12, HOT), _row(1, 2, 13))), 7) == slice(0, 3)
    assert _pick(a, (_row(1, 2, 13), _row(0, 5, 11), _row(3, 9, 12, HOT)), 7) == [2, 0, 1]  # the same, reordered
    assert _pick(a, (_row(1, 2, 13), _row(0, 5, 11)), 7) == [2, 0]  # a request finished; order as planned
    # equal sampling, another object (a plan decoded from the ring builds its own)
    assert _pick(a, (_row(3, 9, 12, SamplingParams(temperature=0.8, seed=5)),), 7) == [1]


def test_any_difference_refuses_it():
    a = _ahead()
    assert _pick(a, (_row(0, 5, 11), _row(2, 4, 1)), 7) is None  # a row it does not hold
    assert _pick(a, (_row(7, 4, 1),), 7) is None  # a slot past every slot it holds
    assert _pick(a, (_row(0, 6, 11),), 7) is None  # another position
    assert _pick(a, (_row(0, 5, 10),), 7) is None  # another token
    assert _pick(a, (_row(3, 9, 12, SamplingParams(temperature=0.8, seed=6)),), 7) is None  # other sampling
    assert _pick(a, (_row(0, 5, 11),), 8) is None  # the engine launched since: its outputs are gone
    assert _pick(a, (_row(0, 5, 11, request=1),), 7) is None  # another request in the slot
    assert _pick(a, (DecodeRow(0, 0, 5, 11, 4, GREEDY),), 7) is None  # another previous token
    b = _ahead()
    b.fed = False  # the step before was not read back yet
    assert _pick(b, (_row(0, 5, 11),), 7) is None
