"""Serve an engine over HTTP: uvicorn in the calling thread, the engine in its own.

    server = OpenAIServer(engine, ServeOptions(host="127.0.0.1", port=8000))
    server.run()      # blocks until SIGINT/SIGTERM or the engine fails
    engine.close()    # the caller launched the engine, the caller closes it

`run()` binds its socket before uvicorn starts (so `port=0` serves on a free port
and `url` names it), prints the URL, and returns after a graceful stop: on the
first SIGINT or SIGTERM the server stops admitting (503 for new requests and
/health), lets in-flight requests finish for `limits.grace_s`, aborts the rest;
a second signal aborts at once. When the engine fails (`engine.stats().healthy`
turns False: a rank died or stalled), in-flight requests end with errors, /health
answers 503, the server shuts down and `run()` raises EngineFailed with the
engine's message, which names the rank: the command exits non-zero.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from sparkinfer.errors import EngineFailed
from sparkinfer.serve.state import ServerLimits, ServerState

__all__ = ["ServeOptions", "OpenAIServer"]


@dataclass(frozen=True)
class ServeOptions:
    """host, port: where to listen (port 0: a free port). limits: the stop and failure
    timings. log_level: uvicorn's ("warning" keeps tests quiet). access_log: one line
    per request. api_key: /v1/ requests must send `Authorization: Bearer <api_key>`
    (None: open). allowed_origins: browser origins allowed to call the server (CORS;
    "*" any). Both: `serve/access.py`."""

    host: str = "127.0.0.1"
    port: int = 8000
    limits: ServerLimits = field(default_factory=ServerLimits)
    log_level: str = "info"
    access_log: bool = True
    api_key: str | None = field(default=None, repr=False)  # never printed with the options
    allowed_origins: tuple[str, ...] = ()


class OpenAIServer:
    """The app of one engine and the uvicorn server that runs it."""

    def __init__(self, engine, options: ServeOptions | None = None):
        from sparkinfer.serve.access import add_access
        from sparkinfer.serve.app import build_app

        self.options = o = options or ServeOptions()
        self.state = ServerState(engine, o.limits)
        self.app = build_app(self.state)
        add_access(self.app, api_key=o.api_key, allowed_origins=o.allowed_origins,
                   on_refused=lambda: self.state.metrics.outcome("unauthorized"))
        self.url: str | None = None

    def bind(self) -> socket.socket:
        """A listening socket on options.host:options.port."""
        sock = socket.create_server((self.options.host, self.options.port))
        host, port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        return sock

    def run(self, sock: socket.socket | None = None, *, announce=print) -> None:
        """Serve until stopped (see the module docstring); `sock` from `bind()` or None.
        Raises EngineFailed after the engine failed. Signals are handled only when run
        in the main thread (elsewhere call `stop()`)."""
        import uvicorn

        sock = sock or self.bind()
        config = uvicorn.Config(self.app, log_level=self.options.log_level, access_log=self.options.access_log,
                                timeout_graceful_shutdown=max(1, round(self.options.limits.flush_s)))
        server = _uvicorn_server(config, self.state)
        self.state.on_exit = lambda: setattr(server, "should_exit", True)
        announce(f"serving {self.state.engine.model_name!r} on {self.url}/v1 (OpenAI API; GET /health, /metrics)")
        server.run(sockets=[sock])
        if self.state.failure is not None:
            raise EngineFailed(f"the engine failed: {self.state.failure}")

    def stop(self) -> None:
        """What SIGTERM does: begin a graceful stop (twice: abort in-flight requests)."""
        self.state.request_stop()


def _uvicorn_server(config, state: ServerState):
    """A uvicorn.Server whose SIGINT/SIGTERM starts our drain instead of its own
    shutdown, and which does not re-raise the signal after serving (uvicorn re-raises
    it for an outer handler; here that would kill the process before the engine
    closes, with status -15 instead of 0). A third signal means the drain itself is
    stuck: uvicorn's own forced exit."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.request_stop()
            if state.stops_requested >= 3:
                self.should_exit = self.force_exit = True

    return Server(config)
