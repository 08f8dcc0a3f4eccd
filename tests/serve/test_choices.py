"""Requests of n choices (OpenAI's `n`) over the fake engine: one engine request per
choice, seeded apart (seed + i) so each is the request it would be alone; choices
streamed with their index and one usage chunk at the end; a refusal turns away every
choice; a disconnect aborts every choice. The real engine's choices are checked
against single requests in test_real_engine.py."""

from __future__ import annotations

import json

import openai
import pytest

from sparkinfer.engine.request import MAX_SEED, SamplingParams
from sparkinfer.serve.protocol import choice_params
from tests.serve.conftest import wait_until
from tests.serve.fake_engine import expected_text


def test_choice_params_seed_each_choice_apart():
    p = SamplingParams(temperature=0.7, seed=MAX_SEED - 1, max_new_tokens=3)
    assert [c.seed for c in choice_params(p, 3)] == [MAX_SEED - 1, MAX_SEED, 0]
    assert all(c.temperature == 0.7 and c.max_new_tokens == 3 for c in choice_params(p, 3))
    unseeded = SamplingParams(seed=None)  # the engine draws a seed for each request
    assert choice_params(unseeded, 2) == [unseeded, unseeded]


def test_completion_of_n_choices(served):
    engine, client = served.engine, served.openai()
    before = len(engine.submitted)
    out = client.completions.create(model="fake-model", prompt="hello", max_tokens=7, n=3, seed=40,
                                    temperature=0.8, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [expected_text("hello", 7, True)] * 3
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 21)  # the prompt once
    sent = engine.submitted[before:]
    assert [p.seed for _, _, p in sent] == [40, 41, 42] and len({rid for rid, _, _ in sent}) == 3


def test_streamed_chat_of_n_choices(served):
    client = served.openai()
    messages = [{"role": "user", "content": "hi there"}]
    whole = client.chat.completions.create(model="fake-model", messages=messages, max_completion_tokens=6, n=2)
    chunks = list(client.chat.completions.create(model="fake-model", messages=messages, max_completion_tokens=6,
                                                 n=2, stream=True, stream_options={"include_usage": True}))
    roles = [c.choices[0].index for c in chunks[:2] if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]  # each choice's role first
    texts, reasons = {0: "", 1: ""}, {}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert reasons == {0: "length", 1: "length"}
    usage = chunks[-1].usage  # one usage chunk, after every choice finished
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 12)


def test_completion_of_several_prompts(served):
    """A list of prompts (texts, or token lists): n choices each, choice p * n + i being
    prompt p's i-th (seed + i); usage counts each prompt once. Streamed, the same texts."""
    engine, client = served.engine, served.openai()
    before = len(engine.submitted)
    out = client.completions.create(model="fake-model", prompt=["hello", "ab"], max_tokens=4, n=2, seed=40,
                                    temperature=0.8, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [expected_text("hello", 4, True)] * 2 + [expected_text("ab", 4, True)] * 2
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5 + 2, 16)
    sent = engine.submitted[before:]
    assert [(bytes(ids).decode(), p.seed) for _, ids, p in sent] == [("hello", 40), ("hello", 41), ("ab", 40),
                                                                   ("ab", 41)]
    texts = {}
    for chunk in client.completions.create(model="fake-model", prompt=[list(b"hello"), list(b"xyz")], max_tokens=4,
                                           stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or None
    assert texts == {0: expected_text("hello", 4), 1: expected_text("xyz", 4)}
    alone = [client.completions.create(model="fake-model", prompt=p, max_tokens=4).usage for p in ("hello", "xyz")]
    assert (usage.prompt_tokens, usage.completion_tokens) == (8, sum(u.completion_tokens for u in alone))


@pytest.mark.fake_kwargs(max_batch=1, max_waiting=2, step_s=0.002)
def test_a_refusal_turns_away_every_choice(fake_server):
    """Five choices cannot fit one slot and a queue of two: 429, and the choices already
    submitted are withdrawn (aborted in the engine, none left in flight or counted)."""
    engine, client = fake_server.engine, fake_server.openai()
    engine.pause()
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="fake-model", prompt="abc", max_tokens=4, n=5)
    sent = [rid for rid, _, _ in engine.submitted]
    assert 1 <= len(sent) <= 3 and set(sent) <= set(engine.aborted)
    assert not fake_server.state.in_flight
    outcomes = fake_server.state.metrics.outcomes
    assert outcomes.labels(reason="abort")._value.get() == 0
    assert outcomes.labels(reason="overloaded")._value.get() == 1
    engine.resume()
    wait_until(lambda: engine.stats().slots_used == 0 and engine.stats().waiting == 0, "the withdrawn choices gone")
    assert [c.text for c in client.completions.create(model="fake-model", prompt="ok", max_tokens=2, n=2).choices] \
        == ["ok", "ok"]


@pytest.mark.fake_kwargs(step_s=0.005, max_context=8192)
def test_a_disconnect_aborts_every_choice(fake_server):
    engine = fake_server.engine
    body = {"model": "fake-model", "prompt": "abc", "max_tokens": 5000, "ignore_eos": True, "n": 3, "stream": True}
    with fake_server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped line iterator closes the response
        first = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
        assert first["choices"][0]["text"]
        wait_until(lambda: engine.stats().slots_used == 3, "the three choices running")
    rids = [rid for rid, _, _ in engine.submitted]
    wait_until(lambda: set(rids) <= set(engine.aborted), "the engine to see every choice aborted")
    wait_until(lambda: engine.stats().slots_used == 0 and not fake_server.state.in_flight, "the slots to be free")
