"""A window of a serving rank's steps, timed: where a served step's time goes on the GPU,
and how long the GPU waits for the host between steps.

    SPARKINFER_FLAGS="sparkinfer.engine.profile.STEPS=200,sparkinfer.engine.profile.AFTER=400,\\
    sparkinfer.engine.profile.PATH='steps.json'" sparkinfer serve ...

Rank 0 times plans AFTER .. AFTER + STEPS - 1 (counted from its first) and writes a
summary to PATH. Each plan's `ModelRunner.execute` is one entry: what it asked (decode
rows, prompt chunks), its host wall time, whether the step it launched ahead was a mixed
one, and the runner's counts over the window (steps launched ahead and taken). Two ways:

- TRACE (default): under `torch.profiler`, each execute inside a range of its own; the
  Chrome trace goes to PATH's `.trace.json` twin. Per plan, the GPU time of the kernels
  its launches made (by correlation id, so CUDA graph replays count); over the window,
  the GPU's busy fraction and its idle gaps (`summarize`). The profiler costs the host
  time on every op, so the gaps it shows are longer than unprofiled ones.
- TRACE = False: CUDA events alone, around each step launched ahead (the runner's
  `launch_hook`), so the host runs as it does unprofiled: per launch, the GPU's idle
  time before it (from the end of the step before) and its GPU time (`event_summary`).

Off (STEPS = 0) by default; the other ranks never time anything.
"""

from __future__ import annotations

import bisect
import collections
import json
import statistics
import time

__all__ = ["StepProfiler", "summarize", "event_summary", "AFTER", "STEPS", "PATH", "TRACE"]

AFTER = 0
STEPS = 0
PATH = "sparkinfer_steps.json"
TRACE = True

_RANGE = "sparkinfer.execute"
# the runner's counters (`ModelRunner`): a step launched ahead that no plan took, or a mixed
# step whose chunks a plan did not take, ran for nothing (the plan launched its own)
_COUNTERS = ("ahead_launched", "ahead_used", "mixed_launched", "chunks_taken")
# an idle stretch of the GPU longer than this is listed with the kernels around it (us):
# between kernels of one graph replay the GPU idles 0.3-0.7 us (H100 trace, engine.profile)
_GAP_US = 20.0


class StepProfiler:
    """Wraps a rank's plan loop: `run(plan)` executes the plan on `runner`, timed inside
    the window (module docstring)."""

    def __init__(self, runner, rank: int):
        self.runner, self.on = runner, STEPS > 0 and rank == 0
        self.seen, self.prof, self.plans, self.counters = 0, None, [], {}
        self.timing, self.events, self._pre = False, [], None

    def run(self, plan):
        n, self.seen = self.seen, self.seen + 1
        if not self.on or not AFTER <= n < AFTER + STEPS:
            return self.runner.execute(plan)
        import torch

        if not self.timing:
            self._start(torch)
        mixed = getattr(self.runner, "mixed_launched", 0)
        t0 = time.perf_counter()
        if self.prof is not None:
            with torch.profiler.record_function(_RANGE):
                res = self.runner.execute(plan)
        else:
            res = self.runner.execute(plan)
        self.plans.append(dict(plan=int(plan.step), decode_rows=len(plan.decode), chunks=len(plan.prefill),
                               launched_mixed=getattr(self.runner, "mixed_launched", 0) > mixed,
                               host_us=(time.perf_counter() - t0) * 1e6))
        if n == AFTER + STEPS - 1:
            self.finish()
        return res

    def _start(self, torch) -> None:
        self.timing, self.counters = True, self._counters()
        if TRACE:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        elif torch.cuda.is_available():
            self.runner.launch_hook = self._hook

    def _hook(self, kind: str) -> None:
        """The runner's launch_hook: an event before and after each step launched ahead."""
        import torch

        if kind == "none":
            self._pre = None
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        if kind == "pre":
            self._pre = ev
        elif self._pre is not None:
            self.events.append((len(self.plans), self._pre, ev))
            self._pre = None

    def _counters(self) -> dict[str, int]:
        return {k: getattr(self.runner, k) for k in _COUNTERS if hasattr(self.runner, k)}

    def finish(self) -> None:
        """End the window (once) and write the summary (and the trace)."""
        if not self.timing:
            return
        import torch

        self.timing = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        runner = {k: v - self.counters.get(k, 0) for k, v in self._counters().items()}
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)
            trace = PATH[:-5] + ".trace.json" if PATH.endswith(".json") else PATH + ".trace.json"
            prof.export_chrome_trace(trace)
            with open(trace) as f:
                events = json.load(f).get("traceEvents", [])
            summary = dict(summarize(events, self.plans), trace=trace)
        else:
            self.runner.launch_hook = lambda kind: None
            marks = [(i, pre.elapsed_time(post) * 1e3, self.events[0][1].elapsed_time(pre) * 1e3)
                     for i, pre, post in self.events]
            summary = event_summary(self.plans, marks)
        with open(PATH, "w") as f:
            json.dump(dict(summary, runner=runner), f, indent=1)
            f.write("\n")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def event_summary(plans: list[dict], marks: list[tuple[int, float, float]]) -> dict:
    """The summary of the events mode: `marks` one per step launched ahead, (index of the
    plan that launched it, its GPU time, its start after the first launch's start), us.
    A launch's idle time is its start less the end of the launch before, never below 0 (a
    launch queued behind the last one starts as it ends): the GPU's idle time, or work
    launched outside the steps ahead (a prefill forward of its own) where a plan has
    one. Pure."""
    per = [dict(p, launch_gpu_us=None, idle_before_us=None) for p in plans]
    idle, end = [], None
    for i, gpu, start in marks:
        gap = None if end is None else max(0.0, start - end)
        end = start + gpu
        if i < len(per):
            per[i]["launch_gpu_us"], per[i]["idle_before_us"] = gpu, gap
        if gap is not None:
            idle.append(gap)
    kinds = {}
    for name, pick in (("mixed", True), ("decode", False)):
        mine = [p for p in per if p["launched_mixed"] == pick and p["launch_gpu_us"] is not None]
        kinds[name] = dict(plans=len(mine), launch_gpu_us_median=_median([p["launch_gpu_us"] for p in mine]),
                           idle_before_us_median=_median([p["idle_before_us"] for p in mine
                                                          if p["idle_before_us"] is not None]),
                           host_us_median=_median([p["host_us"] for p in mine]))
    window = end - marks[0][2] if marks else 0.0
    return dict(mode="events", plans=len(per), launches=len(marks), window_us=window, gpu_idle_us=sum(idle),
                gpu_idle_frac=sum(idle) / window if window > 0 else None, kinds=kinds, per_plan=per)


