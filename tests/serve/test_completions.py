"""Completions and chat through the real openai client against a real server, over
each engine of `conftest.ENGINES`: streaming and not, usage, logprobs, stop strings,
and 16 concurrent clients whose outputs equal each prompt served alone. Where the
engine is the fake, the exact text is checked too (`fake_engine.expected_text`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve.fake_engine import FakeEngine, expected_text

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def _stream_text(stream) -> tuple[str, str, object]:
    """(joined text, finish reason, usage) of a completions or chat stream."""
    text, reason, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text.append(c.text if hasattr(c, "text") else (c.delta.content or ""))
            reason = c.finish_reason or reason
    return "".join(text), reason, usage


def test_models_lists_the_served_model(served):
    models = served.openai().models.list().data
    assert [m.id for m in models] == [served.engine.model_name]
    assert models[0].model_extra["max_model_len"] == served.engine.max_context


def test_completion_streaming_and_not(served):
    client, model = served.openai(), served.engine.model_name
    whole = client.completions.create(model=model, prompt="hello world", max_tokens=7, **GREEDY)
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (11, 7, 18)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0  # an 11-token prompt: no whole chunk to reuse
    stream = client.completions.create(model=model, prompt="hello world", max_tokens=7, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    text, reason, usage = _stream_text(stream)
    assert (text, reason) == (choice.text, "length")
    assert (usage.prompt_tokens, usage.completion_tokens) == (11, 7)
    if isinstance(served.engine, FakeEngine):
        assert text == "hello w"


def test_stream_without_include_usage_sends_no_usage(served):
    stream = served.openai().completions.create(model=served.engine.model_name, prompt="abc", max_tokens=3,
                                                stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)


def test_chat_streaming_and_not(served):
    client, model = served.openai(), served.engine.model_name
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=9, **GREEDY)
    msg = whole.choices[0]
    assert (msg.message.role, msg.finish_reason, whole.usage.completion_tokens) == ("assistant", "length", 9)
    stream = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=9, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"  # the role first, then content
    text, reason, usage = _stream_text(chunks)
    assert (text, reason, usage.completion_tokens) == (msg.message.content, "length", 9)
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    if isinstance(served.engine, FakeEngine):  # the template's "system: be brief\nuser: hi\nassistant: "
        assert text == "system: b" and usage.prompt_tokens == len("system: be brief\nuser: hi\nassistant: ")


def test_prompt_as_token_ids(served):
    out = served.openai().completions.create(model=served.engine.model_name, prompt=[104, 105, 33], max_tokens=4,
                                             **GREEDY)
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4
    if isinstance(served.engine, FakeEngine):
        assert out.choices[0].text == "hi!h"


def test_logprobs(served):
    client, model = served.openai(), served.engine.model_name
    out = client.completions.create(model=model, prompt="hello", max_tokens=4, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=3, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    if isinstance(served.engine, FakeEngine):
        assert lp.tokens == ["h", "e", "l", "l"] and lp.text_offset == [0, 1, 2, 3]
        assert [t.token for t in content] == ["u", "s", "e"] and content[0].bytes == [117]


def test_sampling_fields_reach_the_engine(served):
    if not isinstance(served.engine, FakeEngine):
        pytest.skip("reads the fake engine's record of what it was sent")
    served.openai().completions.create(model=served.engine.model_name, prompt="abc", max_tokens=5, temperature=0.7,
                                       top_p=0.9, seed=11, stop=["x", "yz"],
                                       extra_body={"top_k": 4, "ignore_eos": True})
    p = served.engine.submitted[-1][2]
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos, p.max_new_tokens) == \
        (0.7, 0.9, 4, 11, ("x", "yz"), True, 5)


def test_stop_strings_and_eos(served):
    """The engine cuts the text before a stop string and ends at EOS; the server passes
    its text and finish reason through, streaming or not."""
    if not isinstance(served.engine, FakeEngine):
        pytest.skip("the fake's outputs are known in advance")
    client, model = served.openai(), served.engine.model_name
    for stream in (False, True):
        out = client.completions.create(model=model, prompt="hello world", max_tokens=30, stop="o w",
                                        stream=stream)
        text, reason = _stream_text(out)[:2] if stream else (out.choices[0].text, out.choices[0].finish_reason)
        assert (text, reason) == ("hell", "stop")
        out = client.completions.create(model=model, prompt="abc", max_tokens=30, stream=stream)  # EOS after "abc"
        text, reason = _stream_text(out)[:2] if stream else (out.choices[0].text, out.choices[0].finish_reason)
        assert (text, reason) == ("abc", "stop")


def test_16_concurrent_clients_equal_each_prompt_alone(served):
    """16 clients at once, half streaming: each gets what its prompt gets when served
    alone (the plumbing never crosses two requests' outputs)."""
    client, model = served.openai(), served.engine.model_name
    prompts = [f"prompt {i}: " + "xyz"[i % 3] * (1 + i % 5) for i in range(16)]

    def ask(i: int, stream: bool) -> str:
        out = client.completions.create(model=model, prompt=prompts[i], max_tokens=6 + i % 4, stream=stream, **GREEDY)
        return _stream_text(out)[0] if stream else out.choices[0].text

    alone = [ask(i, False) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: ask(i, i % 2 == 1), range(16)))
    assert together == alone
    if isinstance(served.engine, FakeEngine):
        assert alone == [expected_text(p, 6 + i % 4, ignore_eos=True) for i, p in enumerate(prompts)]
