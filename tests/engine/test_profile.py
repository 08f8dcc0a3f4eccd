"""The serving rank's step profiler (`engine.profile`): the window it profiles, the files it
writes, and the summary's arithmetic on a trace whose kernels come from launches made
inside and outside the plans' ranges."""

import json
from types import SimpleNamespace

import pytest

from sparkinfer.engine import profile


def _ev(name, cat, ts, dur, **args):
    return dict(name=name, cat=cat, ph="X", ts=ts, dur=dur, args=args)


def test_summary_gives_each_plan_the_kernels_its_launches_made():
    events = [
        _ev(profile._RANGE, "user_annotation", 0, 100), _ev(profile._RANGE, "user_annotation", 200, 50),
        _ev(profile._RANGE, "gpu_user_annotation", 30, 70),  # the GPU's twin of the first range
        _ev("cudaGraphLaunch", "cuda_runtime", 10, 5, correlation=1),
        _ev("cudaLaunchKernel", "cuda_runtime", 20, 5, correlation=2),
        _ev("cudaGraphLaunch", "cuda_runtime", 210, 5, correlation=3),
        _ev("cudaLaunchKernel", "cuda_runtime", 150, 5, correlation=4),  # between the ranges: no plan's
        _ev("moe_fc1", "kernel", 30, 40, correlation=1), _ev("moe_fc2", "kernel", 60, 30, correlation=1),  # overlap 10
        _ev("argmax", "kernel", 95, 5, correlation=2),
        _ev("moe_fc1", "kernel", 220, 60, correlation=3),
        _ev("memset", "kernel", 160, 4, correlation=4),
    ]
    plans = [dict(plan=7, decode_rows=64, chunks=0, launched_mixed=True),
             dict(plan=8, decode_rows=64, chunks=4, launched_mixed=False)]
    s = profile.summarize(events, plans)
    assert [p["gpu_us"] for p in s["per_plan"]] == [75.0, 60.0]
    assert [p["wall_us"] for p in s["per_plan"]] == [100, 50]
    # busy: [30, 90) + [95, 100) + [160, 164) + [220, 280) = 60 + 5 + 4 + 60 over 30..280
    assert s["gpu_busy_us"] == 129.0 and s["window_us"] == 250.0
    assert s["gpu_busy_frac"] == pytest.approx(129 / 250)
    mixed, decode = s["kinds"]["mixed"], s["kinds"]["decode"]
    assert (mixed["plans"], mixed["gpu_us_median"], decode["gpu_us_median"]) == (1, 75.0, 60.0)
    assert [k["name"] for k in mixed["kernels_us_per_plan"]] == ["moe_fc1", "moe_fc2", "argmax"]


def test_the_profiler_takes_its_window_alone_and_writes_the_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(profile, "AFTER", 2)
    monkeypatch.setattr(profile, "STEPS", 3)
    monkeypatch.setattr(profile, "PATH", str(tmp_path / "steps.json"))

    class Runner:
        mixed_launched = chunks_taken = 0
        executed = []

        def execute(self, plan):
            self.executed.append(plan.step)
            self.mixed_launched += plan.step % 2  # odd plans launch a mixed step
            self.chunks_taken += plan.step % 2 and plan.step > 3
            return plan.step

    def plan(i):
        return SimpleNamespace(step=i, decode=[0] * i, prefill=[0] * (i % 2))

    runner = Runner()
    other = profile.StepProfiler(Runner(), rank=1)
    prof = profile.StepProfiler(runner, rank=0)
    assert [prof.run(plan(i)) for i in range(8)] == list(range(8))  # results pass through
    assert [other.run(plan(i)) for i in range(3)] == [0, 1, 2] and other.prof is None and not other.plans
    prof.finish()  # a second finish writes nothing more
    summary = json.loads((tmp_path / "steps.json").read_text())
    assert [p["plan"] for p in summary["per_plan"]] == [2, 3, 4]
    assert [p["launched_mixed"] for p in summary["per_plan"]] == [False, True, False]
    assert [(p["decode_rows"], p["chunks"]) for p in summary["per_plan"]] == [(2, 0), (3, 1), (4, 0)]
    assert summary["kinds"]["mixed"]["plans"] == 1 and summary["kinds"]["decode"]["plans"] == 2
    assert summary["runner"] == dict(mixed_launched=1, chunks_taken=0)  # over the window: plans 2, 3, 4
    assert (tmp_path / "steps.trace.json").exists() and summary["trace"].endswith("steps.trace.json")


def test_off_by_default(monkeypatch):
    class Runner:
        def execute(self, plan):
            return "done"

    prof = profile.StepProfiler(Runner(), rank=0)
    assert prof.run(SimpleNamespace(step=0, decode=[], prefill=[])) == "done" and prof.prof is None
