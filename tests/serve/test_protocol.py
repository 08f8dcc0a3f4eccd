"""The wire format without a server: request -> SamplingParams, the checks that need
the prompt's length, and the engine's refusals -> HTTP errors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sparkinfer.engine.request import EngineStats
from sparkinfer.errors import CapacityError, EngineFailed, EngineOverloaded, ShapeError
from sparkinfer.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)
from sparkinfer.serve.state import ServerState

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_completion_fields_map_to_sampling_params():
    req = CompletionRequest(model="m", prompt="x", temperature=0.5, top_p=0.9, top_k=-1, seed=7, stop="##",
                            ignore_eos=True, logprobs=3, max_tokens=40)
    p = sampling_params(req, prompt_len=10, max_context=100)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos, p.logprobs, p.max_new_tokens) == \
        (0.5, 0.9, 0, 7, ("##",), True, 3, 40)


def test_defaults_follow_openai():
    """temperature 1; completions at most 16 new tokens (OpenAI's default) within the
    room left; chat the rest of the context; no seed (the engine draws one)."""
    p = sampling_params(CompletionRequest(model="m", prompt="x"), prompt_len=10, max_context=100)
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.seed, p.logprobs) == (1.0, 1.0, 0, 16, None, None)
    assert sampling_params(CompletionRequest(model="m", prompt="x"), prompt_len=95, max_context=100).max_new_tokens == 5
    assert sampling_params(ChatCompletionRequest(**CHAT), prompt_len=10, max_context=100).max_new_tokens == 90


def test_chat_logprobs_and_max_completion_tokens():
    req = ChatCompletionRequest(**CHAT, logprobs=True, top_logprobs=4, max_tokens=9, max_completion_tokens=5)
    p = sampling_params(req, prompt_len=10, max_context=100)
    assert (p.logprobs, p.max_new_tokens) == (4, 5)  # max_completion_tokens wins over the older max_tokens
    assert sampling_params(ChatCompletionRequest(**CHAT, logprobs=True), prompt_len=1, max_context=9).logprobs == 0
    assert sampling_params(ChatCompletionRequest(**CHAT), prompt_len=1, max_context=9).logprobs is None


@pytest.mark.parametrize("req, prompt_len, param, match", [
    (CompletionRequest(model="m", prompt="x"), 100, "prompt", "context is 100 tokens"),
    (ChatCompletionRequest(**CHAT), 120, "messages", "shorten the prompt"),
    (CompletionRequest(model="m", prompt="x", max_tokens=91), 10, "max_tokens", "ask for at most 90"),
    (ChatCompletionRequest(**CHAT, max_completion_tokens=95), 10, "max_completion_tokens", "at most 90"),
    (CompletionRequest(model="m", prompt="x", stream_options={"include_usage": True}), 1, "stream_options",
     "only allowed with stream"),
    (ChatCompletionRequest(**CHAT, top_logprobs=2), 1, "top_logprobs", "needs logprobs"),
], ids=["prompt-fills-context", "chat-prompt-fills-context", "max-tokens-past-context",
        "max-completion-tokens-past-context", "stream-options-without-stream", "top-logprobs-without-logprobs"])
def test_checks_that_need_the_prompt(req, prompt_len, param, match):
    with pytest.raises(APIError, match=match) as e:
        sampling_params(req, prompt_len=prompt_len, max_context=100)
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize("extra, field", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"best_of": 2}, "best_of"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 3.0}, "max_tokens"), ({"logprobs": 6}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"echo": True}, "echo"), ({"stop": [""]}, "stop"),
    ({"stop": ["a"] * 17}, "stop"), ({"seed": -1}, "seed"), ({"top_k": -2}, "top_k"), ({"stream": "yes"}, "stream"),
    ({"prompt": ["a", 1]}, "prompt"), ({"prompt": ["a"] * 65}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"tempearture": 0.5}, "tempearture"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_completion_request_rejects(extra, field):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **extra})
    assert e.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ["hi"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]), ([], [[]]),
])
def test_a_completion_takes_one_prompt_or_a_list(prompt, prompts):
    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompts() == prompts


def test_neutral_openai_fields_are_accepted():
    CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "n": 1, "echo": False, "best_of": 1,
                                      "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                                      "user": "u", "suffix": None, "temperature": None})
    ChatCompletionRequest.model_validate({**CHAT, "tools": [], "tool_choice": "none", "response_format":
                                          {"type": "text"}, "store": False, "metadata": {"k": "v"}})


def test_chat_messages_take_text_parts_and_ignore_echoed_keys():
    """A previous response's message sent back carries refusal/annotations: null."""
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": "ok", "refusal": None, "annotations": None, "tool_calls": None}]})
    assert [m.template_dict() for m in req.messages] == [{"role": "system", "content": "be brief"},
                                                         {"role": "assistant", "content": "ok"}]
    with pytest.raises(ValidationError, match="messages"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(ValidationError, match="messages"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})


class _Refusing:
    """An engine whose submit raises `error`."""

    model_name, tokenizer, max_context, eos_token_ids = "m", None, 100, ()

    def __init__(self, error):
        self.error = error

    def submit(self, prompt, params, request_id=None):
        raise self.error

    def abort(self, request_id):
        pass

    def stats(self):
        return EngineStats()

    def close(self):
        pass


@pytest.mark.parametrize("error, status, param, code", [
    (EngineOverloaded("queue full", retry_after_s=2.2), 429, None, "engine_overloaded"),
    (CapacityError("prompt too long"), 400, "prompt", "context_length_exceeded"),
    (ShapeError("token id 999999 outside the vocabulary"), 400, "prompt", None),
    (EngineFailed("rank 1 died", rank=1), 503, None, "engine_failed"),
], ids=["overloaded", "capacity", "shape", "failed"])
def test_engine_refusals_become_http_errors(error, status, param, code):
    from sparkinfer.engine.request import SamplingParams

    state = ServerState(_Refusing(error))
    with pytest.raises(APIError, match=str(error).split()[0]) as e:
        state.submit([1, 2], SamplingParams())
    assert (e.value.status, e.value.param, e.value.code) == (status, param, code)
    if status == 429:
        assert e.value.headers == {"Retry-After": "3"}  # whole seconds, rounded up
    if status == 503:
        assert state.failure and "rank 1" in state.failure and not state.admitting
    assert not state.in_flight


def test_text_chunks_are_pydantics_own_bytes():
    """A stream's text chunks, made from its template, equal pydantic's dump of the same
    chunk for every kind of character a tokenizer may decode (controls, quotes,
    backslashes, non-ASCII, the line separators JSON leaves alone)."""
    import random

    from sparkinfer.serve.handlers import TextChunks, sse
    from sparkinfer.serve.protocol import (
        ChatChunkChoice,
        ChatCompletionChunk,
        ChatDelta,
        CompletionChoice,
        CompletionResponse,
    )

    makes = [lambda t: CompletionResponse(id="cmpl-1", model="m/\"q\"", created=7, choices=[CompletionChoice(text=t)]),
             lambda t: ChatCompletionChunk(id="chatcmpl-1", model="ü", created=7,
                                           choices=[ChatChunkChoice(delta=ChatDelta(content=t))])]
    rng = random.Random(0)
    chars = [chr(i) for i in range(0x250)] + ["\u2028", "\u2029", "\ufffd", "\U0001f600", "\ud7ff", "\ue000", "中"]
    texts = ["", "\x00sparkinfer-text\x00"] + ["".join(rng.choice(chars) for _ in range(rng.randrange(1, 8)))
                                               for _ in range(3000)]
    for make in makes:
        chunks = TextChunks(make)
        assert chunks._cut is not None
        for t in texts:
            assert chunks(t) == sse(make(t)), repr(t)
    # a model name holding the stand-in itself: no template, pydantic's dump each time
    odd = TextChunks(lambda t: CompletionResponse(id="x", model="\x00sparkinfer-text\x00", created=7,
                                                  choices=[CompletionChoice(text=t)]))
    assert odd._cut is None and '"text":"a\\"b"' in odd('a"b')


_HUGE = [2**31 - 1, 2**31, 2**32 + 1, 2**63 - 1, 2**63, 2**70]
# Per field: values the protocol accepts, at their extremes, then one or two it refuses (so
# that path stays covered while most drawn requests are accepted and go on to the host path).
_POOLS = {
    "temperature": [0.0, 5e-324, 1e-300, 1e-45, 0.5, 2.0, 1e38, 1e300, 1.7976931348623157e308, -1.0],
    "top_p": [5e-324, 1e-45, 0.5, 1.0, 0.0, 2.0],
    "top_k": [-1, 0, 1, 5, *_HUGE, -2],
    "seed": [0, 7, 2**63 - 1, 2**63],
    "n": [1, 2, 16, 17],
    "logprobs": [0, 5, True, False, 6],  # completions take 0..5, chat a bool
    "max_tokens": [1, 2, 2**70, 0],
    "top_logprobs": [0, 20, 21],
    "max_completion_tokens": [1, 2**70],
}


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    **{name: st.sampled_from(pool) for name, pool in _POOLS.items()}, "ignore_eos": st.booleans(),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5))}),
    st.integers(1, 300), st.booleans())
