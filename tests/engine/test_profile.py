"""The serving rank's step profiler (`engine.profile`): the window it times, the files it
writes, and the summaries' arithmetic: a trace whose kernels come from launches made
inside and outside the plans' ranges, and CUDA event marks with and without idle time."""

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
    # idle stretches 5, 60 and 56 us: the two over 20 us, with the kernels around them
    assert (s["gaps"]["count"], s["gaps"]["total_us"]) == (2, 116.0)
    assert {(g["before"], g["after"]) for g in s["gaps"]["between"]} == {("argmax", "memset"), ("memset", "moe_fc1")}
    mixed, decode = s["kinds"]["mixed"], s["kinds"]["decode"]
    assert (mixed["plans"], mixed["gpu_us_median"], decode["gpu_us_median"]) == (1, 75.0, 60.0)
    assert [k["name"] for k in mixed["kernels_us_per_plan"]] == ["moe_fc1", "moe_fc2", "argmax"]


def test_event_summary_counts_the_gpu_idle_between_steps_launched_ahead():
    plans = [dict(plan=p, decode_rows=64, chunks=c, launched_mixed=m, host_us=h)
             for p, c, m, h in ((1, 0, False, 900.0), (2, 0, True, 950.0), (3, 4, False, 1500.0), (4, 0, False, 800.0))]
    # (plan index, GPU us, start us): plan 1's launch queued behind plan 0's (starts as it ends),
    # plan 2's 300 us after plan 1's ended, plan 3 launched nothing
    marks = [(0, 4000.0, 0.0), (1, 6500.0, 4000.0), (2, 4100.0, 10800.0)]
    s = profile.event_summary(plans, marks)
    assert [p["idle_before_us"] for p in s["per_plan"]] == [None, 0.0, 300.0, None]
    assert [p["launch_gpu_us"] for p in s["per_plan"]] == [4000.0, 6500.0, 4100.0, None]
    assert (s["launches"], s["window_us"], s["gpu_idle_us"]) == (3, 14900.0, 300.0)
    assert s["gpu_idle_frac"] == pytest.approx(300 / 14900)
    assert s["kinds"]["mixed"]["launch_gpu_us_median"] == 6500.0
    assert s["kinds"]["decode"]["idle_before_us_median"] == 300.0 and s["kinds"]["decode"]["plans"] == 2
    assert profile.event_summary(plans, [])["gpu_idle_frac"] is None


class _Runner:
    def __init__(self):
        self.mixed_launched = self.chunks_taken = 0
        self.launch_hook = lambda kind: None

    def execute(self, plan):
        self.mixed_launched += plan.step % 2  # odd plans launch a mixed step
        self.chunks_taken += plan.step % 2 and plan.step > 3
        return plan.step


def _plan(i):
    return SimpleNamespace(step=i, decode=[0] * i, prefill=[0] * (i % 2))


@pytest.mark.parametrize("trace", [True, False])
def test_the_profiler_takes_its_window_alone_and_writes_the_summary(tmp_path, monkeypatch, trace):
    monkeypatch.setattr(profile, "AFTER", 2)
    monkeypatch.setattr(profile, "STEPS", 3)
    monkeypatch.setattr(profile, "TRACE", trace)
    monkeypatch.setattr(profile, "PATH", str(tmp_path / "steps.json"))
    prof, other = profile.StepProfiler(_Runner(), rank=0), profile.StepProfiler(_Runner(), rank=1)
    assert [prof.run(_plan(i)) for i in range(8)] == list(range(8))  # results pass through
    assert [other.run(_plan(i)) for i in range(3)] == [0, 1, 2] and not other.plans and not other.timing
    prof.finish()  # a second finish writes nothing more
    summary = json.loads((tmp_path / "steps.json").read_text())
    assert summary["mode"] == ("trace" if trace else "events")
    assert [p["plan"] for p in summary["per_plan"]] == [2, 3, 4]
    assert [p["launched_mixed"] for p in summary["per_plan"]] == [False, True, False]
    assert [(p["decode_rows"], p["chunks"]) for p in summary["per_plan"]] == [(2, 0), (3, 1), (4, 0)]
    assert all(p["host_us"] > 0 for p in summary["per_plan"])
    assert summary["runner"] == dict(mixed_launched=1, chunks_taken=0)  # over the window: plans 2, 3, 4
    assert (tmp_path / "steps.trace.json").exists() == trace


def test_off_by_default():
    prof = profile.StepProfiler(_Runner(), rank=0)
    assert prof.run(_plan(0)) == 0 and prof.prof is None and not prof.timing
