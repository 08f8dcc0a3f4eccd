"""The server under test: a real uvicorn server on 127.0.0.1 (an ephemeral port), in
a thread of the test process, over an engine fixture.

`served` is the swappable part: a server over an engine of `ENGINES`. The module tests
run over the fake engine (`fake_engine.FakeEngine`, milliseconds a request); the real
engine on a tiny checkpoint at TP 1 and 2 (CPU ranks under the Triton interpreter,
seconds a step) runs every acceptance check in one launch per TP in
test_real_engine.py. Tests that need the fake's controls (pause, fail) take
`fake_server`.

Every wait is a bounded poll (`wait_until`), never a sleep standing in for an event;
deadlines are generous because CI runs on two busy cores.
"""

from __future__ import annotations

import threading
import time

import pytest

from sparkinfer.serve.server import OpenAIServer, ServeOptions
from sparkinfer.serve.state import ServerLimits
from tests.serve.fake_engine import FakeEngine

# Deadlines, seconds: far above what a request takes here (milliseconds), so only a
# hang fails them, even with four other test runs on the same two cores.
DEADLINE_S = 60.0
# A server process's start (Python, torch and the server stack imported): 9 s alone on the
# 2-core CI machine, past 60 s there with both test workers and their ranks running beside it.
START_S = 300.0
# Fast stop timings for in-process servers (the defaults wait 30 s for in-flight requests).
LIMITS = ServerLimits(grace_s=10.0, failure_grace_s=5.0, flush_s=5.0, poll_s=0.02)


def wait_until(cond, what: str, timeout_s: float = DEADLINE_S, every_s: float = 0.01):
    """Poll cond() until it returns a truthy value (returned); AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


class LiveServer:
    """OpenAIServer.run() in a thread; `error` holds what run() raised. options: more
    `ServeOptions` fields (api_key, allowed_origins)."""

    def __init__(self, engine, limits: ServerLimits = LIMITS, **options):
        self.engine = engine
        self.server = OpenAIServer(engine, ServeOptions(host="127.0.0.1", port=0, limits=limits,
                                                        log_level="warning", access_log=False, **options))
        sock = self.server.bind()  # listening before the thread starts: early requests queue, none is refused
        self.url, self.state = self.server.url, self.server.state
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(sock,), name="uvicorn", daemon=True)
        self.thread.start()

    def _run(self, sock) -> None:
        try:
            self.server.run(sock, announce=lambda line: None)
        except BaseException as e:  # noqa: BLE001 - the test asserts on it
            self.error = e

    def openai(self, **kw):
        """The real openai client, no retries (a 429 must reach the test), bounded waits."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                             timeout=kw.pop("timeout", DEADLINE_S), **kw)

    def http(self, **kw):
        import httpx

        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", DEADLINE_S), **kw)

    def exited(self, timeout_s: float = DEADLINE_S) -> bool:
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.stop()
            assert self.exited(), "the server did not stop"


def _tiny_engine(tp: int):
    """The real engine on a tiny checkpoint on CPU ranks."""
    import tempfile
    from pathlib import Path

    from sparkinfer.cli.demo import SEEDS
    from sparkinfer.engine import serving
    from sparkinfer.engine.config import EngineConfig
    from sparkinfer.models.presets import make_checkpoint

    path = make_checkpoint("qwen3_moe-tiny", Path(tempfile.mkdtemp(prefix="serve_tiny_")) / "qwen3_moe-tiny",
                           seed=SEEDS["qwen3_moe-tiny"])
    return serving.ServingEngine.launch(EngineConfig(model=str(path), tp=tp, backend="cpu", max_batch=16,
                                                     max_context=256, max_waiting=64, step_tokens=512,
                                                     prefill_wait_steps=0))


ENGINES = {
    "fake": lambda: FakeEngine(max_batch=16, max_waiting=64, max_context=256, step_s=0.002),
    "tiny-tp1": lambda: _tiny_engine(1),
    "tiny-tp2": lambda: _tiny_engine(2),
}


@pytest.fixture(scope="module", params=["fake"])
def served(request):
    """A LiveServer over each engine in ENGINES, shared by a module's tests."""
    engine = ENGINES[request.param]()
    live = LiveServer(engine)
    yield live
    live.stop()
    engine.close()


@pytest.fixture
def fake_server(request):
    """A LiveServer over a FakeEngine made with the test's `fake_kwargs` marker, if any."""
    marker = request.node.get_closest_marker("fake_kwargs")
    engine = FakeEngine(**(marker.kwargs if marker else {}))
    live = LiveServer(engine)
    yield live
    live.stop()
    engine.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "fake_kwargs(**kw): FakeEngine arguments of the fake_server fixture")
