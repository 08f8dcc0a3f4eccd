"""Where a graph replay's GPU time goes when kernels overlap.

Under programmatic dependent launch a kernel starts before its predecessor ends and
waits inside, so its profiled duration counts that wait and the durations of a step
add up to more than the step (docs/decode.md: with PDL on, only the split of a run
with the PDL flags off added up). Here every instant of the step is credited to the
running kernel that ends first (the one the GPU finishes next: a predecessor before
the successor waiting inside it, a short kernel on a second stream before the long one
it runs beside), and an instant where no kernel runs is idle. Credits and idle add up
to the step's time from its first start to its last end, whatever overlaps.

Pure functions of (name, start_us, end_us) events, so the CPU tests check them.
"""

from __future__ import annotations

import heapq
import statistics

__all__ = ["credit", "replay_timeline"]


def credit(events: list[tuple[str, float, float]]) -> tuple[list[float], float]:
    """(each event's credit, in the order given; the idle time between the first start
    and the last end) for the events of one replay: a sweep over the starts and ends,
    each stretch between two of them credited to the running event that ends first."""
    credits, idle = [0.0] * len(events), 0.0
    starts = sorted(range(len(events)), key=lambda j: events[j][1])
    times = sorted({t for _, s, e in events for t in (s, e)})
    running: list[tuple[float, int]] = []  # heap of (end, index)
    k = 0
    for t0, t1 in zip(times, times[1:]):
        while k < len(starts) and events[starts[k]][1] <= t0:
            heapq.heappush(running, (events[starts[k]][2], starts[k]))
            k += 1
        while running and running[0][0] <= t0:
            heapq.heappop(running)
        if running:
            credits[running[0][1]] += t1 - t0
        else:
            idle += t1 - t0
    return credits, idle


def replay_timeline(events: list[tuple[str, float, float]], replays: int) -> dict | None:
    """The events of `replays` back-to-back replays of one graph, in any order, cut into
    replays by start time (each replay launches the same number of kernels). Returns
    {"credit_by_name": {name: us a step}, "idle_us": idle a step, "launches": [{name,
    us, us_credit}] in launch (start) order or None where the replays' launch orders
    differ}, medians over the replays; None when the events do not cut into `replays`
    equal parts."""
    if replays < 1 or not events or len(events) % replays:
        return None
    n = len(events) // replays
    ordered = sorted(events, key=lambda e: e[1])
    parts = [ordered[i * n:(i + 1) * n] for i in range(replays)]
    credits = [credit(p) for p in parts]
    by_name = []
    for part, (cr, _) in zip(parts, credits):
        sums: dict[str, float] = {}
        for (name, _, _), c in zip(part, cr):
            sums[name] = sums.get(name, 0.0) + c
        by_name.append(sums)
    names = sorted(set().union(*by_name))
    out = dict(credit_by_name={k: statistics.median(s.get(k, 0.0) for s in by_name) for k in names},
               idle_us=statistics.median(idle for _, idle in credits), launches=None)
    if all([e[0] for e in p] == [e[0] for e in parts[0]] for p in parts):
        out["launches"] = [dict(name=parts[0][i][0], us=statistics.median(p[i][2] - p[i][1] for p in parts),
                                us_credit=statistics.median(cr[i] for cr, _ in credits)) for i in range(n)]
    return out
