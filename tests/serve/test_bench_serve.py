"""`sparkinfer bench serve` end to end against a server over the fake engine
(`--url`): fixed concurrency and Poisson arrivals, from one load-generator process or
two, every request measured, rows with provenance and no machine paths."""

from __future__ import annotations

import json
import re

import pytest

from sparkinfer.bench.serve_load import LoadSpec, RequestResult, _Tickets, prompts, summarize
from sparkinfer.cli import main

ABS_PATH = re.compile(r"/(root|work|home|tmp|Users)/")
STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.mark.fake_kwargs(max_batch=8, step_s=0.002, max_context=512)
def test_bench_serve_against_a_url(fake_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    common = ["--url", fake_server.url, "--input-len", "16", "--output-len", "6", "--num-requests", "8",
              "--vocab", "200", "--out", str(out)]
    assert main(["bench", "serve", *common, "--concurrency", "1,4", "--warmup", "1"]) == 0
    assert main(["bench", "serve", *common, "--rate", "200", "--max-concurrency", "4", "--warmup", "0"]) == 0
    assert main(["bench", "serve", *common, "--concurrency", "4", "--client-procs", "2", "--warmup", "0"]) == 0
    # more processes than streams asked: one stream a process at least, so no more processes
    assert main(["bench", "serve", *common, "--concurrency", "1", "--client-procs", "3", "--warmup", "0"]) == 0
    rows = json.loads(out.read_text())
    assert [(r["concurrency"], r["rate"], r["client_procs"]) for r in rows] == [
        (1, None, 1), (4, None, 1), (4, 200.0, 1), (4, None, 2), (1, None, 1)]
    # the server's side: its engine's steps over the level (the fake's stats count them)
    assert all(r["engine_steps"] > 0 and r["ms_per_engine_step"] > 0 for r in rows)
    assert all(0 <= r["mixed_engine_steps"] <= r["engine_steps"] for r in rows)  # the fake: half its steps
    # the steady window's steps, read off the counters sampled during the level (interpolated
    # between samples: these levels last tens of ms, so only the fields' consistency is checked
    # here; test_step_sampler_reads_off_a_window_between_its_samples checks the arithmetic)
    steady = [r for r in rows if "steady_engine_steps" in r]
    assert steady and all(r["steady_s"] is not None for r in steady)
    for r in steady:
        assert 0 < r["steady_engine_steps"] <= r["engine_steps"] and r["steady_ms_per_engine_step"] > 0, r
        assert r["steady_tokens_per_engine_step"] >= 0 and 0 <= r["steady_mixed_step_frac"] <= 1, r
        assert all(r[k] >= 0 for k in r if k.startswith("steady_") and k.endswith("_ms_mean")), r
    # the server's CPU a wall second over the level (/proc's clock ticks: 0 is possible on a short level)
    assert all(r["server_cpu_frac"] >= 0 and r["engine_cpu_frac"] == 0 for r in rows)  # the fake: in-process
    # the server's TTFT (its handler's request in to first token out) lies inside the client's, request by request
    assert all(0 < r["server_ttft_ms_mean"] <= r["ttft_ms_mean"] for r in rows)
    for r in rows:
        assert r["ok"] and (r["completed"], r["failed"], r["model"]) == (8, 0, "fake-model")
        assert r["output_tokens_per_s"] > 0 and r["request_throughput"] > 0
        assert all(r[f"{s}_p50"] <= r[f"{s}_p90"] <= r[f"{s}_p99"] for s in STATS)
        assert {"gpu", "torch", "commit", "date", "command"} <= set(r) and not ABS_PATH.search(json.dumps(r))
    # warm-up (1 request, 6 tokens) and two measured levels of 8: all reached the engine as asked
    sent = fake_server.engine.submitted
    assert len(sent) == 1 + 8 + 1 + 8 + 8 + 8 + 8 and all(len(p) == 16 and max(p) < 200 for _, p, _ in sent)
    assert all(params.ignore_eos and params.temperature == 0 for _, _, params in sent)
    # the two processes' streams drew the level's 8 requests from one pool: each prompt once
    level = LoadSpec(url="u", model="m", input_len=16, output_len=6, requests=8, vocab=200)
    assert sorted(tuple(p) for _, p, _ in sent[-16:-8]) == sorted(tuple(p) for p in prompts(level))
    shown = capsys.readouterr().out
    assert "serving fake-model: 16-token prompts, 6-token outputs" in shown and "TTFT p50" in shown


def test_step_sampler_reads_off_a_window_between_its_samples():
    """Steps and mixed steps inside [lo, hi], each counter interpolated linearly between the
    samples around lo and hi; None where the samples do not bracket the window."""
    from sparkinfer.bench.serve_load import StepSampler

    def c(steps, mixed, q_sum, q_n):  # a sample's counters: steps, and the queue histogram's sum and count
        return dict(steps=steps, mixed_steps=mixed, queue_sum=q_sum, queue_count=q_n)

    s = StepSampler("http://unused")
    s.samples = [(2.0, c(300, 10, 0.5, 9)), (0.0, c(0, 0, 0.0, 0)), (1.0, c(100, 10, 0.2, 8))]  # in any order
    assert s.within(0.5, 1.5) == pytest.approx((150.0, 5.0))
    assert s.within(0.0, 2.0) == pytest.approx((300.0, 10.0))
    assert s.within(-0.1, 1.0) is None and s.within(1.0, 2.5) is None and s.within(1.5, 1.5) is None
    assert StepSampler("http://unused").within(0.0, 1.0) is None  # a server without step counters
    # a histogram's sum and count: the first tokens of the window [1, 2] alone (one request, 0.3 s queued)
    assert s.within(1.0, 2.0, keys=("queue_sum", "queue_count")) == pytest.approx((0.3, 1.0))
    s.samples[1] = (0.0, c(0, 0, None, None))  # a server without the histograms
    assert s.within(0.5, 1.5, keys=("queue_sum", "queue_count")) is None


def test_summary_statistics():
    spec = LoadSpec(url="u", model="m", input_len=4, output_len=3, requests=3)
    done = [RequestResult(ok=True, prompt_tokens=4, output_tokens=3, ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1])
            for _ in range(2)]
    row = summarize([*done, RequestResult(error="HTTP 429: full")], wall_s=2.0, spec=spec)
    assert (row["completed"], row["failed"], row["ok"], row["errors"]) == (2, 1, False, ["HTTP 429: full"])
    assert row["output_tokens_per_s"] == 3.0 and row["total_tokens_per_s"] == 7.0 and row["request_throughput"] == 1
    assert row["ttft_ms_p50"] == pytest.approx(100) and row["tpot_ms_p99"] == pytest.approx(100)
    assert row["itl_ms_mean"] == pytest.approx(100) and row["e2e_ms_p90"] == pytest.approx(300)


