"""Completions and chat completions: a request becomes an engine call, its outputs
become a response or a stream of server-sent events.

    choices = start_completion(state, req)          # validate, tokenize, submit (APIError on refusal)
    events = completion_events(state, choices, req)  # async generator of "data: {...}\\n\\n" ... "data: [DONE]\\n\\n"
    body = await completion_response(state, choices, req)

Text, stop strings, finish reasons, logprobs and token counts come from the engine
(`RequestOutput`); this module only maps them to OpenAI's fields. A request of n
choices is n engine requests (`protocol.choice_params`: seed + i each), n for each
prompt of a completions request that sends several (choice p * n + i is prompt p's
i-th), streamed as they come, each chunk naming its choice's index; usage counts
each prompt once and every choice's tokens. A request the engine ended with an
error (a rank died) or aborted (the server is stopping) ends a stream with an error
event and a whole response with a 500 or 503 (with several choices: the first choice
to end so; the others are aborted).
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator

from pydantic import BaseModel

from sparkinfer.engine.request import FinishReason, RequestOutput
from sparkinfer.models.tokenizer import ChatTemplateError
from sparkinfer.serve.protocol import (
    MAX_ENGINE_REQUESTS,
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TopLogprob,
    Usage,
    choice_params,
    sampling_params,
)
from sparkinfer.serve.state import Choices, ServerState

__all__ = ["start_completion", "start_chat", "completion_events", "completion_response", "chat_events",
           "chat_response", "sse", "DONE"]

DONE = "data: [DONE]\n\n"
# OpenAI reports a log-probability too small to print as -9999 (JSON has no -inf).
MIN_LOGPROB = -9999.0


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


# Stands for a chunk's text while a stream's template is made: no model name or id holds it.
_TEXT = "\x00sparkinfer-text\x00"


# json.dumps(text, ensure_ascii=False) without building an encoder for its keyword (the
# same C function: a JSON string literal, non-ASCII kept), once a streamed token
_quote = json.encoder.encode_basestring


class TextChunks:
    """The chunks of one stream that carry text alone (no logprobs, no finish reason: all
    but the last of a stream), made without pydantic: pydantic's own dump of the stream's
    chunk with a stand-in text, cut around it, and `json.dumps` of each text between (the
    same escapes as pydantic's: `tests/serve/test_protocol.py` compares them). With
    `push_outputs` it took the HTTP process's event loop from 29.3 to 24.2 us a streamed
    token at concurrency 64 on the 2-core CI machine (sweeps/serve_http_cost_cpu.json)."""

    def __init__(self, make):
        """make(text): the stream's chunk of `text` as its pydantic model."""
        self.make = make
        head, *tail = sse(make(_TEXT)).split(json.dumps(_TEXT, ensure_ascii=False))
        self._cut = (head, tail[0]) if len(tail) == 1 else None  # None: the stand-in appeared twice

    def __call__(self, text: str) -> str:
        if self._cut is None:
            return sse(self.make(text))
        return self._cut[0] + _quote(text) + self._cut[1]


# ---------------------------------------------------------------------------- requests in
def _check_model(state: ServerState, name: str) -> None:
    if name != state.engine.model_name:
        raise APIError(400, f"model {name!r} is not served here; this server serves {state.engine.model_name!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")


def start_completion(state: ServerState, req: CompletionRequest) -> Choices:
    """Check the model, tokenize each text prompt, map the sampling fields, submit every
    prompt's choices (prompt p's choice i is choice p * n + i)."""
    state.check_admitting()
    _check_model(state, req.model)
    prompts = req.prompts()
    if len(prompts) * req.choices > MAX_ENGINE_REQUESTS:
        raise APIError(400, f"{len(prompts)} prompts x n={req.choices} is {len(prompts) * req.choices} completions; "
                            f"one request may ask for at most {MAX_ENGINE_REQUESTS}", param="prompt")
    submitted = []
    for i, text in enumerate(prompts):
        which = f"prompt {i}" if len(prompts) > 1 else "the prompt"
        if isinstance(text, str):
            if state.engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids",
                               param="prompt")
            prompt = list(state.engine.tokenizer.encode(text))
        else:
            prompt = list(text)
        if not prompt:
            raise APIError(400, f"{which} is empty", param="prompt")
        params = sampling_params(req, prompt_len=len(prompt), max_context=state.engine.max_context)
        submitted += [(prompt, p) for p in choice_params(params, req.choices)]
    return state.submit_choices(submitted)


