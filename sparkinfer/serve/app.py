"""The FastAPI app: routes, error bodies, the disconnect watch and the supervisor.

    state = ServerState(engine)
    app = build_app(state)           # serve with uvicorn (sparkinfer.serve.server)

Routes: POST /v1/completions, POST /v1/chat/completions (streaming or not),
GET /v1/models, GET /health (200 only while the engine is healthy and the server
admits), GET /metrics (Prometheus text). Every error is OpenAI's body
`{"error": {"message", "type", "param", "code"}}`: a body that does not validate
(malformed JSON, a wrong type, an unknown field, a bound) is a 400 naming the
field. A client that disconnects aborts its request, streaming or not.

This module imports fastapi at import: only the server (`sparkinfer serve`)
imports it. FastAPI reads the handlers' annotations from the module's globals,
so `Request` and the request models must be names here.
"""

import asyncio
import contextlib
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from sparkinfer.serve import handlers
from sparkinfer.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from sparkinfer.serve.state import Choices, ServerState

__all__ = ["build_app"]

# Refused requests by status, for the outcomes counter (404/405/500 are not requests to the engine).
_REFUSALS = {400: "invalid", 429: "overloaded", 503: "unavailable"}
# How much of a bad value an error message quotes.
_QUOTE = 80


def build_app(state: ServerState):
    """A FastAPI app serving `state.engine`; its lifespan runs `state.supervise()`."""

    class EventStream(StreamingResponse):
        """Server-sent events whose generator is closed, and whose request is released,
        however the response ends (finished, the client gone, the server cancelling)."""

        def __init__(self, events, choices: Choices):
            super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.choices = choices

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()
                self.choices.close()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(state.supervise())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="SparkInfer", summary="OpenAI-compatible completions", lifespan=lifespan)
    app.state.serve = state

    def error_response(request: Request, err: APIError) -> JSONResponse:
        if err.refused and request.url.path.startswith("/v1/") and err.status in _REFUSALS:
            state.metrics.outcome(_REFUSALS[err.status])
        return JSONResponse(err.body().model_dump(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return error_response(request, err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return error_response(request, _validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(request, APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        return error_response(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                type="server_error", refused=False))

    @app.get("/health")
    async def health():
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.engine.model_name, max_model_len=state.engine.max_context)])

    @app.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        choices = handlers.start_completion(state, req)
        if req.stream:
            return EventStream(handlers.completion_events(state, choices, req), choices)
        return await _unless_disconnected(request, handlers.completion_response(state, choices, req), choices)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        choices = handlers.start_chat(state, req)
        if req.stream:
            return EventStream(handlers.chat_events(state, choices, req), choices)
        return await _unless_disconnected(request, handlers.chat_response(state, choices, req), choices)

    return app


async def _unless_disconnected(request, work, choices: Choices):
    """Await `work`, unless the client disconnects first: then cancel it (its request is
    aborted in the engine) and answer nobody. A plain response has no stream to notice
    the disconnect, so the request's receive channel is watched beside it."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        gone.cancel()
        choices.close()
    if task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request": no one reads it
    return task.result()


async def _disconnected(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _validation_error(errors) -> APIError:
    """A 400 for pydantic's errors, naming the top-level field the first one is about."""
    e = errors[0]
    loc = _loc(e)
    field = loc[0] if loc and isinstance(loc[0], str) else None
    kind = e.get("type", "")
    if kind == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return APIError(400, f"the body is not valid JSON ({detail} at character {loc[0] if loc else '?'})",
                        code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {field!r}: not a field of this endpoint (check its spelling)",
                        param=field, code="unknown_field")
    if kind == "missing":
        if field is None:
            return APIError(400, "the body is empty: send a JSON object", code="invalid_json")
        return APIError(400, f"{_where(loc)} is required", param=field, code="missing_field")
    if field is None:
        return APIError(400, f"the body must be a JSON object: {e.get('msg')}", code="invalid_json")
    refused = next((x for x in errors if x.get("type") == "value_error" and _loc(x)[:1] == [field]), None)
    if refused is not None:  # a check took the type and refused the value (a lone surrogate): that is the complaint
        e, loc, kind, members = refused, _loc(refused), "value_error", []
    else:
        members = [x for x in errors if _union_member(x, field)]
    if len(members) > 1:  # a union (prompt: str | list[int]): every member's complaint
        what = "; or ".join(f"{x.get('msg')} at {_where(x['loc'][1:])}" for x in members)
        return APIError(400, f"{field}: no accepted type matched ({what}), got {_quote(e.get('input'))}",
                        param=field, code="invalid_value")
    msg = str(e.get("msg", "")).removeprefix("Value error, ")
    got = "" if kind == "value_error" else f", got {_quote(e.get('input'))}"
    return APIError(400, f"{_where(loc)}: {msg}{got}", param=field, code="invalid_value")


# pydantic names a union's member in the error location ("prompt.list[int].0", a validated
# type's "function-after[...]"): not a field
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|constrained-\w+|function-\w+\[.*\]|list\[.*\]|dict\[.*\]|"
                        r"[A-Z]\w*)$")


def _loc(error) -> list:
    """An error's location without pydantic's leading "body"."""
    return [p for p in error.get("loc", ()) if p != "body"]


def _union_member(error, field) -> bool:
    """Whether pydantic reports `error` for one member of `field`'s union: ("body", field, tag, ...)."""
    loc = _loc(error)
    return len(loc) > 1 and loc[0] == field and isinstance(loc[1], str) and bool(_UNION_TAG.match(loc[1]))


def _where(loc) -> str:
    """A location as a dotted path without union tags: messages.0.role."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and _UNION_TAG.match(p))) or "body"


def _quote(value) -> str:
    got = repr(value)
    return got if len(got) <= _QUOTE else got[:_QUOTE] + "..."
