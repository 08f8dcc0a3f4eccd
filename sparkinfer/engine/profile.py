"""A window of a serving rank's steps under the CUDA profiler: where a served step's time
goes on the GPU, and how long the GPU waits for the host between steps.

    SPARKINFER_FLAGS="sparkinfer.engine.profile.STEPS=200,sparkinfer.engine.profile.AFTER=400,\\
    sparkinfer.engine.profile.PATH='steps.json'" sparkinfer serve ...

Rank 0 runs plans AFTER .. AFTER + STEPS - 1 (counted from its first) under
`torch.profiler`, each plan's `ModelRunner.execute` inside a range of its own, then
writes the Chrome trace to PATH's `.trace.json` twin and a summary to PATH
(`summarize`): per plan, what it asked (decode rows, prompt chunks), whether the
launch it made was a mixed step, the GPU time of the kernels it launched (through
the launch's correlation id, so CUDA graph replays count), and over the window, the
GPU's busy fraction and the runner's counts of steps launched ahead and taken. Off
(STEPS = 0) by default; the other ranks never profile.
"""

from __future__ import annotations

import bisect
import json
import statistics

__all__ = ["StepProfiler", "summarize", "AFTER", "STEPS", "PATH"]

AFTER = 0
STEPS = 0
PATH = "sparkinfer_steps.json"

_RANGE = "sparkinfer.execute"
# the runner's counters (`ModelRunner`): a step launched ahead that no plan took, or a mixed
# step whose chunks a plan did not take, ran for nothing (the plan launched its own)
_COUNTERS = ("ahead_launched", "ahead_used", "mixed_launched", "chunks_taken")


class StepProfiler:
    """Wraps a rank's plan loop: `run(plan)` executes the plan on `runner`, under the
    profiler inside the window (module docstring)."""

    def __init__(self, runner, rank: int):
        self.runner, self.on = runner, STEPS > 0 and rank == 0
        self.seen, self.prof, self.plans, self.counters = 0, None, [], {}

    def run(self, plan):
        n, self.seen = self.seen, self.seen + 1
        if not self.on or not AFTER <= n < AFTER + STEPS:
            return self.runner.execute(plan)
        import torch

        if self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            self.counters = self._counters()
        mixed = getattr(self.runner, "mixed_launched", 0)
        with torch.profiler.record_function(_RANGE):
            res = self.runner.execute(plan)
        self.plans.append(dict(plan=int(plan.step), decode_rows=len(plan.decode), chunks=len(plan.prefill),
                               launched_mixed=getattr(self.runner, "mixed_launched", 0) > mixed))
        if n == AFTER + STEPS - 1:
            self.finish()
        return res

    def _counters(self) -> dict[str, int]:
        return {k: getattr(self.runner, k) for k in _COUNTERS if hasattr(self.runner, k)}

    def finish(self) -> None:
        """Stop the profiler (once) and write the trace and the summary."""
        if self.prof is None:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        runner = {k: v - self.counters.get(k, 0) for k, v in self._counters().items()}
        trace = PATH[:-5] + ".trace.json" if PATH.endswith(".json") else PATH + ".trace.json"
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f).get("traceEvents", [])
        with open(PATH, "w") as f:
            json.dump(dict(summarize(events, self.plans), runner=runner, trace=trace), f, indent=1)
            f.write("\n")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(events: list[dict], plans: list[dict]) -> dict:
    """The summary of a Chrome trace's events (`export_chrome_trace`) over the plans'
    ranges, `plans` in their order (StepProfiler.plans). Times in us. Pure."""
    # the host's ranges (with CUDA, each also has a "gpu_user_annotation" twin on the GPU's row)
    ranges = sorted((e for e in events if e.get("name") == _RANGE and e.get("ph") == "X"
                     and e.get("cat") != "gpu_user_annotation"),
                    key=lambda e: e["ts"])
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
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
    busy, lo, hi = _busy(kernels)
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
    return dict(plans=len(per), window_us=hi - lo, gpu_busy_us=busy,
                gpu_busy_frac=busy / (hi - lo) if hi > lo else None, kinds=kinds, per_plan=per)


def _owner(starts: list[float], ranges: list[dict], at: float) -> int | None:
    """Index of the range holding time `at`, or None."""
    i = bisect.bisect_right(starts, at) - 1
    if i >= 0 and at <= ranges[i]["ts"] + ranges[i]["dur"]:
        return i
    return None


def _busy(kernels: list[dict]) -> tuple[float, float, float]:
    """(us when at least one kernel ran, first start, last end) of the kernels."""
    if not kernels:
        return 0.0, 0.0, 0.0
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    busy, (cur_lo, cur_hi) = 0.0, spans[0]
    for lo, hi in spans[1:]:
        if lo > cur_hi:
            busy += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    busy += cur_hi - cur_lo
    return busy, spans[0][0], max(h for _, h in spans)
