"""Who may call the server: the API key on /v1/ (OpenAI's 401 for a missing or wrong
key, /health and /metrics open), CORS for browser origins, and the command line's
key from the flag or the environment."""

from __future__ import annotations

import json
import types

import openai
import pytest

from sparkinfer.cli import main
from sparkinfer.errors import SetupError
from sparkinfer.serve.access import add_access
from tests.serve.conftest import LiveServer
from tests.serve.fake_engine import FakeEngine

KEY = "sk-test-4f1e"
UI = "http://chat.example:3000"


@pytest.fixture(scope="module")
def guarded():
    engine = FakeEngine(max_batch=4, step_s=0.002, max_context=512)
    live = LiveServer(engine, api_key=KEY, allowed_origins=(UI,))
    yield live
    live.stop()
    engine.close()


def _unauthorized(live) -> float:
    return live.state.metrics.outcomes.labels(reason="unauthorized")._value.get()


def test_the_key_is_required_on_v1_and_the_server_answers_the_next_request(guarded):
    before = _unauthorized(guarded)
    for key in ("wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            guarded.openai(api_key=key).completions.create(model="fake-model", prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with guarded.http() as http:
        r = http.get("/v1/models")  # no header at all
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        # refused before the body is read: malformed JSON without the key is a 401, not a 400
        bad = http.post("/v1/completions", content=b'{"model": ', headers={"Authorization": "Basic " + KEY})
        assert bad.status_code == 401
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    assert _unauthorized(guarded) == before + 5
    client = guarded.openai(api_key=KEY)
    out = client.completions.create(model="fake-model", prompt="hello", max_tokens=5)
    assert out.choices[0].text == "hello"
    chunks = list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                                 max_completion_tokens=3, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "use"
    assert [m.id for m in client.models.list().data] == ["fake-model"]


def test_cors_allows_the_named_origin_only(guarded):
    preflight = {"Origin": UI, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with guarded.http() as http:
        r = http.options("/v1/chat/completions", headers=preflight)  # a preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        assert "POST" in r.headers["access-control-allow-methods"]
        other = http.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        body = {"model": "fake-model", "prompt": "abc", "max_tokens": 3}
        r = http.post("/v1/completions", json=body, headers={"Origin": UI, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
        assert r.json()["choices"][0]["text"] == "abc"
        r = http.post("/v1/completions", json=body, headers={"Origin": UI})  # CORS does not open the key check
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == UI


@pytest.mark.fake_kwargs(max_batch=4, step_s=0.002)
def test_an_open_server_sends_no_cors_headers_and_asks_no_key(fake_server):
    with fake_server.http() as http:
        r = http.post("/v1/completions", json={"model": "fake-model", "prompt": "ab", "max_tokens": 2},
                      headers={"Origin": UI})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_an_empty_key_is_refused_at_startup():
    with pytest.raises(SetupError, match="empty"):
        add_access(types.SimpleNamespace(add_middleware=None), api_key=" ")


def test_the_command_line_takes_the_key_from_the_flag_or_the_environment(monkeypatch):
    import argparse

    from sparkinfer.cli import serve

    ap = argparse.ArgumentParser()
    serve.add_parser(ap.add_subparsers())
    monkeypatch.delenv("SPARKINFER_API_KEY", raising=False)
    args = ap.parse_args(["serve", "--demo"])
    assert serve._options(args).api_key is None and serve._options(args).allowed_origins == ()
    monkeypatch.setenv("SPARKINFER_API_KEY", "from-env")
    assert serve._options(args).api_key == "from-env"
    args = ap.parse_args(["serve", "--demo", "--api-key", "from-flag", "--allowed-origins", UI, "*"])
    options = serve._options(args)
    assert options.api_key == "from-flag" and options.allowed_origins == (UI, "*")
    assert "from-flag" not in repr(options)  # never printed with the options


def test_bench_serve_sends_the_environments_key(guarded, tmp_path, monkeypatch):
    out = tmp_path / "serve.json"
    common = ["bench", "serve", "--url", guarded.url, "--input-len", "8", "--output-len", "4", "--num-requests",
              "4", "--concurrency", "2", "--warmup", "0", "--out", str(out)]
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert main(common) == 0
    row = json.loads(out.read_text())[-1]
    assert row["ok"] and row["completed"] == 4 and KEY not in out.read_text()
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    with pytest.raises(Exception, match="401"):  # the model list is asked first: the run stops there
        main(common)
