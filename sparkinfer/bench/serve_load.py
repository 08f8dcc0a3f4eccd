"""The load generator of `bench serve`: streaming completions against any
OpenAI-compatible server, at a fixed concurrency or with Poisson arrivals.

    spec = LoadSpec(url="http://127.0.0.1:8000", model="m", input_len=512, output_len=128,
                    requests=64, concurrency=8)
    results, wall_s = asyncio.run(run_load(spec))
    row = summarize(results, wall_s, spec)        # TTFT, TPOT, ITL p50/p90/p99, throughputs

Each request is a POST /v1/completions of `input_len` random token ids (so its
length is exact whatever the tokenizer, and no two prompts share a prefix) asking
for `output_len` tokens greedily with `ignore_eos` (so every output has that
length), streamed with usage. With `turns` > 1 a stream runs conversations: each
turn's prompt is the last turn's and `input_len` new ids, so prompts share prefixes
as a chat's do (`cached_prompt_frac`: the share of prompt tokens the server said it
found cached, `usage.prompt_tokens_details.cached_tokens`). Times are the client's: TTFT from sending the request
to the first chunk carrying tokens; ITL the gaps between such chunks (one chunk per
engine output: a speculative round's tokens arrive together); TPOT (e2e - TTFT) /
(output tokens - 1) per request; E2E sending to the last byte.

At a fixed concurrency C the run starts with C prompts at once and ends draining its
last C requests, neither of which a loaded server sees for long. The steady window
is what lies between: from the first completion to the last sending (the latest
first completion and the earliest last sending over the client processes), where
every stream has a request in flight (each completion sends the next one at once);
`steady_output_tokens_per_s` counts the output tokens that arrived in it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

__all__ = ["LoadSpec", "RequestResult", "run_load", "run_load_procs", "client_procs", "summarize", "steady",
           "served_model", "server_counters", "auth_headers"]


@dataclass(frozen=True)
class LoadSpec:
    """url: the server's base URL (http://host:port); model: the name to send.
    input_len / output_len: tokens per prompt and per output. requests: how many.
    concurrency: requests in flight at most (None: unbounded, with `rate`). rate:
    Poisson arrivals per second (None: as fast as `concurrency` allows). vocab:
    prompt ids are drawn from [0, vocab). seed: prompts and arrival times.
    timeout_s: one request's limit. api_key: sent as `Authorization: Bearer` (None:
    no header). turns: requests a conversation: turn t's prompt is its conversation's
    first t + 1 messages of input_len random tokens (the last turn's prompt, then a new
    message), sent when turn t - 1 completes, so a server that keeps a conversation's
    prefix finds it (fixed concurrency only; requests a multiple of turns)."""

    url: str
    model: str
    input_len: int
    output_len: int
    requests: int
    concurrency: int | None = None
    rate: float | None = None
    vocab: int = 256
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str | None = field(default=None, repr=False)
    turns: int = 1

    def __post_init__(self):
        from sparkinfer.errors import ShapeError

        if self.turns < 1 or self.requests % self.turns or (self.turns > 1 and self.rate is not None):
            raise ShapeError(f"turns={self.turns} with {self.requests} requests and rate={self.rate}: turns must be "
                             ">= 1, divide the requests, and (above 1) come with a fixed concurrency")


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its sending (sent_s:
    perf_counter then, one clock for every process of the host; client: the
    load-generator process)."""

    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    sent_s: float = 0.0
    client: int = 0
    cached_tokens: int = 0


def prompts(spec: LoadSpec) -> list[list[int]]:
    """Request i's prompt: turn i % turns of conversation i // turns (`LoadSpec.turns`)."""
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.requests // spec.turns):
        convo: list[int] = []
        for _ in range(spec.turns):
            convo = convo + [rng.randrange(spec.vocab) for _ in range(spec.input_len)]
            out.append(convo)
    return out


