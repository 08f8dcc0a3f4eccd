"""GET /metrics parses with prometheus_client's own parser, and its counters and
histograms match the requests sent."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import wait_until


def _scrape(live) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with live.http() as http:
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


@pytest.mark.fake_kwargs(max_batch=8, step_s=0.002)
def test_metrics_match_the_requests_sent(fake_server):
    client = fake_server.openai()
    asked = [("alpha", 5, False), ("beta gamma", 7, True), ("delta", 3, False), ("epsilon", 4, True)]
    for prompt, n, stream in asked:
        out = client.completions.create(model="fake-model", prompt=prompt, max_tokens=n, stream=stream,
                                        extra_body={"ignore_eos": True})
        if stream:
            list(out)
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                   max_completion_tokens=30)  # stops at EOS after its 20-token prompt
    with fake_server.http() as http:  # two refusals: a bad field, an unknown model
        assert http.post("/v1/completions", json={"model": "fake-model", "prompt": "x", "top_p": 9}).status_code == 400
        assert http.post("/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 400
    m = _scrape(fake_server)

    chat_prompt = len("user: hi\nassistant: ")
    assert m[("sparkinfer_prompt_tokens_total", ())] == sum(len(p) for p, _, _ in asked) + chat_prompt
    assert m[("sparkinfer_prompt_cached_tokens_total", ())] == 0  # the fake engine keeps no cache
    # generated tokens: each completion's n, and the chat's prompt replayed then EOS
    assert m[("sparkinfer_generation_tokens_total", ())] == sum(n for _, n, _ in asked) + chat_prompt + 1
    outcome = {dict(k[1])["reason"]: v for k, v in m.items() if k[0] == "sparkinfer_request_outcomes_total"}
    assert outcome == {"length": 4, "stop": 1, "invalid": 2, "abort": 0, "error": 0, "overloaded": 0,
                       "unavailable": 0, "unauthorized": 0}
    assert m[("sparkinfer_time_to_first_token_seconds_count", ())] == 5
    assert m[("sparkinfer_e2e_request_latency_seconds_count", ())] == 5
    # one inter-token sample per token after each request's first
    assert m[("sparkinfer_inter_token_latency_seconds_count", ())] == sum(n - 1 for _, n, _ in asked) + chat_prompt
    assert m[("sparkinfer_inter_token_latency_seconds_bucket", (("le", "+Inf"),))] == \
        m[("sparkinfer_inter_token_latency_seconds_count", ())]
    assert m[("sparkinfer_e2e_request_latency_seconds_sum", ())] > 0
    gauges = {name: m[(name, ())] for name in ("sparkinfer_requests_running", "sparkinfer_requests_waiting",
                                               "sparkinfer_cache_slots_used", "sparkinfer_cache_slots_total",
                                               "sparkinfer_engine_healthy", "sparkinfer_requests_in_flight")}
    assert gauges == {"sparkinfer_requests_running": 0, "sparkinfer_requests_waiting": 0,
                      "sparkinfer_cache_slots_used": 0, "sparkinfer_cache_slots_total": 8,
                      "sparkinfer_engine_healthy": 1, "sparkinfer_requests_in_flight": 0}
    assert m[("sparkinfer_engine_steps_total", ())] == fake_server.engine.stats().steps > 0
    assert m[("sparkinfer_engine_mixed_steps_total", ())] == fake_server.engine.stats().mixed_steps > 0
    # the fake engine runs in the server's process: no engine process CPU of its own; the HTTP process's own
    assert m[("sparkinfer_engine_process_cpu_seconds_total", ())] == 0 and m[("process_cpu_seconds_total", ())] > 0


@pytest.mark.fake_kwargs(max_batch=1, max_context=8192)
def test_gauges_follow_the_engine_while_requests_run(fake_server):
    """One request in the slot, one waiting (the engine paused: no tokens, so nothing
    finishes while the test scrapes)."""
    engine = fake_server.engine
    engine.pause()
    body = {"model": "fake-model", "prompt": "abc", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with fake_server.http() as http, http.stream("POST", "/v1/completions", json=body), \
            fake_server.http() as http2, http2.stream("POST", "/v1/completions", json=body):
        wait_until(lambda: engine.stats().waiting == 1, "a request in the slot and one waiting")
        m = _scrape(fake_server)
        assert (m[("sparkinfer_requests_running", ())], m[("sparkinfer_requests_waiting", ())],
                m[("sparkinfer_cache_slots_used", ())], m[("sparkinfer_requests_in_flight", ())]) == (1, 1, 1, 2)
        engine.resume()


def test_tokens_merged_into_the_first_output_count_as_inter_token_samples():
    """A reader that falls behind gets its request's outputs merged (RequestHandle.__aiter__),
    the first one included: its tokens after the first are inter-token samples too (of 0 s,
    they came with it), so the histogram counts every token after each request's first."""
    import asyncio
    import types

    from sparkinfer.engine.client import RequestHandle
    from sparkinfer.engine.request import FinishReason, RequestOutput, SamplingParams
    from sparkinfer.serve.metrics import ServeMetrics
    from sparkinfer.serve.state import Tracker

    metrics = ServeMetrics(types.SimpleNamespace(stats=lambda: None))
    state = types.SimpleNamespace(metrics=metrics, in_flight={}, engine=types.SimpleNamespace(abort=lambda _: None))
    handle = RequestHandle("r", [1, 2], SamplingParams())
    handle._push(RequestOutput("r", token_ids=[5]))
    handle._push(RequestOutput("r", token_ids=[6, 7]))  # queued before the reader looks: one output of 3
    handle._push(RequestOutput("r", token_ids=[8], finished=True, finish_reason=FinishReason.LENGTH))

    async def read():
        tracker = Tracker(state, handle, arrival=0.0)
        return [out async for out in tracker.outputs()]

    outs = asyncio.run(read())
    assert [tuple(o.token_ids) for o in outs] == [(5, 6, 7, 8)]

    def count(hist):
        return next(s.value for s in hist.collect()[0].samples if s.name.endswith("_count"))

    assert count(metrics.itl) == 3 and count(metrics.ttft) == 1  # the 3 tokens after the first


def test_loop_histogram_and_counter_expose_what_prometheus_client_s_would():
    """The per-token histogram and counter (plain counts on the event loop's thread) give
    the samples of prometheus_client's Histogram and Counter fed the same values: random
    gaps, values exactly on an edge, above the last edge, several samples at once."""
    import random

    from prometheus_client import CollectorRegistry, Counter, Histogram

    from sparkinfer.serve.metrics import ITL_BUCKETS, _LoopCounter, _LoopHistogram

    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = _LoopHistogram("h_seconds", "doc", ITL_BUCKETS, ours_reg)
    theirs = Histogram("h_seconds", "doc", buckets=ITL_BUCKETS, registry=theirs_reg)
    ours_c, theirs_c = _LoopCounter("c", "doc", ours_reg), Counter("c", "doc", registry=theirs_reg)
    rng = random.Random(3)
    values = [rng.uniform(0, 3.0) for _ in range(500)] + list(ITL_BUCKETS) + [0.0, 10.0]
    for v in values:
        n = rng.choice((1, 1, 1, 3))
        ours.observe(v, n)
        ours_c.inc(n)
        for _ in range(n):
            theirs.observe(v)
        theirs_c.inc(n)

    def samples(reg):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in reg.collect() for s in m.samples
                if not s.name.endswith("_created")}

    got, want = samples(ours_reg), samples(theirs_reg)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
