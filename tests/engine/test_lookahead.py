"""The step launched ahead of its plan (`runner._Ahead`) is taken only by a plan whose
decode rows it holds: same slot, position, fed token and sampling, and no launch since.
The model-level check (lookahead on and off give the same bits) is in test_continuous."""

from sparkinfer.engine.plan import DecodeRow
from sparkinfer.engine.request import SamplingParams
from sparkinfer.engine.runner import _Ahead

GREEDY, HOT = SamplingParams(), SamplingParams(temperature=0.8, seed=5)


def _ahead(launches=7):
    # rows (slot, position, sampling) as `_look_ahead` launches them, fed tokens 11, 12, 13
    a = _Ahead([(0, 5, GREEDY), (3, 9, HOT), (1, 2, GREEDY)], logits=None, ids=None, host=None, launches=launches)
    a.tokens = [11, 12, 13]
    return a


def _row(slot, position, token, params=GREEDY, request=0):
    return DecodeRow(request, slot, position, token, 0, params)


def test_a_plan_of_the_same_rows_in_any_order_or_fewer_takes_it():
    a = _ahead()
    assert a.pick((_row(0, 5, 11), _row(3, 9, 12, HOT), _row(1, 2, 13)), 7) == [0, 1, 2]
    assert a.pick((_row(1, 2, 13), _row(0, 5, 11)), 7) == [2, 0]  # a request finished; order as planned
    # equal sampling, another object (a plan decoded from the ring builds its own)
    assert a.pick((_row(3, 9, 12, SamplingParams(temperature=0.8, seed=5)),), 7) == [1]


def test_any_difference_refuses_it():
    a = _ahead()
    assert a.pick((_row(0, 5, 11), _row(2, 4, 1)), 7) is None  # a row it does not hold
    assert a.pick((_row(0, 6, 11),), 7) is None  # another position
    assert a.pick((_row(0, 5, 10),), 7) is None  # another token
    assert a.pick((_row(3, 9, 12, SamplingParams(temperature=0.8, seed=6)),), 7) is None  # other sampling
    assert a.pick((_row(0, 5, 11),), 8) is None  # the engine launched since: its outputs are gone
    b = _ahead()
    b.tokens = None  # the step before was not read back yet
    assert b.pick((_row(0, 5, 11),), 7) is None