async def _one(client, spec: LoadSpec, prompt: list[int]) -> RequestResult:
    res = RequestResult(prompt_tokens=len(prompt))
    body = {"model": spec.model, "prompt": prompt, "max_tokens": spec.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = last = res.sent_s = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data.strip() == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"].get("message", event["error"]))[:300]
                    return res
                now = time.perf_counter()
                if event.get("choices"):
                    chunks += 1
                    if res.ttft_s is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                if event.get("usage"):
                    res.output_tokens = int(event["usage"]["completion_tokens"])
                    res.prompt_tokens = int(event["usage"]["prompt_tokens"])
                    res.cached_tokens = int((event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                                            or 0)
    except Exception as e:  # noqa: BLE001 - a failed request is a result, the run goes on
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.e2e_s = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or chunks  # a server that sends no usage: one token per chunk
    res.ok = res.ttft_s is not None
    return res


class _Tickets:
    """The next request of a level, shared by every stream of every load-generator
    process (a `multiprocessing` Value, or a plain counter in one process): a closed
    loop draws from one pool, so no process runs out of requests while another still
    has a queue (a static split left streams idle through a long tail)."""

    def __init__(self, shared=None):
        self.shared, self.next = shared, 0

    def take(self, n: int) -> int | None:
        if self.shared is None:
            i, self.next = self.next, self.next + 1
        else:
            with self.shared.get_lock():
                i = self.shared.value
                self.shared.value = i + 1
        return i if i < n else None


async def _run_load(spec: LoadSpec, todo: list[list[int]], on_done=None,
                    tickets: _Tickets | None = None) -> tuple[list[RequestResult], float, float]:
    """(every request's result in sending order, perf_counter at the first sending and at
    the last completion). Fixed concurrency: `concurrency` streams, each sending the next
    request of `tickets` (indices into todo) as its last one completes. Poisson arrivals:
    every request of todo at its arrival time, `concurrency` in flight at most."""
    import httpx

    limit = spec.concurrency or len(todo)
    rng = random.Random(spec.seed + 1)
    timeout = httpx.Timeout(spec.timeout_s, connect=60.0)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(base_url=spec.url, timeout=timeout, limits=limits,
                                 headers=auth_headers(spec.api_key)) as client:

        async def send(prompt):
            res = await _one(client, spec, prompt)
            if on_done is not None:
                on_done(res)
            return res

        t0 = time.perf_counter()
        if not spec.rate:
            tickets = tickets or _Tickets()
            done: dict[int, RequestResult] = {}

            async def stream():  # a conversation at a time (one request each without turns)
                while (c := tickets.take(len(todo) // spec.turns)) is not None:
                    for i in range(c * spec.turns, (c + 1) * spec.turns):
                        done[i] = await send(todo[i])

            await asyncio.gather(*(stream() for _ in range(limit)))
            return [done[i] for i in sorted(done)], t0, time.perf_counter()
        sem = asyncio.Semaphore(limit)

        async def bounded(prompt):
            async with sem:
                return await send(prompt)

        tasks = []
        for prompt in todo:
            tasks.append(asyncio.create_task(bounded(prompt)))
            await asyncio.sleep(rng.expovariate(spec.rate))
        results = await asyncio.gather(*tasks)
        return list(results), t0, time.perf_counter()


async def run_load(spec: LoadSpec, on_done=None) -> tuple[list[RequestResult], float]:
    """(every request's result in sending order, wall seconds from the first sending to
    the last completion). on_done(result) after each request."""
    results, t0, t1 = await _run_load(spec, prompts(spec), on_done)
    return results, t1 - t0


def client_procs(concurrency: int | None, cpus: int | None = None, asked: int | None = None) -> int:
    """Load-generator processes for a level: `asked`, else one per 8 streams, at most half
    the host's cores; never more than the streams (a process runs one at least). One
    asyncio client parses about 10,000 SSE chunks a second on an H200 host (its ITL at
    concurrency 32 and 64 was that rate, `serve_h200.json` at ff983b8): a level beyond it
    measures the client, not the server."""
    cpus = cpus or os.cpu_count() or 2
    procs = asked or max(1, min(-(-(concurrency or 8) // 8), cpus // 2))
    return min(procs, concurrency) if concurrency else procs


def _client(spec: LoadSpec, todo: list[list[int]], queue, index: int = 0, shared=None, go=None,
            wait_s: float = 600.0) -> None:
    """One load-generator process: its streams over the level's shared requests (`shared`:
    the tickets' Value; Poisson arrivals: `todo`, its own share); each completion, then
    its results, onto `queue`. go: an Event it waits for once started and ready to send
    (it says so on `queue`), so every process's streams start together."""
    import httpx  # noqa: F401 - imported before the start line, not inside the level's clock

    if go is not None:
        queue.put(("ready",))
        if not go.wait(wait_s):
            return
    results, t0, t1 = asyncio.run(_run_load(spec, todo, on_done=lambda r: queue.put(("done", r.ok)),
                                            tickets=None if shared is None else _Tickets(shared)))
    for r in results:
        r.client = index
    queue.put(("results", index, results, t0, t1))


def run_load_procs(spec: LoadSpec, procs: int, on_done=None, timeout_s: float | None = None):
    """`run_load` over `procs` processes (perf_counter is one clock for every process of
    the host): (results, wall s). Fixed concurrency: the streams shared evenly, the
    requests drawn from one pool (`_Tickets`); Poisson arrivals: requests and rate
    shared evenly. The processes start sending together, once every one has started
    (each says so, then waits for `go`): a process that started late left its streams
    idle while the others drew the pool, and the level measured fewer streams than it
    named (sweeps/serve_mixed_rows_ab_h100.json: 3 of 8 processes' streams in flight at
    concurrency 64, their clients slowed by a harness importing torch in each)."""
    import multiprocessing as mp
    import queue as queues
    from dataclasses import replace

    todo = prompts(spec)
    procs = client_procs(spec.concurrency, asked=procs)
    if procs <= 1:
        return asyncio.run(run_load(spec, on_done))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shared = None if spec.rate else ctx.Value("q", 0)
    go = ctx.Event()
    deadline = time.monotonic() + (timeout_s or spec.timeout_s * max(1, len(todo)))
    workers = []
    for i in range(procs):
        part = todo[i::procs] if spec.rate else todo
        conc = None if spec.concurrency is None else max(1, spec.concurrency // procs + (i < spec.concurrency % procs))
        sub = replace(spec, concurrency=conc, rate=spec.rate / procs if spec.rate else None, seed=spec.seed + i)
        workers.append(ctx.Process(target=_client, args=(sub, part, q, i, shared, go, deadline - time.monotonic()),
                                   daemon=True))
    for w in workers:
        w.start()
    parts, ready = {}, 0  # process index -> (results, t0, t1)
    while len(parts) < procs:
        try:
            msg = q.get(timeout=1.0)
        except queues.Empty:
            # a process that ended without its results died (they finish in any order)
            died = any(not w.is_alive() for i, w in enumerate(workers) if i not in parts) and q.empty()
            if time.monotonic() > deadline or died:
                for w in workers:
                    w.kill()
                raise RuntimeError(f"a load-generator process died or stalled ({len(parts)} of {procs} "
                                   "reported)") from None
            continue
        if msg[0] == "ready":
            ready += 1
            if ready == procs:
                go.set()
        elif msg[0] == "done":
            if on_done is not None:
                on_done(RequestResult(ok=msg[1]))
        else:
            parts[msg[1]] = msg[2:]
    for w in workers:
        w.join()
    results = [r for i in sorted(parts) for r in parts[i][0]]
    return results, max(p[2] for p in parts.values()) - min(p[1] for p in parts.values())


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(url: str, timeout_s: float = 30.0, api_key: str | None = None) -> str:
    """The first model a server lists at GET /v1/models."""
    import httpx

    r = httpx.get(f"{url}/v1/models", timeout=timeout_s, headers=auth_headers(api_key))
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _pcts(values: list[float], name: str) -> dict:
    """{name_mean, name_p50, name_p90, name_p99} in milliseconds (None when empty)."""
    import numpy as np

    if not values:
        return {f"{name}_{k}": None for k in ("mean", "p50", "p90", "p99")}
    ms = np.asarray(values) * 1e3
    return {f"{name}_mean": float(ms.mean()), **{f"{name}_p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)}}


def summarize(results: list[RequestResult], wall_s: float, spec: LoadSpec) -> dict:
    """One result row: counts, throughputs, and TTFT, TPOT, ITL, E2E statistics (ms).
    ok: every request completed with exactly output_len tokens."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    errors = sorted({r.error for r in results if r.error})
    prompt_tokens = sum(r.prompt_tokens for r in done)
    return dict(
        input_len=spec.input_len, output_len=spec.output_len, concurrency=spec.concurrency, rate=spec.rate,
        num_requests=len(results), completed=len(done), failed=len(results) - len(done), duration_s=wall_s,
        turns=spec.turns, cached_prompt_frac=sum(r.cached_tokens for r in done) / max(1, prompt_tokens),
        request_throughput=len(done) / wall_s, output_tokens_per_s=out_tokens / wall_s,
        total_tokens_per_s=(out_tokens + prompt_tokens) / wall_s,
        **_pcts([r.ttft_s for r in done], "ttft_ms"), **_pcts(tpot, "tpot_ms"),
        **_pcts([g for r in done for g in r.itl_s], "itl_ms"), **_pcts([r.e2e_s for r in done], "e2e_ms"),
        **steady(results, spec), first_send_spread_ms=_first_send_spread_s(results) * 1e3, errors=errors[:5],
        ok=len(done) == len(results) and all(r.output_tokens == spec.output_len for r in done))


def _first_send_spread_s(results: list[RequestResult]) -> float:
    """How far apart the load-generator processes sent their first requests (0 for one).
    They start together (`run_load_procs`): each waits for one event, then starts its
    event loop and client, so what is left is a busy host's wake-up; a spread of seconds
    would mean streams idle at the level's start."""
    first: dict[int, float] = {}
    for r in results:
        first[r.client] = min(first.get(r.client, r.sent_s), r.sent_s)
    return max(first.values()) - min(first.values()) if first else 0.0


def steady(results: list[RequestResult], spec: LoadSpec) -> dict:
    """{steady_s, steady_output_tokens_per_s, steady_in_flight_frac, steady_first_token_frac}:
    the steady window of a fixed-concurrency level (module docstring), the output tokens/s
    in it, the share of the C streams' time in it with a request in flight (sent, not yet
    answered to its last token: the rest is the client's and the HTTP path's turn-around),
    and the share of that in-flight time before a request's first token; None where the
    level has no such window (Poisson arrivals, a failed request, or fewer than two
    waves). A stream chunk of n tokens counts n / chunks of its request's tokens (servers
    may merge the outputs of a stream that falls behind)."""
    window = steady_window(results, spec)
    if window is None:
        return dict(steady_s=None, steady_output_tokens_per_s=None, steady_in_flight_frac=None,
                    steady_first_token_frac=None)
    start, end = window
    tokens = flight = first = 0.0
    for r in results:
        at = r.sent_s + r.ttft_s
        times = [at] + [at := at + g for g in r.itl_s]
        tokens += r.output_tokens / len(times) * sum(start <= t <= end for t in times)
        flight += max(0.0, min(end, r.sent_s + r.e2e_s) - max(start, r.sent_s))
        first += max(0.0, min(end, r.sent_s + r.ttft_s) - max(start, r.sent_s))
    return dict(steady_s=end - start, steady_output_tokens_per_s=tokens / (end - start),
                steady_in_flight_frac=flight / (spec.concurrency * (end - start)),
                steady_first_token_frac=first / flight if flight else None)


def steady_window(results: list[RequestResult], spec: LoadSpec) -> tuple[float, float] | None:
    """(start, end) perf_counter of the steady window (`steady`), or None where the level
    has none."""
    if spec.rate is not None or not results or not all(r.ok for r in results):
        return None
    clients = {r.client for r in results}
    start = max(min(r.sent_s + r.e2e_s for r in results if r.client == c) for c in clients)
    end = min(max(r.sent_s for r in results if r.client == c) for c in clients)
    return (start, end) if end > start else None


class StepSampler:
    """The server's counters (`server_counters`) sampled on a thread every `period_s` while a
    level runs, once more at its start and end: (perf_counter, counters) rows on the clients'
    clock (perf_counter is one clock for every process of the host), so `within` reads off
    what a window held, such as the steady one: its engine steps, or the sums and counts of
    the TTFT parts' histograms (the start's burst of C prompts, queued for the step's prompt
    budget, left out); `first` and `last`: the counters at the start and the end. No rows
    (and None) from a server that exports no step count. Each sample is one GET /metrics, served on the server's event
    loop beside the streams: four a second against the thousands of chunks it writes."""

    def __init__(self, url: str, period_s: float = 0.25):
        import threading

        self.url, self.period_s, self.samples = url, period_s, []
        self.first = self.last = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-sampler", daemon=True)

    def __enter__(self):
        self.first = self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.last = self._take()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._take()

    def _take(self) -> dict | None:
        t0 = time.perf_counter()
        c = server_counters(self.url)
        if c is not None:  # stamped at the scrape's midpoint
            self.samples.append(((t0 + time.perf_counter()) / 2, c))
        return c

    def within(self, lo: float, hi: float, keys=("steps", "mixed_steps")) -> tuple[float, ...] | None:
        """How much each counter of `keys` (default: steps, mixed steps) grew between
        perf_counter lo and hi, interpolated linearly between the samples around lo and hi;
        None unless samples bracket [lo, hi] and every sample holds the keys."""
        s = sorted(self.samples, key=lambda x: x[0])
        if len(s) < 2 or not s[0][0] <= lo < hi <= s[-1][0] or any(c.get(k) is None for _, c in s for k in keys):
            return None
        import numpy as np

        t = np.array([x[0] for x in s])
        return tuple(float(np.interp(hi, t, v) - np.interp(lo, t, v))
                     for v in (np.array([c[k] for _, c in s], dtype=float) for k in keys))


# The server's TTFT histogram and the histograms of its parts (serve/metrics.py)
TTFT_PARTS = ("pickup", "queue", "prefill", "return", "ttft")


def server_counters(url: str, timeout_s: float = 10.0) -> dict | None:
    """{"steps", "mixed_steps", "server_cpu_s", "engine_cpu_s", "<part>_sum", "<part>_count"}:
    the server's `sparkinfer_engine_steps_total`, `sparkinfer_engine_mixed_steps_total`, its
    HTTP process's `process_cpu_seconds_total`, `sparkinfer_engine_process_cpu_seconds_total`,
    and the sums and counts of the request pickup, queue, prefill and return time and the
    time-to-first-token histograms (parts TTFT_PARTS; 0 or None when absent) from GET
    /metrics; None from a server that exports no step count."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {"sparkinfer_engine_steps_total": "steps", "sparkinfer_engine_mixed_steps_total": "mixed_steps",
             "process_cpu_seconds_total": "server_cpu_s", "sparkinfer_engine_process_cpu_seconds_total": "engine_cpu_s",
             **{f"sparkinfer_request_{k}_time_seconds_{s}": f"{k}_{s}" for k in TTFT_PARTS if k != "ttft"
                for s in ("sum", "count")},
             **{f"sparkinfer_time_to_first_token_seconds_{s}": f"ttft_{s}" for s in ("sum", "count")}}
    got = {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=timeout_s).text
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if sample.name in names:
                    got[names[sample.name]] = sample.value
    except (httpx.HTTPError, ValueError):
        return None
    if "steps" not in got:
        return None
    return {"server_cpu_s": None, "engine_cpu_s": None, **{f"{k}_{s}": None for k in TTFT_PARTS
                                                            for s in ("sum", "count")}, **got,
            "steps": int(got["steps"]), "mixed_steps": int(got.get("mixed_steps", 0))}