def start_chat(state: ServerState, req: ChatCompletionRequest) -> Choices:
    """Check the model, apply the checkpoint's chat template, map the sampling fields, submit."""
    state.check_admitting()
    _check_model(state, req.model)
    tok = state.engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with token ids",
                       param="messages", code="chat_template_missing")
    try:
        prompt = list(tok.apply_chat_template([m.template_dict() for m in req.messages]))
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages", code="chat_template_error") from None
    params = sampling_params(req, prompt_len=len(prompt), max_context=state.engine.max_context)
    return state.submit_choices([(prompt, p) for p in choice_params(params, req.choices)], prompt_field="messages")


# ---------------------------------------------------------------------------- outputs out
def _failure(state: ServerState, out: RequestOutput) -> APIError | None:
    """The error a finished output stands for: ERROR (or ABORT after the engine failed:
    the server ended what the engine left) 500; ABORT 503 (the server is stopping);
    None otherwise."""
    failed = out.finish_reason is FinishReason.ABORT and state.failure is not None
    if out.finish_reason is FinishReason.ERROR or failed:
        why = out.error or state.failure or "no detail"
        return APIError(500, f"the engine failed while generating: {why}", type="server_error",
                        code="engine_failed", refused=False)
    if out.finish_reason is FinishReason.ABORT:
        return APIError(503, "the request was aborted: the server is shutting down", type="service_unavailable",
                        code="aborted", refused=False)
    return None


