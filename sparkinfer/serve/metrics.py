"""The server's Prometheus metrics, in a registry of its own (two apps in one
process, as in the tests, never share counters).

    metrics = ServeMetrics(engine)
    metrics.prompt_tokens.inc(12)
    text = metrics.render()                 # GET /metrics, Prometheus text format

Engine state (running and waiting requests, cache slots, health, steps) is read
from `engine.stats()` when scraped, so it is never stale; counters and histograms
are fed by the HTTP layer as outputs arrive:

    sparkinfer_requests_running / _waiting          gauges, from the engine
    sparkinfer_cache_slots_used / _total            gauges, from the engine
    sparkinfer_engine_healthy                        1 or 0
    sparkinfer_engine_steps_total                    counter, from the engine
    sparkinfer_engine_mixed_steps_total              counter, from the engine: steps whose prompt
                                                     chunks ran beside decode rows (mixed steps)
    sparkinfer_requests_in_flight                    requests the HTTP layer is serving
    sparkinfer_prompt_tokens_total                   prompt tokens of accepted requests
    sparkinfer_prompt_cached_tokens_total            of them, found in a cache slot (prefix reuse)
    sparkinfer_generation_tokens_total               tokens sent back, as they stream
    sparkinfer_request_outcomes_total{reason}        stop | length | abort | error: how an accepted request
                                                     ended; invalid (400) | overloaded (429) | unavailable (503)
                                                     | unauthorized (401, no API key): why one was refused
    sparkinfer_time_to_first_token_seconds           histogram, arrival to the first token; its parts:
    sparkinfer_request_pickup_time_seconds           histogram, the submit to the engine's receipt
    sparkinfer_request_queue_time_seconds            histogram, the receipt to the step that first ran the prompt
    sparkinfer_request_prefill_time_seconds          histogram, that step to the first token out of the engine
    sparkinfer_request_return_time_seconds           histogram, the first token out of the engine to its handler
    sparkinfer_inter_token_latency_seconds           histogram, one sample per token (see `observe_tokens`)
    sparkinfer_e2e_request_latency_seconds           histogram, arrival to the last output
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["ServeMetrics", "OUTCOMES"]

OUTCOMES = ("stop", "length", "abort", "error", "invalid", "overloaded", "unavailable", "unauthorized")

# Bucket edges, seconds. TTFT: a 512-token prefill of Qwen3-30B-A3B's 8 layers takes
# milliseconds on an H200, a queued request waits for whole generations (seconds), and
# CPU ranks under the Triton interpreter take seconds per step: 1 ms .. 60 s.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A hop between the server's processes: a pipe message (tens of us), at most a step (ms).
HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# ITL: a decode step of 8 layers of Qwen3-30B-A3B is 676 us at batch 1 and 1,774 us at
# 64 (README's decode table); 48 layers are 6x that; CPU steps take 0.1-2 s: 0.5 ms .. 2.5 s.
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.01, 0.02, 0.04, 0.1, 0.25, 0.5, 1.0, 2.5)
# End to end: a few tokens on a GPU (10 ms) to thousands of tokens on CPU ranks (10 min).
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector:
    """Gauges read from `engine.stats()` at scrape time, plus the server's in-flight count."""

    def __init__(self, engine, in_flight):
        self.engine, self.in_flight = engine, in_flight

    def describe(self):
        return []  # registering must not call stats() (collect would, with auto_describe)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.stats()
        for name, doc, value in (
                ("sparkinfer_requests_running", "requests holding a cache slot (prefilling or decoding)", s.running),
                ("sparkinfer_requests_waiting", "requests queued for a cache slot", s.waiting),
                ("sparkinfer_cache_slots_used", "cache slots in use", s.slots_used),
                ("sparkinfer_cache_slots_total", "cache slots", s.slots_total),
                ("sparkinfer_engine_healthy", "1 while the engine serves, 0 once it failed", int(s.healthy)),
                ("sparkinfer_requests_in_flight", "requests the HTTP server is serving", self.in_flight())):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("sparkinfer_engine_steps", "engine steps run", value=s.steps)
        yield CounterMetricFamily("sparkinfer_engine_mixed_steps",
                                  "engine steps whose prompt chunks ran beside decode rows in one forward",
                                  value=s.mixed_steps)
        yield CounterMetricFamily("sparkinfer_engine_process_cpu_seconds",
                                  "CPU seconds of the engine process (scheduler, detokenization, pipe)",
                                  value=s.engine_cpu_s)