def _closed_loop(streams: int, waves: int, client: int = 0, ttft: float = 0.5, chunks: int = 4,
                 gap: float = 0.25, tokens: int = 4) -> list[RequestResult]:
    """`streams` streams sending `waves` requests each back to back, wave w's request of
    stream s sent at w * (ttft + (chunks - 1) * gap) + s * 0.01: TTFT, then chunks."""
    e2e = ttft + (chunks - 1) * gap
    return [RequestResult(ok=True, prompt_tokens=8, output_tokens=tokens, ttft_s=ttft, e2e_s=e2e,
                          itl_s=[gap] * (chunks - 1), sent_s=w * e2e + s * 0.01, client=client)
            for w in range(waves) for s in range(streams)]


def test_steady_window_counts_the_tokens_between_first_completion_and_last_sending():
    spec = LoadSpec(url="u", model="m", input_len=8, output_len=4, requests=12, concurrency=3)
    results = _closed_loop(3, 4)  # E2E 1.25 s: the first completion at 1.25, the last sending at 3.77
    row = summarize(results, wall_s=5.02, spec=spec)
    start, end = 1.25, 3 * 1.25 + 0.02
    assert row["steady_s"] == pytest.approx(end - start)
    # back to back: every stream always has a request in flight, 0.5 s of each 1.25 before its first token
    assert row["steady_in_flight_frac"] == pytest.approx(1.0)
    assert row["steady_first_token_frac"] == pytest.approx(0.4, abs=0.02)  # the window cuts whole periods
    # the chunks that arrived in [start, end], one token each
    times = [r.sent_s + r.ttft_s + i * 0.25 for r in results for i in range(4)]
    inside = sum(start <= t <= end for t in times)
    assert row["steady_output_tokens_per_s"] == pytest.approx(inside / (end - start))
    # a chunk carrying two tokens counts for two: half the chunks, the same tokens
    merged = _closed_loop(3, 4, chunks=2, gap=0.75)
    inside = sum(start <= r.sent_s + r.ttft_s + i * 0.75 <= end for r in merged for i in range(2))
    assert summarize(merged, 5.02, spec)["steady_output_tokens_per_s"] == pytest.approx(2 * inside / (end - start))
    # a 0.25 s turn-around between a stream's requests: in flight 1.25 of every 1.5 s
    spaced = [RequestResult(**{**r.__dict__, "sent_s": r.sent_s + 0.25 * (r.sent_s // 1.25)})
              for r in _closed_loop(3, 6)]
    row = summarize(spaced, 9.0, LoadSpec(url="u", model="m", input_len=8, output_len=4, requests=18,
                                          concurrency=3))
    lo, hi = 1.25, 5 * 1.5 + 0.02  # the window: first completion, last sending; count in-flight streams at 1 ms
    ticks = [lo + i * 1e-3 for i in range(round((hi - lo) / 1e-3))]
    busy = sum(r.sent_s <= t < r.sent_s + r.e2e_s for t in ticks for r in spaced) / (3 * len(ticks))
    assert row["steady_s"] == pytest.approx(hi - lo) and busy < 0.85  # the turn-arounds show
    assert row["steady_in_flight_frac"] == pytest.approx(busy, abs=2e-3)
    # no window: one wave, Poisson arrivals, or a failed request
    assert summarize(_closed_loop(3, 1), 1.27, spec)["steady_output_tokens_per_s"] is None
    poisson = LoadSpec(url="u", model="m", input_len=8, output_len=4, requests=12, rate=4.0)
    assert summarize(results, 5.02, poisson)["steady_s"] is None
    assert summarize([*results[:-1], RequestResult(error="HTTP 500")], 5.02, spec)["steady_s"] is None
    # several client processes: the latest first completion to the earliest last sending
    two = _closed_loop(2, 4, client=0) + [RequestResult(**{**r.__dict__, "sent_s": r.sent_s + 0.1, "client": 1})
                                          for r in _closed_loop(2, 3)]
    row = summarize(two, 5.0, spec)
    assert row["steady_s"] == pytest.approx((2 * 1.25 + 0.01 + 0.1) - (1.25 + 0.1))


def _draw(shared, n, out):
    tickets = _Tickets(shared)
    while (i := tickets.take(n)) is not None:
        out.put(i)
    out.put(-1)


def test_tickets_hand_each_request_to_one_stream_across_processes():
    import multiprocessing as mp

    local = _Tickets()
    assert [local.take(3) for _ in range(5)] == [0, 1, 2, None, None]
    ctx = mp.get_context("spawn")
    shared, out = ctx.Value("q", 0), ctx.Queue()
    procs = [ctx.Process(target=_draw, args=(shared, 2000, out)) for _ in range(3)]
    for p in procs:
        p.start()
    got, ended = [], 0
    while ended < 3:
        i = out.get(timeout=120)
        ended += i < 0
        got += [i] if i >= 0 else []
    for p in procs:
        p.join(timeout=60)
    assert sorted(got) == list(range(2000))


def test_a_started_server_gets_the_scheduling_flags():
    """`bench serve --preset` starts `sparkinfer serve` with the flags it was given (and
    records them in its rows); unset ones leave the server's defaults."""
    import argparse

    from sparkinfer.bench.serve import _server_command, _server_setting, add_arguments

    def cmd(*extra):
        p = argparse.ArgumentParser()
        add_arguments(p)
        args = p.parse_args(["--preset", "qwen3-30b-a3b", *extra])
        return _server_command(args, [(8, None)], "ckpt"), _server_setting(args, "prefill_wait_steps")

    plain, wait = cmd()
    assert "--prefill-wait-steps" not in plain and "--mixed-steps" not in plain and wait == 0
    flagged, wait = cmd("--prefill-wait-steps", "3", "--no-mixed-steps")
    assert flagged[flagged.index("--prefill-wait-steps") + 1] == "3" and "--no-mixed-steps" in flagged and wait == 3


def test_policy_steps_count_what_the_scheduler_alone_needs():
    """One stream: each request's prefill step gives its first token, then a step a token,
    so requests x output_len steps (the served C = 1 level on an H200 counted exactly
    that). Many streams share steps; slower clients and the announced chunks' extra step
    only add steps; a level never takes fewer steps than its longest stream's tokens."""
    from sparkinfer.bench.serve_policy import policy_steps

    caps = dict(slots=8, chunk=4, step_tokens=16)
    assert policy_steps(1, 6, 10, 5, **caps) == 6 * 5
    shared = policy_steps(4, 16, 10, 5, **caps)
    assert 4 * 5 <= shared < 16 * 5
    assert policy_steps(4, 16, 10, 5, **caps, turnaround_steps=3) > shared
    assert policy_steps(4, 16, 10, 5, **caps, announce=8) >= shared


def test_a_started_servers_level_gets_its_policy_steps():
    """`bench serve` counts the policy's steps with the server it started: its max batch
    (the largest level), the engine's chunk and step budget, announced chunks where the
    level ran mixed steps."""
    import argparse

    from sparkinfer.bench.serve import _policy_steps, add_arguments
    from sparkinfer.bench.serve_policy import policy_steps

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--preset", "qwen3-30b-a3b", "--input-len", "300", "--output-len", "6"])
    levels = [(2, None), (4, None)]
    plain = policy_steps(2, 8, 300, 6, slots=4, chunk=256, step_tokens=2048)
    assert _policy_steps(args, levels, 2, 8, False) == plain
    assert _policy_steps(args, levels, 2, 8, True) == policy_steps(2, 8, 300, 6, slots=4, chunk=256,
                                                                  step_tokens=2048, announce=1024)


@pytest.mark.fake_kwargs(max_batch=4, step_s=0.002, max_context=512)
def test_conversations_send_their_turns_in_order_each_prompt_extending_the_last(fake_server, tmp_path, capsys):
    from sparkinfer.errors import ShapeError

    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--url", fake_server.url, "--input-len", "8", "--output-len", "3", "--turns", "3",
                 "--num-requests", "10", "--concurrency", "2", "--warmup", "0", "--vocab", "200",
                 "--out", str(out)]) == 0
    row = json.loads(out.read_text())[-1]
    assert "3-turn chats (prompt tokens found cached: 0%)" in capsys.readouterr().out
    # 10 requests rounded up to whole conversations of 3 turns; the fake keeps no prefix
    assert row["ok"] and (row["completed"], row["turns"], row["cached_prompt_frac"]) == (12, 3, 0.0)
    sent = [p for _, p, _ in fake_server.engine.submitted]
    assert sorted(map(len, sent)) == [8] * 4 + [16] * 4 + [24] * 4
    # each conversation's turn t + 1 arrives after its turn t, and begins with it
    for i, p in enumerate(sent):
        if len(p) > 8:
            assert any(q == p[:len(p) - 8] for q in sent[:i]), "a turn came before the turn it extends"
    spec = LoadSpec(url="u", model="m", input_len=4, output_len=2, requests=6, concurrency=2, turns=3)
    ps = prompts(spec)
    assert [len(p) for p in ps] == [4, 8, 12] * 2 and ps[1][:4] == ps[0] and ps[2][:8] == ps[1] and ps[3] != ps[0]
    assert prompts(LoadSpec(url="u", model="m", input_len=4, output_len=2, requests=3))[0] == \
        prompts(LoadSpec(url="u", model="m", input_len=4, output_len=2, requests=3, turns=1))[0]
    for bad in (dict(requests=5, concurrency=2, turns=3), dict(requests=6, rate=2.0, turns=3),
                dict(requests=6, turns=0)):
        with pytest.raises(ShapeError, match="turns"):
            LoadSpec(url="u", model="m", input_len=4, output_len=2, **bad)
    row = summarize([RequestResult(ok=True, prompt_tokens=16, output_tokens=2, ttft_s=0.1, e2e_s=0.2, itl_s=[0.1],
                                   cached_tokens=8)], 1.0, LoadSpec(url="u", model="m", input_len=16, output_len=2,
                                                                    requests=1, concurrency=1))
    assert row["cached_prompt_frac"] == 0.5


@pytest.mark.fake_kwargs(max_batch=8, step_s=0.002, max_context=512)
def test_load_processes_start_sending_together(fake_server, monkeypatch):
    """A load-generator process that starts 2 s after the other still sends its first request
    with the other's first: every process waits for all of them before its streams start."""
    import multiprocessing.context as mpc
    import time

    from sparkinfer.bench.serve_load import run_load_procs

    started = []
    real_start = mpc.SpawnProcess.start

    def late_start(self):
        if started:
            time.sleep(2.0)  # the second process starts late (a slow import, a busy host)
        started.append(self)
        real_start(self)

    monkeypatch.setattr(mpc.SpawnProcess, "start", late_start)
    spec = LoadSpec(url=fake_server.url, model="fake-model", input_len=8, output_len=4, requests=8,
                    concurrency=2, vocab=100)
    results, _ = run_load_procs(spec, 2)
    assert len(started) == 2 and len(results) == 8 and all(r.ok for r in results)
    # without the start line the first process drew the whole pool before the second started
    assert {r.client for r in results} == {0, 1}
    first = {c: min(r.sent_s for r in results if r.client == c) for c in (0, 1)}
    assert abs(first[0] - first[1]) < 1.0, first
    row = summarize(results, 1.0, spec)  # the row says how far apart they started
    assert row["first_send_spread_ms"] == pytest.approx(abs(first[0] - first[1]) * 1e3)


@pytest.mark.fake_kwargs(max_batch=8, step_s=0.002, max_context=512)
def test_load_processes_may_finish_in_any_order(fake_server):
    """Poisson arrivals, 3 requests over 2 processes (seed 2: the first sends 2 with 0.5 and
    1.6 s of waits, the second 1 with 0.5 s): the second reports and exits first, and the
    level still gathers both (a liveness check that took a later process for an earlier
    one raised 'died or stalled (1 of 2 reported)' here)."""
    from sparkinfer.bench.serve_load import run_load_procs

    spec = LoadSpec(url=fake_server.url, model="fake-model", input_len=8, output_len=2, requests=3, rate=1.0,
                    seed=2, vocab=100)
    results, _ = run_load_procs(spec, 2)
    assert len(results) == 3 and all(r.ok for r in results)
    assert sorted(r.client for r in results) == [0, 0, 1]