def test_any_accepted_request_reaches_the_device_fields_intact(fields, prompt_len, chat):
    """Whatever numbers a request carries, it is refused (pydantic's 400, or APIError) or its
    choices' parameters travel the engine's host path: the plan's int64 words, decoded on the
    ranks to the same parameters, then the device's fp32 / int32 / int64 fields, without an
    exception (one top_k of 2**63 once stopped the engine) and without a wrapped integer."""
    from sparkinfer.engine.plan import SamplingColumns, _sampling_from
    from sparkinfer.engine.request import MAX_TOP_K
    from sparkinfer.engine.sampler import RowSampling
    from sparkinfer.serve.protocol import choice_params

    try:
        req = ChatCompletionRequest(**CHAT, **fields) if chat else CompletionRequest(model="m", prompt="x", **fields)
        params = choice_params(sampling_params(req, prompt_len=prompt_len, max_context=256), req.choices)
    except (ValidationError, APIError):
        return
    cols = SamplingColumns.of(params)
    for p, words in zip(params, cols.words):
        q = _sampling_from(words)
        assert (q.temperature, q.top_p, q.top_k, q.seed or 0, q.logprobs) == \
            (p.temperature, p.top_p, p.top_k, p.seed or 0, p.logprobs)
    host = {name: np.zeros(len(params) + 1, dtype=torch.empty(0, dtype=dt).numpy().dtype)
            for name, dt in RowSampling.FIELDS}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a numpy overflow warning a step in the engine's log
        RowSampling.write(host, cols, np.zeros(len(params), dtype=np.int64))
    assert host["top_k"][:-1].tolist() == [min(p.top_k, MAX_TOP_K) for p in params]
    assert host["seed"][:-1].tolist() == [p.seed or 0 for p in params]
    # a top_p below fp32's smallest is 0 there, which keeps the top token, as any top_p under its probability does
    assert all(0 <= t <= 1 for t in host["top_p"][:-1].tolist())
