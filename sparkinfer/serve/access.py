"""Who may call the server: an API key on the OpenAI routes, and the browser origins
allowed to call it (CORS).

    app = build_app(state)
    add_access(app, api_key="sk-...", allowed_origins=("http://localhost:3000",), on_refused=count)

API key: every request under /v1/ must carry `Authorization: Bearer <key>`, as
OpenAI's clients send it (`OpenAI(api_key=...)`, `OPENAI_API_KEY`); anything else
gets a 401 with OpenAI's error body (code "invalid_api_key") before its body is
read, so a request without the key learns nothing about the server but that. The
key is compared in constant time. /health and /metrics stay open: a load balancer
and a Prometheus scraper carry no key, and neither reveals a prompt.

CORS: a chat UI served from another origin (a browser page on :3000 calling the
server on :8000) may only read the answers when the server names its origin.
`allowed_origins` go to Starlette's `CORSMiddleware` (preflights answered, the
Authorization header allowed); "*" allows any origin. None given: no CORS headers,
a browser on another origin is refused by the browser itself. The CORS layer sits
outside the key check, so a preflight (which carries no key) is answered.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

from sparkinfer.errors import SetupError
from sparkinfer.serve.protocol import APIError

__all__ = ["RequireApiKey", "add_access"]


class RequireApiKey:
    """ASGI middleware: 401 for a /v1/ request without `Authorization: Bearer <key>`.
    on_refused() is called once per refusal (the outcomes counter)."""

    def __init__(self, app, *, api_key: str, on_refused=lambda: None):
        self.app, self.on_refused = app, on_refused
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and not self._authorized(scope):
            self.on_refused()
            await _refuse(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)


async def _refuse(scope, receive, send) -> None:
    """The 401, with OpenAI's error body as every other refusal of the server has it."""
    err = APIError(401, "no valid API key: send the server's key as 'Authorization: Bearer <key>' (the OpenAI "
                        "clients' api_key, or OPENAI_API_KEY)", code="invalid_api_key")
    await JSONResponse(err.body().model_dump(), status_code=err.status,
                       headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def add_access(app, *, api_key: str | None = None, allowed_origins: tuple[str, ...] = (),
               on_refused=lambda: None) -> None:
    """Add the key check (api_key given) and CORS (origins given) to a Starlette/FastAPI
    app; the CORS layer outermost (Starlette wraps each added middleware around the ones
    before it). SetupError for an empty key (Starlette builds its middleware at the first
    request: refused here, at startup, instead)."""
    if api_key is not None and not api_key.strip():
        raise SetupError("the API key is empty: give a key, or none to leave the server open")
    if api_key is not None:
        app.add_middleware(RequireApiKey, api_key=api_key, on_refused=on_refused)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
