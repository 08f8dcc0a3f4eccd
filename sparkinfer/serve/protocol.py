"""The OpenAI wire format: request models (each field with its default and
bounds, so validation and the 400 message come from here), response and stream
chunk models, the error body, and the one mapping from a request to the engine's
`SamplingParams`.

    req = CompletionRequest.model_validate_json(body)          # FastAPI does this
    params = sampling_params(req, prompt_len=12, max_context=4096)

Requests are strict: a field of the wrong JSON type is a 400 (no "5" for 5), and
an unknown top-level field is a 400 naming it, as OpenAI's own API answers
("Unrecognized request argument supplied"): a misspelt `temprature` silently
ignored would sample with the default and look like a model problem. OpenAI
fields this server does not implement are accepted at their neutral value only
(presence_penalty 0, echo false, best_of 1, ...) and rejected otherwise, so no request is
served with different maths than it asked for. Chat messages ignore unknown keys:
clients send a previous response's message back (with `refusal`, `annotations`,
`tool_calls`: null), and a message key cannot change how tokens are drawn.
Extensions, as vLLM names them: `top_k`, `ignore_eos`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from sparkinfer.engine.request import MAX_SEED, SamplingParams

__all__ = ["APIError", "ErrorInfo", "ErrorResponse", "StreamOptions", "CompletionRequest", "ChatMessage",
           "ChatCompletionRequest", "Usage", "CompletionLogprobs", "CompletionChoice", "CompletionResponse",
           "TopLogprob", "ChatTokenLogprob", "ChatLogprobs", "ChatResponseMessage", "ChatChoice",
           "ChatCompletionResponse", "ChatDelta", "ChatChunkChoice", "ChatCompletionChunk", "ModelCard",
           "PromptTokensDetails", "ModelList", "sampling_params", "choice_params", "MAX_STOP", "MAX_CHOICES",
           "COMPLETIONS_DEFAULT_MAX_TOKENS", "MAX_ENGINE_REQUESTS"]

# OpenAI's documented limits: completions' logprobs 0..5, chat's top_logprobs 0..20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
# OpenAI allows 4 stop sequences; vLLM clients send more. Each string is matched
# against the growing text at every step, so the count stays bounded.
MAX_STOP = 16
# OpenAI's documented default for /v1/completions (chat's default is the rest of the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Choices a request may ask for (`n`): each is an engine request of its own (a slot, and its
# prompt's prefill unless a running choice's chunks are copied), so one HTTP request cannot
# take more than this of the waiting queue.
MAX_CHOICES = 16
# Engine requests one HTTP request may make: prompts x n. OpenAI's completions prompt may
# be a list of texts or of token lists (evaluation harnesses send their batches so), and
# every prompt's n choices are engine requests of their own, all accepted or none.
MAX_ENGINE_REQUESTS = 64


def _unicode(s: str) -> str:
    """s, if it is valid Unicode. JSON's \\u escapes can spell a lone surrogate (\\ud800), which
    Python's json decodes into a str that no tokenizer takes and UTF-8 cannot encode: in a
    prompt it answered 500, in a stop string it dropped the connection (the response's
    encoding failed)."""
    if not s.isascii():
        try:
            s.encode()
        except UnicodeEncodeError as e:
            raise ValueError(f"holds a lone surrogate ({s[e.start]!r} at index {e.start}), which is not Unicode "
                             "text: send UTF-8 (a character past U+FFFF as a surrogate pair)") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]  # every request string the engine or a response sees


def _stop_text(s: str) -> str:
    if not s:
        raise ValueError("is empty: a stop string needs at least one character")
    return _unicode(s)


StopString = Annotated[str, AfterValidator(_stop_text)]
TokenId = Annotated[int, Field(ge=0)]


class APIError(Exception):
    """A request the server answers with an OpenAI-style error body: `status` (400,
    429, 500, 503), `message`, `type`, the offending `param` (a top-level field
    name) and a machine-readable `code`; `headers` (Retry-After on a 429).
    refused: the request was turned away before the engine took it (counted as a
    refusal in the metrics; an accepted request that ended badly is counted by how
    it ended)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, refused: bool = True):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers, self.refused = headers or {}, refused

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------- requests
class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


