"""Refusals: each bad input gets a 400 with OpenAI's error body naming the field, and
the server answers the next request; overload gets a 429 with Retry-After while
every accepted request completes."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.serve.conftest import wait_until
from tests.serve.fake_engine import ByteTokenizer

OK = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (endpoint, body, the error's param, its code); "MODEL" stands for the served model's name
BAD = [
    ("completions", b'{"model": "MODEL", "prompt": "hi"', None, "invalid_json"),
    ("completions", b'["MODEL", "hi"]', None, "invalid_json"),
    ("completions", b"", None, "invalid_json"),
    ("completions", {"model": "no-such-model", **OK}, "model", "model_not_found"),
    ("completions", {"prompt": "hi"}, "model", "missing_field"),
    ("completions", {"model": "MODEL", "prompt": "x" * 300}, "prompt", "context_length_exceeded"),
    ("completions", {"model": "MODEL", "prompt": "hi", "max_tokens": 300}, "max_tokens", "context_length_exceeded"),
    ("completions", {"model": "MODEL", "prompt": ""}, "prompt", None),
    ("completions", {"model": "MODEL", "prompt": [1, 2, 99999]}, "prompt", None),
    ("completions", {"model": "MODEL", "prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("completions", {"model": "MODEL", **OK, "temperature": -1}, "temperature", "invalid_value"),
    ("completions", {"model": "MODEL", **OK, "top_p": 0}, "top_p", "invalid_value"),
    ("completions", {"model": "MODEL", **OK, "top_p": 1.5}, "top_p", "invalid_value"),
    ("completions", {"model": "MODEL", "prompt": "hi", "max_tokens": "2"}, "max_tokens", "invalid_value"),
    ("completions", {"model": "MODEL", **OK, "temperature": "hot"}, "temperature", "invalid_value"),
    ("completions", {"model": "MODEL", "prompt": ["hi", 5]}, "prompt", "invalid_value"),
    ("completions", {"model": "MODEL", "prompt": ["hi"] * 65}, "prompt", "invalid_value"),
    ("completions", {"model": "MODEL", "prompt": ["hi"] * 5, "n": 13}, "prompt", None),
    ("completions", {"model": "MODEL", "prompt": ["hi", ""]}, "prompt", None),
    ("completions", {"model": "MODEL", **OK, "n": 0}, "n", "invalid_value"),
    ("completions", {"model": "MODEL", **OK, "n": 17}, "n", "invalid_value"),
    ("completions", {"model": "MODEL", **OK, "logprobs": 6}, "logprobs", "invalid_value"),
    ("completions", {"model": "MODEL", **OK, "max_token": 5}, "max_token", "unknown_field"),
    ("completions", {"model": "MODEL", **OK, "stream_options": {"include_usage": True}}, "stream_options", None),
    ("chat/completions", {"model": "MODEL", "messages": []}, "messages", "invalid_value"),
    ("chat/completions", {"model": "MODEL", "messages": [{"role": "user"}], "max_tokens": 0}, "max_tokens",
     "invalid_value"),
    ("chat/completions", {"model": "MODEL", **CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs",
     "invalid_value"),
    ("chat/completions", {"model": "MODEL", **CHAT, "tools": [{"type": "function"}]}, "tools", "invalid_value"),
    ("chat/completions", {"model": "MODEL", "messages": [{"role": "user", "content": "x" * 300}]}, "messages",
     "context_length_exceeded"),
    # lone surrogates (JSON's \u escapes spell them): a prompt's answered 500, a stop string's dropped the connection
    ("completions", b'{"model": "MODEL", "prompt": "\\ud800abc", "max_tokens": 2}', "prompt", "invalid_value"),
    ("completions", b'{"model": "MODEL", "prompt": ["hi", "\\udfff"], "max_tokens": 2}', "prompt", "invalid_value"),
    ("completions", b'{"model": "MODEL", "prompt": "hi", "max_tokens": 2, "stop": ["\\udc00"]}', "stop",
     "invalid_value"),
    ("completions", b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}', "model", "invalid_value"),
    ("chat/completions", b'{"model": "MODEL", "messages": [{"role": "user", "content": "a\\ud800"}]}', "messages",
     "invalid_value"),
    ("chat/completions", b'{"model": "MODEL", "messages": [{"role": "user", "content": [{"type": "text", '
     b'"text": "\\ud800"}]}]}', "messages", "invalid_value"),
]


def _ids(case) -> str:
    endpoint, body, param, code = case
    return f"{endpoint.split('/')[0]}-{param or code}"


@pytest.mark.parametrize("case", BAD, ids=[_ids(c) for c in BAD])
def test_bad_input_gets_400_naming_the_field_and_the_server_answers_next(served, case):
    endpoint, body, param, code = case
    model = served.engine.model_name
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with served.http() as http:
        r = http.post(f"/v1/{endpoint}", content=raw.replace(b"MODEL", model.encode()),
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), err
        assert err["message"]
        nxt = http.post(f"/v1/{endpoint}", json={"model": model, **(OK if endpoint == "completions" else CHAT)})
        assert nxt.status_code == 200, nxt.text


@pytest.mark.parametrize("field, body", [
    ("prompt", b'{"model": "MODEL", "prompt": "\\ud800abc"}'),
    ("stop", b'{"model": "MODEL", "prompt": "hi", "stop": "\\udc00"}'),
    ("messages", b'{"model": "MODEL", "messages": [{"role": "user", "content": [{"type": "text", '
                 b'"text": "\\ud800"}]}]}'),
])
def test_a_lone_surrogate_is_named_whichever_type_the_field_takes(served, field, body):
    """The complaint is the text's, not the other members' of the field's union ("should be a valid list")."""
    endpoint = "chat/completions" if field == "messages" else "completions"
    with served.http() as http:
        r = http.post(f"/v1/{endpoint}", content=body.replace(b"MODEL", served.engine.model_name.encode()),
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text


def test_the_openai_client_sees_the_param(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.openai().completions.create(model=served.engine.model_name, prompt="hi", top_p=2.0)
    assert e.value.param == "top_p" and e.value.type == "invalid_request_error"


def test_unknown_route_is_an_openai_error_body(served):
    with served.http() as http:
        r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.fake_kwargs(tokenizer=ByteTokenizer(chat=False))
def test_chat_without_a_template_is_a_400(fake_server):
    with pytest.raises(openai.BadRequestError, match="no chat template") as e:
        fake_server.openai().chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.param == "messages"


@pytest.mark.fake_kwargs(max_batch=2, max_waiting=2, step_s=0.002)
def test_overload_gets_429_with_retry_after_and_every_accepted_request_completes(fake_server):
    """Two requests hold the slots and two wait (the engine paused: admitted, no tokens
    yet); the fifth is refused with 429 and Retry-After; then all four accepted ones
    complete with every token they asked for."""
    engine, client = fake_server.engine, fake_server.openai()

    def ask(prompt: str):
        return client.completions.create(model="fake-model", prompt=prompt, max_tokens=40, temperature=0,
                                         extra_body={"ignore_eos": True})

    engine.pause()
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(ask, p) for p in ("first", "second")]
        wait_until(lambda: engine.stats().running == 2, "two requests in the slots")
        waiting = [pool.submit(ask, p) for p in ("third", "fourth")]
        wait_until(lambda: engine.stats().waiting == 2, "two requests waiting")
        with pytest.raises(openai.RateLimitError) as e:
            ask("fifth")
        assert e.value.response.headers["retry-after"] == "2"  # the fake's 1.5 s, in whole seconds
        assert e.value.code == "engine_overloaded"
        engine.resume()
        outs = [f.result(timeout=60) for f in running + waiting]
    for out, prompt in zip(outs, ("first", "second", "third", "fourth")):
        assert out.usage.completion_tokens == 40 and out.choices[0].text.startswith(prompt)
    assert ask("sixth").choices[0].finish_reason == "length"
