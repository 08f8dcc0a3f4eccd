"""`bench.timeline`: each kernel's credit (how far it moved the step's end) on hand-made
timelines, and on random ones that credits and idle add up to the step."""

import random

import pytest

from sparkinfer.bench.timeline import credit, replay_timeline


def test_serial_kernels_are_credited_their_durations_and_gaps_are_idle():
    cr, idle = credit([("a", 0.0, 3.0), ("b", 4.0, 6.0), ("c", 6.0, 10.0)])
    assert cr == [3.0, 2.0, 4.0] and idle == 1.0


def test_an_early_launched_kernel_gets_only_what_it_adds_past_its_predecessor():
    """PDL: b starts at 1 and waits inside until a ends at 5; its duration 7 counts the wait."""
    cr, idle = credit([("a", 0.0, 5.0), ("b", 1.0, 8.0)])
    assert cr == [5.0, 3.0] and idle == 0.0


def test_a_kernel_beside_a_longer_one_is_credited_while_it_runs():
    """A short kernel on a second stream ends first, so its stretch is its; the long one
    keeps the rest, including where the next kernel already waits inside it."""
    cr, idle = credit([("long", 0.0, 10.0), ("aux", 2.0, 4.0), ("next", 9.0, 12.0)])
    assert cr == [8.0, 2.0, 2.0] and idle == 0.0


def test_credits_and_idle_add_up_to_the_step_on_random_timelines():
    rng = random.Random(7)
    for _ in range(200):
        events = []
        for i in range(rng.randint(1, 30)):
            s = rng.uniform(0, 100)
            events.append((f"k{i % 4}", s, s + rng.uniform(0, 20)))
        cr, idle = credit(events)
        span = max(e[2] for e in events) - min(e[1] for e in events)
        assert sum(cr) + idle == pytest.approx(span)
        assert all(0 <= c <= e[2] - e[1] + 1e-9 for c, e in zip(cr, events))


def _replays(n, jitter=0.0, swap_last=False):
    rng, out = random.Random(3), []
    for r in range(n):
        t = 100.0 * r
        step = [("norm", t, t + 2), ("proj", t + 1, t + 9 + rng.uniform(0, jitter)), ("act", t + 9.5, t + 11)]
        if swap_last and r == n - 1:
            step[2] = ("other", t + 9.5, t + 11)
        out += step
    return out


def test_replays_give_medians_per_launch_and_per_name():
    tl = replay_timeline(_replays(5, jitter=1.0), 5)
    assert [la["name"] for la in tl["launches"]] == ["norm", "proj", "act"]
    assert tl["launches"][0] == dict(name="norm", us=2.0, us_credit=2.0)
    assert tl["credit_by_name"]["act"] == pytest.approx(tl["launches"][2]["us_credit"])
    assert sum(tl["credit_by_name"].values()) + tl["idle_us"] == pytest.approx(
        sum(la["us_credit"] for la in tl["launches"]) + tl["idle_us"])


def test_replays_that_do_not_line_up_keep_the_sums_or_give_nothing():
    tl = replay_timeline(_replays(4, swap_last=True), 4)
    assert tl["launches"] is None and set(tl["credit_by_name"]) == {"norm", "proj", "act", "other"}
    assert replay_timeline(_replays(4)[:-1], 4) is None  # 11 events do not cut into 4 replays
    assert replay_timeline([], 4) is None