class _LoopHistogram:
    """A histogram fed once a streamed token (the inter-token latency): plain counts that
    only the event loop's thread updates and reads (the trackers and GET /metrics both run
    there), exposed through prometheus_client's collector API with a `Histogram`'s series.
    prometheus_client's `Histogram.observe` takes a lock for its sum and another for its
    bucket, found by a linear scan of the edges, and was the HTTP process's largest
    metrics cost a token: with `handlers._quote` this took its event loop from 65.7 / 66.3
    to 55.3 / 54.7 us a streamed token at C = 64 on the 2-core CI machine
    (sweeps/serve_http_cost_metrics_cpu.json). tests/serve/test_metrics.py compares its
    series with a `Histogram`'s."""

    def __init__(self, name: str, doc: str, buckets: tuple, registry):
        self.name, self.doc, self.edges = name, doc, tuple(buckets)
        self.counts = [0] * (len(self.edges) + 1)  # the last: above every edge (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        """n samples of value (a bucket holds the values <= its edge, as Histogram's)."""
        self.counts[bisect_left(self.edges, value)] += n
        self.sum += value * n

    def describe(self):
        return []  # registering must not collect (auto_describe would)

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        total, buckets = 0, []
        for edge, c in zip(self.edges + (float("inf"),), self.counts):
            total += c
            buckets.append((floatToGoString(edge), total))
        return [HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)]


class _LoopCounter:
    """A counter fed once a streamed token, updated and read on the event loop's thread
    alone (see `_LoopHistogram`), exposed as a `Counter`'s `<name>_total`."""

    def __init__(self, name: str, doc: str, registry):
        self.name, self.doc, self.value = name, doc, 0
        registry.register(self)

    def inc(self, n: int = 1) -> None:
        self.value += n

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        return [CounterMetricFamily(self.name, self.doc, value=self.value)]


class ServeMetrics:
    """The app's collectors. in_flight: a callable giving the requests being served."""

    def __init__(self, engine, in_flight=lambda: 0):
        from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector

        self.registry = reg = CollectorRegistry()
        reg.register(_EngineCollector(engine, in_flight))
        ProcessCollector(registry=reg)  # this (the HTTP) process's process_cpu_seconds_total, memory, fds
        self.cached_prompt_tokens = Counter("sparkinfer_prompt_cached_tokens",
                                            "prompt tokens found in a cache slot (prefix reuse), not prefilled again",
                                            registry=reg)
        self.prompt_tokens = Counter("sparkinfer_prompt_tokens", "prompt tokens of accepted requests",
                                     registry=reg)
        self.generation_tokens = _LoopCounter("sparkinfer_generation_tokens", "generated tokens sent to clients",
                                              reg)
        self.outcomes = Counter("sparkinfer_request_outcomes", "requests by how they ended or why they were refused",
                                ["reason"], registry=reg)
        for reason in OUTCOMES:  # every series exists from the start, at 0
            self.outcomes.labels(reason=reason)
        self.ttft = Histogram("sparkinfer_time_to_first_token_seconds", "arrival to the first generated token",
                              buckets=TTFT_BUCKETS, registry=reg)
        # the engine's share of it: waiting for a cache slot and a step's prompt budget, then the prompt's steps
        self.queue_time = Histogram("sparkinfer_request_queue_time_seconds",
                                    "engine's receipt to the step that first ran the prompt",
                                    buckets=TTFT_BUCKETS, registry=reg)
        self.prefill_time = Histogram("sparkinfer_request_prefill_time_seconds",
                                      "the step that first ran the prompt to the first token out of the engine",
                                      buckets=TTFT_BUCKETS, registry=reg)
        # the ways in and out of the engine process (FirstTimings)
        self.pickup_time = Histogram("sparkinfer_request_pickup_time_seconds",
                                     "the server's submit to the engine's receipt (the pipe, the step in progress)",
                                     buckets=HOP_BUCKETS, registry=reg)
        self.return_time = Histogram("sparkinfer_request_return_time_seconds",
                                     "the first token out of the engine to its HTTP handler (the engine's flush, "
                                     "the pipe, the reader thread, the event loop)", buckets=HOP_BUCKETS, registry=reg)
        self.itl = _LoopHistogram("sparkinfer_inter_token_latency_seconds",
                                  "time between generated tokens (one sample per token)", ITL_BUCKETS, reg)
        self.e2e = Histogram("sparkinfer_e2e_request_latency_seconds", "arrival to the last output",
                             buckets=E2E_BUCKETS, registry=reg)

    def outcome(self, reason: str) -> None:
        self.outcomes.labels(reason=reason).inc()

    def observe_tokens(self, n: int, gap_s: float) -> None:
        """n tokens arrived in one output, gap_s after the previous output: n samples of
        gap_s / n (a speculative round brings several tokens at once; per-token samples
        keep the histogram's sum the decode time and its count the tokens)."""
        self.itl.observe(gap_s / n, n)

    def render(self) -> tuple[bytes, str]:
        """(the registry in Prometheus text format, its content type)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
