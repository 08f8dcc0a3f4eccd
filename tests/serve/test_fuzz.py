"""Any JSON body, valid or not, gets a 200 or an OpenAI-style 400 naming a field it sent
(or one it lacks), never a 500 or a dropped connection, and the server keeps answering.

The bodies mix every field of both endpoints with values of every JSON type, extreme
numbers, empty and non-Unicode text (a lone surrogate once answered 500 in a prompt and
dropped the connection in a stop string), over the fake engine (a short context and
fast steps, so an accepted request finishes in milliseconds). The examples are fixed
(tests/conftest.py's profile): CI runs the same bodies every time."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.serve.conftest import LiveServer
from tests.serve.fake_engine import FakeEngine

NAME = "fake-model"
JUNK = [None, True, False, 0, 1, -1, 3, 2**31, 2**63, 2**70, 0.5, 1.5, -0.0, 1e308, float("nan"), "", "x", "\ud800",
        "\U0001f600", [], [1], ["a"], [[1, 2]], {}, {"a": 1}, {"include_usage": True}]
MESSAGES = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], [{"role": "user"}],
            [{"role": "user", "content": "h\ud800i"}],
            [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
            [{"role": "nobody", "content": "hi"}], [{"content": "hi"}]]
COMMON = ["model", "stream", "stream_options", "n", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
          "presence_penalty", "frequency_penalty", "logit_bias", "user", "max_tokens", "logprobs", "unknown_field"]
FIELDS = {"completions": COMMON + ["prompt", "echo", "best_of", "suffix"],
          "chat/completions": COMMON + ["messages", "max_completion_tokens", "top_logprobs", "response_format",
                                        "tools", "tool_choice", "parallel_tool_calls", "store", "metadata"]}
# What clients send, and its edges (lone surrogates, characters past U+FFFF, huge numbers)
USUAL = {"model": [NAME, "\ud800"], "messages": MESSAGES, "user": ["u1", "\udfff"],
         "prompt": ["hi", [104, 105], "h\ud800i", "\U0001f600", ["hi", "yo"], ["hi", "\udfff"], [[104], [105, 106]]],
         "max_tokens": [1, 4, 2**70], "max_completion_tokens": [2], "n": [1, 2], "seed": [7, 2**63 - 1],
         "stop": ["i", ["x", "y"], "\udc00", ["a", "\ud800"], "\U0001f600"], "temperature": [0, 0.7, 1e300],
         "top_p": [0.5, 1, 5e-324], "top_k": [-1, 5, 2**63, 2**70], "logprobs": [2, True], "top_logprobs": [3],
         "stream": [True, False], "stream_options": [{"include_usage": True}]}


@st.composite
def bodies(draw):
    endpoint = draw(st.sampled_from(sorted(FIELDS)))
    main = "prompt" if endpoint == "completions" else "messages"
    body = {"model": NAME, main: USUAL[main][0], "max_tokens": 3}
    for name in draw(st.lists(st.sampled_from(FIELDS[endpoint]), max_size=4, unique=True)):
        roll = draw(st.integers(0, 9))
        if roll < 7 and name in USUAL:
            body[name] = draw(st.sampled_from(USUAL[name]))
        elif roll == 9:
            body.pop(name, None)
        else:
            body[name] = draw(st.sampled_from(JUNK))
    return endpoint, body


@pytest.fixture(scope="module")
def live():
    engine = FakeEngine(max_batch=16, max_waiting=64, max_context=48, step_s=0.0005, name=NAME)
    server = LiveServer(engine)
    yield server
    server.stop()
    engine.close()


def _check(r, body: dict) -> None:
    assert r.status_code in (200, 400), (r.status_code, r.text)
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"], err
        assert err["param"] is None or err["param"] in body or err["param"] in ("model", "prompt", "messages"), err
    elif body.get("stream") is True:
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-200:]
    else:
        assert r.json()["choices"], r.text


@settings(max_examples=250, deadline=None)
@given(case=bodies())
def test_any_body_gets_a_200_or_a_400_naming_a_field(live, case):
    endpoint, body = case
    with live.http() as http:
        r = http.post(f"/v1/{endpoint}", content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"})
        _check(r, body)
        assert http.get("/health").status_code == 200
