"""A request's and the server's ends: a client that disconnects aborts its request
(streaming or not) and frees its slot; a failed engine ends in-flight requests with
errors, turns /health 503 and stops the server with EngineFailed naming the rank; a
requested stop refuses new requests, lets in-flight ones finish, or aborts them
after the grace period."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from sparkinfer.errors import EngineFailed
from sparkinfer.serve.state import ServerLimits
from tests.serve.conftest import DEADLINE_S, LiveServer, wait_until
from tests.serve.fake_engine import FakeEngine

# A request long enough to be mid-flight whenever the test acts: 5,000 tokens x 5 ms = 25 s,
# on an engine whose context holds it.
LONG = {"model": "fake-model", "prompt": "abc", "max_tokens": 5000, "ignore_eos": True}
SLOW = dict(step_s=0.005, max_context=8192)


def _metric(live: LiveServer, reason: str) -> float:
    return live.state.metrics.outcomes.labels(reason=reason)._value.get()


@pytest.mark.fake_kwargs(**SLOW)
def test_streaming_client_disconnect_aborts_and_frees_the_slot(fake_server):
    engine = fake_server.engine
    with fake_server.http() as http, http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped line iterator closes the response, a disconnect of its own
        first = next(line for line in lines if line.startswith("data: "))
        rid = json.loads(first[len("data: "):])["id"].removeprefix("cmpl-")
        assert engine.stats().slots_used == 1
    # the connection is closed: within a step the engine saw the abort and the slot is free
    wait_until(lambda: rid in engine.aborted, "the engine to see the abort")
    wait_until(lambda: engine.stats().slots_used == 0 and not fake_server.state.in_flight, "the slot to be free")
    assert _metric(fake_server, "abort") == 1
    assert fake_server.openai().completions.create(model="fake-model", prompt="ok", max_tokens=2).choices[0].text


@pytest.mark.fake_kwargs(**SLOW)
def test_plain_client_disconnect_aborts_and_frees_the_slot(fake_server):
    """No stream to notice the disconnect: the server watches the connection itself.
    The client (httpx, async) cancels its request once the engine runs it, which
    closes the connection."""
    engine = fake_server.engine

    async def client():
        async with httpx.AsyncClient(base_url=fake_server.url, timeout=DEADLINE_S) as http:
            post = asyncio.create_task(http.post("/v1/completions", json=LONG))
            deadline = time.monotonic() + DEADLINE_S
            while engine.stats().running != 1:
                assert time.monotonic() < deadline and not post.done(), "the request never ran"
                await asyncio.sleep(0.01)
            post.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await post

    asyncio.run(client())
    rid = engine.submitted[-1][0]
    wait_until(lambda: rid in engine.aborted, "the engine to see the abort")
    wait_until(lambda: engine.stats().slots_used == 0 and not fake_server.state.in_flight, "the slot to be free")


def test_engine_failure_ends_requests_with_errors_and_stops_the_server():
    """A rank dies with three requests in flight (two streaming, one not): each ends
    with an error naming the rank, and the server exits with EngineFailed."""
    engine = FakeEngine(**SLOW)
    live = LiveServer(engine)
    client = live.openai()

    def stream():
        with pytest.raises(openai.APIError, match="rank 1 died"):
            for _ in client.completions.create(**{k: v for k, v in LONG.items() if k != "ignore_eos"}, stream=True,
                                               extra_body={"ignore_eos": True}):
                pass

    def plain():
        r = httpx.post(f"{live.url}/v1/completions", json=LONG, timeout=DEADLINE_S)
        return r.status_code, r.json()["error"]

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(stream), pool.submit(stream), pool.submit(plain)]
        wait_until(lambda: engine.stats().running == 3, "three requests decoding")
        engine.fail(rank=1)
        futures[0].result(DEADLINE_S), futures[1].result(DEADLINE_S)
        status, err = futures[2].result(DEADLINE_S)
    assert status == 500 and err["code"] == "engine_failed" and "rank 1 died" in err["message"]
    assert live.exited(), "the server did not exit after the engine failed"
    assert isinstance(live.error, EngineFailed) and "rank 1 died" in str(live.error)
    assert _metric(live, "error") == 3
    engine.close()


class _Unresponsive(FakeEngine):
    """Turns unhealthy without ending its requests: the server must end them itself."""

    def fail(self, rank: int) -> None:
        with self._lock:
            self._error = f"rank {rank} stopped answering"
        self.pause()


def test_failed_engine_that_keeps_requests_health_503_then_server_ends_them():
    engine = _Unresponsive(**SLOW)
    live = LiveServer(engine, ServerLimits(failure_grace_s=3.0, flush_s=5.0, poll_s=0.02))
    with ThreadPoolExecutor(1) as pool:
        plain = pool.submit(httpx.post, f"{live.url}/v1/completions", json=LONG, timeout=DEADLINE_S)
        wait_until(lambda: engine.stats().running == 1, "the request to decode")
        engine.fail(rank=0)
        with live.http() as http:
            wait_until(lambda: http.get("/health").status_code == 503, "/health to turn 503")
            assert "rank 0" in http.get("/health").json()["error"]
            refused = http.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"
        r = plain.result(DEADLINE_S)  # aborted by the server after failure_grace_s
    assert r.status_code == 500 and "rank 0 stopped answering" in r.json()["error"]["message"]
    assert live.exited() and isinstance(live.error, EngineFailed)
    engine.close()


def test_stop_refuses_new_requests_and_lets_in_flight_ones_finish():
    engine = FakeEngine(step_s=0.002)
    live = LiveServer(engine)  # grace 10 s
    engine.pause()  # the request is admitted but makes no tokens while the test looks at the stopping server
    stream = live.openai().completions.create(model="fake-model", prompt="abc", max_tokens=60, stream=True,
                                              extra_body={"ignore_eos": True})
    wait_until(lambda: engine.stats().running == 1, "the request in its slot")
    live.server.stop()
    with live.http() as http:
        wait_until(lambda: http.get("/health").status_code == 503, "/health to turn 503")
        refused = http.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    engine.resume()
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "abc" * 20
    assert chunks[-1].choices[0].finish_reason == "length"
    assert live.exited() and live.error is None
    engine.close()


def test_stop_aborts_what_outlives_the_grace_period():
    engine = FakeEngine(**SLOW)
    live = LiveServer(engine, ServerLimits(grace_s=0.5, flush_s=5.0, poll_s=0.02))
    with live.http() as http, http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        rid = json.loads(next(x for x in lines if x.startswith("data: "))[6:])["id"].removeprefix("cmpl-")
        live.server.stop()
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-1]["error"]["code"] == "aborted"  # the stream ends with an error event, then [DONE]
    assert rid in engine.aborted
    assert live.exited() and live.error is None
    engine.close()