def summarize(events: list[dict], plans: list[dict]) -> dict:
    """The summary of a Chrome trace's events (`export_chrome_trace`) over the plans'
    ranges, `plans` in their order (StepProfiler.plans). Times in us. Pure."""
    # the host's ranges (with CUDA, each also has a "gpu_user_annotation" twin on the GPU's row)
    ranges = sorted((e for e in events if e.get("name") == _RANGE and e.get("ph") == "X"
                     and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    launch_at = {}  # correlation id -> the time of its runtime call (a launch, a graph replay)
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launch_at[e["args"]["correlation"]] = e["ts"]
    starts = [r["ts"] for r in ranges]
    per = [dict(p, wall_us=r["dur"], gpu_us=0.0, kernels={}) for p, r in zip(plans, ranges)]
    for k in kernels:
        at = launch_at.get(k.get("args", {}).get("correlation"))
        i = _owner(starts, ranges, at) if at is not None else None
        if i is not None and i < len(per):
            per[i]["gpu_us"] += k["dur"]
            per[i]["kernels"][k["name"]] = per[i]["kernels"].get(k["name"], 0.0) + k["dur"]
    busy, lo, hi, gaps = _busy(kernels)
    kinds = {}
    for name, pick in (("mixed", True), ("decode", False)):
        mine = [p for p in per if p["launched_mixed"] == pick]
        tot: dict[str, float] = {}
        for p in mine:
            for kn, us in p["kernels"].items():
                tot[kn] = tot.get(kn, 0.0) + us
        top = sorted(tot.items(), key=lambda kv: -kv[1])[:20]
        kinds[name] = dict(plans=len(mine), wall_us_median=_median([p["wall_us"] for p in mine]),
                           gpu_us_median=_median([p["gpu_us"] for p in mine]),
                           kernels_us_per_plan=[dict(name=kn, us=us / max(1, len(mine))) for kn, us in top])
    for p in per:
        p.pop("kernels")
    long = [g for g in gaps if g[0] > _GAP_US]
    around = collections.Counter((a, b) for _, a, b in long)
    return dict(mode="trace", plans=len(per), window_us=hi - lo, gpu_busy_us=busy,
                gpu_busy_frac=busy / (hi - lo) if hi > lo else None,
                gaps=dict(over_us=_GAP_US, count=len(long), total_us=sum(g[0] for g in long),
                          median_us=_median([g[0] for g in long]),
                          between=[dict(before=a, after=b, count=c) for (a, b), c in around.most_common(8)]),
                kinds=kinds, per_plan=per)


def _owner(starts: list[float], ranges: list[dict], at: float) -> int | None:
    """Index of the range holding time `at`, or None."""
    i = bisect.bisect_right(starts, at) - 1
    if i >= 0 and at <= ranges[i]["ts"] + ranges[i]["dur"]:
        return i
    return None


def _busy(kernels: list[dict]) -> tuple[float, float, float, list[tuple[float, str, str]]]:
    """(us when at least one kernel ran, first start, last end, the idle stretches as (us,
    the kernel that ended last before, the kernel after)) of kernels sorted by start."""
    if not kernels:
        return 0.0, 0.0, 0.0, []
    busy, gaps = 0.0, []
    lo, hi, last = kernels[0]["ts"], kernels[0]["ts"] + kernels[0]["dur"], kernels[0]["name"]
    first = lo
    for k in kernels[1:]:
        a, b = k["ts"], k["ts"] + k["dur"]
        if a > hi:
            busy += hi - lo
            gaps.append((a - hi, last, k["name"]))
            lo, hi = a, b
        if b >= hi:
            hi, last = b, k["name"]
    busy += hi - lo
    return busy, first, hi, gaps
