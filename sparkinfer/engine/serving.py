"""The serving engine: an `EngineClient` whose engine loop runs in a process of its own.

    engine = ServingEngine.launch(EngineConfig(model="ckpt/", tp=2))
    for out in engine.submit(ids, SamplingParams(max_new_tokens=32)): ...
    engine.close()

Three kinds of process: the caller's (the HTTP server, tokenization, this object), the
engine process (the scheduler, detokenization and stop strings: `driver.Driver`) and N
rank processes (the model). Why the engine loop is not a thread of the caller: the
HTTP layer's per-token work (a pydantic chunk, a socket send, the metrics) then
shared one interpreter lock with the loop, and a thread that wants the lock back
from a busy one waits up to the interpreter's switch interval (5 ms) for it. On an
H200 at concurrency 64 a step took 6.6 ms against a 2.45 ms graph replay
(`serve_h200.json` at 4a229bb); the loop now never waits for the HTTP layer.

One duplex pipe joins the caller and the engine process. Caller to engine:
("submit", id, prompt, params), ("abort", id), ("close",). Engine to caller:
("ready", max_context, rank pids) once every rank has loaded and captured, then
("out", outputs, (running, steps, mixed steps, engine CPU s)) after each step that produced any (one message a
step, however many requests), ("failed", message, rank) once the engine failed, and
("closed", message or None, rank) last. A reader thread of the caller feeds each
request's `RequestHandle`. `submit` checks what it can answer at once (capacity,
vocabulary, the waiting bound) on the caller's side, so refusals stay synchronous.
An engine process that dies ends every request with an error; a caller that dies
closes the pipe, and the engine process shuts the ranks down.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque

from sparkinfer.engine.client import RequestHandle, new_request_id, push_outputs
from sparkinfer.engine.config import EngineConfig
from sparkinfer.engine.core import check_request
from sparkinfer.engine.driver import default_max_context, describe, serve_on_rank
from sparkinfer.engine.request import EngineStats, FinishReason, RequestOutput, RequestState, SamplingParams
from sparkinfer.errors import CheckpointError, EngineFailed, EngineOverloaded

__all__ = ["ServingEngine", "serve_on_rank", "default_max_context"]

# While idle the engine loop refreshes the plan ring's heartbeat this often (the ranks wait
# indefinitely on a fresh heartbeat; they give up after timeout_s without one).
_IDLE_S = 0.05
# How long close() waits for the engine process beyond the driver's own deadline.
_EXIT_S = 10.0


def _pack(out: RequestOutput) -> tuple:
    return (out.request_id, out.token_ids, out.text, out.logprobs, out.finished, out.finish_reason, out.error,
            out.prompt_tokens, out.completion_tokens, out.timings, out.cached_tokens)


class ServingEngine:
    """An `EngineClient` over an engine process and N rank processes (see the module
    docstring). Build it with `launch`; `close()` when done."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()  # _handles and the counters; the reader thread takes only this one
        # the pipe's sending end. Never held with the reader waiting on it: a send blocks while the
        # engine process is busy, and the engine process may block sending outputs until the reader
        # drains them, so a reader waiting on a sender would close a cycle.
        self._send_lock = threading.Lock()
        self._running = self._steps = self._mixed = 0
        self._cpu_s = 0.0
        self._error: tuple[str, int | None] | None = None
        self._closed: tuple | None = None
        self._stopping = False
        self._pids: list[int] = []
        self._rings: tuple[str, ...] = ()

    # ------------------------------------------------------------------ start
    @classmethod
    def launch(cls, config: EngineConfig, *, ready_timeout_s: float = 3600.0) -> ServingEngine:
        """Validate (`models.validate.validate_launch`), start the engine process and its
        ranks, wait until each rank has loaded and captured its graphs (ready_timeout_s at
        most). Raises the typed error of a bad config in one line before any process
        starts, EngineFailed naming a rank that failed to start."""
        import multiprocessing as mp
        from pathlib import Path

        from sparkinfer.models.config import load_spec
        from sparkinfer.models.tokenizer import load_tokenizer
        from sparkinfer.models.validate import validate_launch

        self = cls(config)
        spec = load_spec(config.model)
        validate_launch(spec, tp=config.tp, dcp=config.dcp, moe_format=config.moe_format,
                        max_context=config.max_context, self_draft=config.self_draft)  # before any process starts
        self.spec = spec
        self.model_name = config.name or Path(config.model).resolve().name
        try:
            self.tokenizer = load_tokenizer(config.model)
        except CheckpointError:  # token ids in and out only (a random-weight benchmark checkpoint)
            self.tokenizer = None
        self.eos_token_ids = tuple(spec.eos_token_ids)
        self.vocab_size = spec.vocab_size
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(child, config, ready_timeout_s),
                                 name="sparkinfer-engine")
        self._proc.start()
        child.close()
        ref = weakref.ref(self)
        atexit.register(lambda: (e := ref()) is not None and e._conn.close())  # the engine process exits too
        msg = self._first_message(ready_timeout_s)
        if msg[0] != "ready":
            self._proc.join(_EXIT_S)
            raise EngineFailed(msg[1], rank=msg[2])
        _, self.max_context, self._pids, self._rings = msg
        self._reader = threading.Thread(target=self._read, name="sparkinfer-engine-reader", daemon=True)
        self._reader.start()
        return self

    def _first_message(self, timeout_s: float) -> tuple:
        end = time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            if not self._proc.is_alive():
                return ("failed", f"the engine process exited while starting (exit code {self._proc.exitcode})",
                        None)
            if time.monotonic() > end:
                self._proc.kill()
                return ("failed", f"the engine was not ready within {timeout_s:g} s", None)
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(_EXIT_S)
            return ("failed", f"the engine process exited while starting (exit code {self._proc.exitcode})", None)

    # ------------------------------------------------------------------ the reader thread
    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "out":
                    self._running, self._steps, self._mixed, self._cpu_s = msg[2]
                    self._deliver(msg[1])
                elif msg[0] == "failed":
                    self._fail(msg[1], msg[2])
                elif msg[0] == "closed":
                    self._closed = msg
                    return
        except (EOFError, OSError):
            self._proc.join(_EXIT_S)
            self._fail(f"the engine process exited unexpectedly (exit code {self._proc.exitcode})", None)
            from sparkinfer.runtime.ring_segment import unlink

            for name in self._rings:  # its rings' names, which it can no longer remove (its ranks exit
                unlink(name)          # on their own once their launcher is gone)

    def _deliver(self, packed: list[tuple]) -> None:
        outs = [RequestOutput(*p) for p in packed]
        with self._lock:
            pairs = [(h, out) for out in outs if (h := self._handles.pop(out.request_id) if out.finished
                                                  else self._handles.get(out.request_id)) is not None]
        push_outputs(pairs)  # each reading event loop woken once a step

    def _fail(self, message: str, rank: int | None) -> None:
        """Record the failure and end every request still open with it (the engine
        process ends them itself when it can; this covers one that died)."""
        with self._lock:
            if self._error is None:
                self._error = (message, rank)
            left, self._handles = list(self._handles.values()), {}
        for h in left:
            h._push(RequestOutput(h.request_id, finished=True, finish_reason=FinishReason.ERROR,
                                  error=self._error[0], prompt_tokens=len(h.prompt)))

    # ------------------------------------------------------------------ EngineClient
    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        if self._stopping:
            raise EngineFailed("the engine is shutting down")
        if self._error is not None:
            raise EngineFailed(f"the engine stopped: {self._error[0]}", rank=self._error[1])
        prompt = check_request(prompt, params, vocab_size=self.vocab_size, tokenizer=self.tokenizer,
                               max_context=self.max_context)
        key = request_id or new_request_id()
        handle = RequestHandle(key, prompt, params)
        bound = self.config.max_batch + self.config.max_waiting
        with self._send_lock:  # registered and sent in one piece: an abort of it cannot go first
            with self._lock:
                if len(self._handles) >= bound:  # the scheduler's bound: max_waiting beyond the free slots
                    waiting = len(self._handles) - self._running
                    raise EngineOverloaded(f"{waiting} requests are waiting (the bound is "
                                           f"{self.config.max_waiting} beyond the free slots); retry later",
                                           retry_after_s=1.0)
                self._handles[key] = handle
            try:
                self._conn.send(("submit", key, prompt, params, time.monotonic()))
            except OSError:  # the engine process is gone; the reader ends the handles it knows
                with self._lock:
                    self._handles.pop(key, None)
                raise EngineFailed("the engine process is gone") from None
        return handle

    def abort(self, request_id: str) -> None:
        with self._send_lock:
            if request_id in self._handles and not self._stopping:
                try:
                    self._conn.send(("abort", request_id))
                except OSError:  # the engine process is gone: every request ends with its error
                    pass

    def stats(self) -> EngineStats:
        with self._lock:
            unfinished = len(self._handles)
        running = min(self._running, unfinished)
        err = self._error
        return EngineStats(running=running, waiting=unfinished - running, slots_used=running,
                           slots_total=self.config.max_batch, max_waiting=self.config.max_waiting,
                           healthy=err is None, error=None if err is None else err[0], steps=self._steps,
                           mixed_steps=self._mixed, engine_cpu_s=self._cpu_s)

    def rank_pids(self) -> list[int]:
        """The rank processes' ids, in rank order (for tests and operators)."""
        return list(self._pids)

    @property
    def failed_rank(self) -> int | None:
        return None if self._error is None else self._error[1]

    def close(self, *, timeout_s: float = 60.0) -> None:
        """Stop admitting, abort what is in flight, shut the ranks down collectively and wait
        for them (timeout_s at most); raises EngineFailed if a rank failed meanwhile."""
        if self._stopping:
            return
        self._stopping = True
        with self._send_lock:
            try:
                self._conn.send(("close", timeout_s))
            except OSError:  # the engine process is gone: the reader has seen it
                pass
        self._reader.join(timeout_s + _EXIT_S)
        self._proc.join(_EXIT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(_EXIT_S)
        self._conn.close()
        if self._handles:  # the engine process ended them all unless it died first
            self._fail("the engine closed", None)
        closed = self._closed
        if closed is not None and closed[1] is not None:
            raise EngineFailed(closed[1], rank=closed[2])
        if closed is None and self._error is not None:
            raise EngineFailed(self._error[0], rank=self._error[1])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ---------------------------------------------------------------------------- the engine process
def _engine_main(conn, config: EngineConfig, ready_timeout_s: float) -> None:
    """The engine process: start the ranks, then run the loop until "close" or until the
    caller is gone."""
    import signal

    from sparkinfer import envs
    from sparkinfer.engine.driver import Driver

    # Ctrl-C reaches the whole process group: the caller stops us with "close"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    outbox: deque = deque()  # appended by the loop and by the launcher thread (a rank failed)
    try:
        envs.apply_flags()  # SPARKINFER_FLAGS, inherited from the server's process
        driver = Driver.launch(config, ready_timeout_s=ready_timeout_s, handle_type=relay_type(outbox))
    except BaseException as e:  # noqa: BLE001 - reported to the caller
        conn.send(("failed", describe(e), getattr(e, "rank", None)))
        return
    try:
        conn.send(("ready", driver.caps.max_context, driver.rank_pids(), driver.ring_names))
        _loop(conn, driver, outbox)
    except (EOFError, OSError):  # the caller is gone
        try:
            driver.close()
        except EngineFailed:
            pass


def relay_type(outbox: deque) -> type:
    """The engine process's `RequestHandle`: each output goes to `outbox`, packed for the
    pipe (one message a step carries them all to the caller's process)."""

    class Relay(RequestHandle):
        def _push(self, out: RequestOutput) -> None:
            self._push_fields(_pack(out))

        def _push_fields(self, fields: tuple) -> None:
            if fields[4]:  # finished
                self.state = RequestState.FINISHED
            outbox.append(fields)
    return Relay


def out_message(outbox: deque, running: int, steps: int, mixed: int = 0) -> tuple:
    """The pipe's message of one step: every output queued in `outbox` (emptied), and the
    engine's counters with this process's CPU seconds (about a microsecond to read)."""
    return ("out", [outbox.popleft() for _ in range(len(outbox))], (running, steps, mixed, time.process_time()))


def _loop(conn, driver, outbox: deque) -> None:
    core = driver.core
    last_idle = 0.0
    told = False

    def flush():
        if outbox:
            conn.send(out_message(outbox, len(core.sched.active), core.steps, core.mixed_steps))

    while True:
        while conn.poll():
            msg = conn.recv()
            if msg[0] == "submit":
                try:
                    core.submit(msg[2], msg[3], msg[1], sent_at=msg[4])
                except Exception as e:  # noqa: BLE001 - the request ends with it; the engine goes on
                    outbox.append(_pack(RequestOutput(msg[1], finished=True, finish_reason=FinishReason.ERROR,
                                                      error=describe(e), prompt_tokens=len(msg[2]))))
            elif msg[0] == "abort":
                core.abort(msg[1])
            else:  # close
                why = rank = None
                try:
                    driver.close(timeout_s=msg[1])
                except EngineFailed as e:
                    why, rank = str(e), e.rank
                flush()
                conn.send(("closed", why, rank))
                return
        stepped = False
        if core.error is None:
            try:
                stepped = core.step()
                if not stepped and time.monotonic() - last_idle >= _IDLE_S:
                    driver.idle()
                    last_idle = time.monotonic()
            except BaseException as e:  # noqa: BLE001 - every request ends with the cause
                driver.fail(e)
        flush()
        if not told and (err := driver.error) is not None:
            conn.send(("failed", *err))
            told = True
        if not stepped:
            conn.poll(_IDLE_S)