def _reason(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finished else None


def _token_text(tok, token_id: int) -> str:
    return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"


def _completion_logprobs(tok, outs: list[RequestOutput], offset: int) -> CompletionLogprobs:
    """Logprobs of `outs`' tokens; text offsets count from `offset` characters."""
    lp = CompletionLogprobs()
    for out in outs:
        for t in out.logprobs or ():
            text = _token_text(tok, t.token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(max(t.logprob, MIN_LOGPROB))
            lp.top_logprobs.append({_token_text(tok, i): max(v, MIN_LOGPROB) for i, v in t.top})
            lp.text_offset.append(offset)
            offset += len(text)
    return lp


def _chat_logprobs(tok, outs: list[RequestOutput]) -> ChatLogprobs:
    def entry(cls, token_id, logprob, **kw):
        text = _token_text(tok, token_id)
        return cls(token=text, logprob=max(logprob, MIN_LOGPROB), bytes=list(text.encode()), **kw)

    return ChatLogprobs(content=[
        entry(ChatTokenLogprob, t.token_id, t.logprob, top_logprobs=[entry(TopLogprob, i, v) for i, v in t.top])
        for out in outs for t in out.logprobs or ()])


def _usage(lasts: list[RequestOutput], n: int | None = None) -> Usage:
    """The request's usage from each choice's last output, every n of which share a
    prompt (None: all do): each prompt once, every choice's new tokens, and of each
    prompt the tokens every one of its choices found cached."""
    n = n or len(lasts)
    prompts = [lasts[i:i + n] for i in range(0, len(lasts), n)]
    return Usage.of(sum(p[0].prompt_tokens for p in prompts), sum(o.completion_tokens for o in lasts),
                    sum(min(o.cached_tokens for o in p) for p in prompts))


async def _choice_outputs(state: ServerState, choices: Choices) -> list[list[RequestOutput]]:
    """Every choice's outputs, once all have finished; the first failure raised."""
    outs: list[list[RequestOutput]] = [[] for _ in range(len(choices))]
    async with contextlib.aclosing(choices.outputs()) as merged:
        async for i, out in merged:
            if (err := _failure(state, out)) is not None:
                raise err
            outs[i].append(out)
    return outs


async def completion_response(state: ServerState, choices: Choices, req: CompletionRequest) -> CompletionResponse:
    outs = await _choice_outputs(state, choices)
    tok = state.engine.tokenizer
    body = [CompletionChoice(index=i, text="".join(o.text for o in c), finish_reason=_reason(c[-1]),
                             logprobs=_completion_logprobs(tok, c, 0) if req.logprobs is not None else None)
            for i, c in enumerate(outs)]
    return CompletionResponse(id=f"cmpl-{choices.request_id}", model=req.model, choices=body,
                              usage=_usage([c[-1] for c in outs], req.choices))


async def chat_response(state: ServerState, choices: Choices, req: ChatCompletionRequest) -> ChatCompletionResponse:
    outs = await _choice_outputs(state, choices)
    tok = state.engine.tokenizer
    body = [ChatChoice(index=i, message=ChatResponseMessage(content="".join(o.text for o in c)),
                       finish_reason=_reason(c[-1]), logprobs=_chat_logprobs(tok, c) if req.logprobs else None)
            for i, c in enumerate(outs)]
    return ChatCompletionResponse(id=f"chatcmpl-{choices.request_id}", model=req.model, choices=body,
                                  usage=_usage([c[-1] for c in outs]))


async def completion_events(state: ServerState, choices: Choices, req: CompletionRequest) -> AsyncIterator[str]:
    """One chunk per output that carries tokens (a chunk's text may be empty: the engine
    holds back text that may begin a stop string), the finish reason on a choice's last;
    once every choice has finished, a usage chunk (no choices) when
    stream_options.include_usage; then [DONE]."""
    rid, tok, n = f"cmpl-{choices.request_id}", state.engine.tokenizer, len(choices)
    created = int(time.time())  # one timestamp a stream, as OpenAI's chunks carry
    offsets, lasts = [0] * n, [None] * n

    def chunk(i: int, text: str, lp=None, finish=None) -> CompletionResponse:
        return CompletionResponse(id=rid, model=req.model, created=created,
                                  choices=[CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=finish)])

    texts = [TextChunks(functools.partial(chunk, i)) for i in range(n)]
    async with contextlib.aclosing(choices.outputs()) as merged:
        async for i, out in merged:
            if (err := _failure(state, out)) is not None:
                yield sse(err.body())
                break
            if req.logprobs is None and not out.finished:
                if out.token_ids or out.text:
                    offsets[i] += len(out.text)
                    yield texts[i](out.text)
            elif out.token_ids or out.text or out.finished:
                lp = _completion_logprobs(tok, [out], offsets[i]) if req.logprobs is not None else None
                offsets[i] += len(out.text)
                yield sse(chunk(i, out.text, lp, _reason(out)))
            if out.finished:
                lasts[i] = out
        else:
            if req.include_usage:
                yield sse(CompletionResponse(id=rid, model=req.model, created=created, choices=[],
                                             usage=_usage(lasts, req.choices)))
    yield DONE


async def chat_events(state: ServerState, choices: Choices, req: ChatCompletionRequest) -> AsyncIterator[str]:
    """Each choice's assistant role first, then content deltas as for completions."""
    rid, tok, n = f"chatcmpl-{choices.request_id}", state.engine.tokenizer, len(choices)
    created = int(time.time())
    lasts = [None] * n

    def model(choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=req.model, created=created, choices=choices, usage=usage)

    def chunk(choices, usage=None) -> str:
        return sse(model(choices, usage))

    texts = [TextChunks(lambda text, i=i: model([ChatChunkChoice(index=i, delta=ChatDelta(content=text))]))
             for i in range(n)]
    for i in range(n):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    async with contextlib.aclosing(choices.outputs()) as merged:
        async for i, out in merged:
            if (err := _failure(state, out)) is not None:
                yield sse(err.body())
                break
            if not req.logprobs and not out.finished:
                if out.token_ids or out.text:
                    yield texts[i](out.text)
            elif out.token_ids or out.text or out.finished:
                lp = _chat_logprobs(tok, [out]) if req.logprobs else None
                yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=out.text), logprobs=lp,
                                             finish_reason=_reason(out))])
            if out.finished:
                lasts[i] = out
        else:
            if req.include_usage:
                yield chunk([], _usage(lasts))
    yield DONE
