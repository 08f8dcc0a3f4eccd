"""`sparkinfer serve` as a command: flags -> EngineConfig, SIGTERM (a subprocess) ends
with in-flight requests finished and exit 0, a failed engine exits 2 naming the rank."""

from __future__ import annotations

import signal
import sys
import types
from pathlib import Path

import openai
import pytest

from sparkinfer.bench.serve_process import started_server
from sparkinfer.cli import main
from sparkinfer.engine.config import EngineConfig
from sparkinfer.errors import SetupError
from tests.serve.conftest import DEADLINE_S, START_S, wait_until
from tests.serve.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]


def _stub_serving(monkeypatch, make_engine) -> list[EngineConfig]:
    """Put a `sparkinfer.engine.serving` whose ServingEngine.launch records its config
    and returns make_engine(); returns the list of configs it saw."""
    seen: list[EngineConfig] = []

    def launch(config):
        seen.append(config)
        return make_engine()

    module = types.ModuleType("sparkinfer.engine.serving")
    module.ServingEngine = types.SimpleNamespace(launch=launch)
    monkeypatch.setitem(sys.modules, "sparkinfer.engine.serving", module)
    return seen


def _failed_engine() -> FakeEngine:
    engine = FakeEngine()
    engine.fail(rank=1)
    return engine


def test_flags_map_to_engine_config_and_a_failed_engine_exits_2_naming_the_rank(monkeypatch, tmp_path, capsys):
    seen = _stub_serving(monkeypatch, _failed_engine)
    code = main(["serve", "--model", str(tmp_path), "--tp", "2", "--dcp", "2", "--moe-format", "nvfp4",
                 "--self-draft", "2", "--spec-k", "4", "--max-batch", "16", "--max-context", "2048",
                 "--max-waiting", "7", "--backend", "cpu", "--timeout", "9", "--served-model-name", "m",
                 "--port", "0", "--log-level", "warning"])
    assert code == 2
    assert seen == [EngineConfig(model=str(tmp_path), tp=2, dcp=2, moe_format="nvfp4", self_draft=2, spec_k=4,
                                 max_batch=16, max_context=2048, max_waiting=7, backend="cpu", timeout_s=9.0,
                                 name="m")]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "sparkinfer serve: EngineFailed: the engine failed: rank 1 died (exit code -9)"


def test_unset_flags_keep_the_engine_defaults(monkeypatch, tmp_path):
    seen = _stub_serving(monkeypatch, _failed_engine)
    assert main(["serve", "--model", str(tmp_path), "--port", "0", "--log-level", "warning"]) == 2
    assert seen == [EngineConfig(model=str(tmp_path))]


def test_draft_and_self_draft_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--model", "x", "--draft", "d", "--self-draft", "1"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_sigterm_finishes_in_flight_requests_closes_the_engine_and_exits_0():
    """The real signal path: uvicorn in a process's main thread, started as `bench
    serve` starts a server. A stream is in flight when SIGTERM arrives; it completes
    with every token, then the process closes the engine and exits 0."""
    with started_server([sys.executable, "-m", "tests.serve.fake_serve"], START_S, cwd=ROOT) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        stream = client.completions.create(model="fake-model", prompt="abc", max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True})  # 300 x 5 ms: in flight at SIGTERM
        chunks = [next(iter(stream))]
        server.proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert server.proc.wait(timeout=DEADLINE_S) == 0
    assert "".join(c.choices[0].text for c in chunks) == "abc" * 100
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_until(lambda: "fake engine closed\n" in server.output, "the engine's close to be printed")


def test_a_server_that_exits_before_serving_is_a_setup_error():
    with pytest.raises(SetupError, match="exited with status 3 before serving"), \
            started_server([sys.executable, "-c", "print('loading'); raise SystemExit(3)"], DEADLINE_S):
        pass