def _neutral(name: str, value, neutral):
    if value not in neutral:
        raise ValueError(f"{name}={value!r} is not supported by this server (send {neutral[0]!r} or leave it out)")
    return value


class _Sampling(_Request):
    """The fields completions and chat share."""

    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)  # None: OpenAI's default, 1
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension; -1 (vLLM's "off") and 0 keep every token
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP)
    ignore_eos: bool = False  # extension: generate max_tokens even past end-of-sequence
    # OpenAI fields served at their neutral value only
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: Text | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v, info):
        return _neutral(info.field_name, v, (0.0, None))

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server (send {} or leave it out)")
        return v

    @property
    def choices(self) -> int:
        return self.n or 1

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _prompt_list(prompt) -> list:
    """A completions prompt as a list of prompts: a text or a token list is one."""
    return [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else list(prompt)


class CompletionRequest(_Sampling):
    """POST /v1/completions. prompt: a string (tokenized by the checkpoint's tokenizer),
    token ids, or a list of either (prompts x n up to MAX_ENGINE_REQUESTS; choice p * n + i
    is prompt p's choice i). logprobs: the chosen token's and the n most likely tokens'
    log-probabilities, n in 0..5."""

    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, v):
        if len(_prompt_list(v)) > MAX_ENGINE_REQUESTS:
            raise ValueError(f"{len(v)} prompts in one request; send at most {MAX_ENGINE_REQUESTS}")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the list it sent."""
        return _prompt_list(self.prompt)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        return _neutral("echo", v, (False, None))

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, v):
        return _neutral("best_of", v, (1, None))

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return _neutral("suffix", v, (None,))


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One message of a chat; text content (a string or text parts)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def template_dict(self) -> dict:
        """{"role", "content"} with text parts joined, as chat templates read messages."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        return {"role": self.role, "content": text} | ({"name": self.name} if self.name else {})


class ResponseFormat(_Request):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: messages through the checkpoint's chat template.
    max_completion_tokens (or the older max_tokens): new tokens at most; default the
    rest of the context. logprobs + top_logprobs (0..20)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tools are not supported by this server (send [] or leave it out)")
        return v


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, prompt_len: int,
                    max_context: int) -> SamplingParams:
    """The engine's parameters for `req`, whose prompt is `prompt_len` tokens, on an
    engine of `max_context` positions (prompt + new tokens). Raises APIError 400 naming
    the field: a prompt that fills the context (param "prompt" / "messages"), more new
    tokens asked than the context has room for ("max_tokens"), stream_options without
    stream, top_logprobs without logprobs. An unset max_tokens takes what room is left
    (completions: at most OpenAI's default of 16)."""
    chat = isinstance(req, ChatCompletionRequest)
    prompt_field = "messages" if chat else "prompt"
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    room = max_context - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt is {prompt_len} tokens; this model's context is {max_context} tokens "
                            "(prompt + new tokens): shorten the prompt", param=prompt_field,
                       code="context_length_exceeded")
    asked, field = ((req.max_completion_tokens, "max_completion_tokens") if chat and req.max_completion_tokens
                    else (req.max_tokens, "max_tokens"))
    if asked is not None and asked > room:
        raise APIError(400, f"{field}={asked} with a prompt of {prompt_len} tokens needs {prompt_len + asked} "
                            f"positions; this model's context is {max_context}: ask for at most {room}",
                       param=field, code="context_length_exceeded")
    new = asked if asked is not None else (room if chat else min(room, COMPLETIONS_DEFAULT_MAX_TOKENS))
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0), seed=req.seed, max_new_tokens=new, stop=req.stops(),
        ignore_eos=req.ignore_eos, logprobs=logprobs)


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of each of n choices: choice i draws with seed + i (mod 2^63) when
    the request set one, so every choice is reproducible alone (a request with n = 1 and
    that seed gives the same tokens); without a seed each choice gets its own from the
    engine. Greedy choices are all the same text, as OpenAI's."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i) % (MAX_SEED + 1)) for i in range(n)]


# ---------------------------------------------------------------------------- responses
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens found in the
    cache (prefix reuse), as OpenAI reports its prompt caching."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int = 0) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and (object and shape alike) each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "sparkinfer"
    max_model_len: int  # vLLM's extension: prompt + new tokens a request may hold


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
