"""The serving engine: the scheduler in this process (the driver), the model on N rank
processes that follow its step plans.

    engine = ServingEngine.launch(EngineConfig(model="ckpt/", tp=2))
    for out in engine.submit(ids, SamplingParams(max_new_tokens=32)): ...
    engine.close()

Why a driver process rather than rank 0 owning the scheduler (the original brief):
the HTTP server, tokenization and the scheduler then never compete with rank 0's
kernel launches for its interpreter lock, a dead rank (rank 0 included) is reported
by a process that outlives it, and the Python API is an ordinary object in the
caller's process instead of code that must run inside rank 0. The cost is one more
hop per step: rank 0's result comes back through a second ring (16-25 us median
round trip on the loaded 2-core CI machine, `broadcast_cpu.json`).

Per step the driver publishes the plan into the plan ring (every rank reads it),
every rank runs it (`ModelRunner.execute`), and rank 0 publishes the result into the
result ring. Ranks are started by `run_ranks` on a thread of the driver, which
reports a rank that raised or died. Every wait is bounded by `timeout_s`: a rank
that stops answering fails every request with an error that names it.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from sparkinfer.engine.config import EngineConfig
from sparkinfer.engine.core import EngineCore
from sparkinfer.engine.plan import StepPlan, decode_plan, decode_result, encode_plan, encode_result
from sparkinfer.engine.request import EngineStats, SamplingParams
from sparkinfer.engine.scheduler import SchedulerCaps
from sparkinfer.errors import CheckpointError, EngineFailed, RankFailed, RingError, SetupError

__all__ = ["ServingEngine", "serve_on_rank", "default_max_context"]

# Ring geometry: a plan holds R rows and the step's prompt tokens (10 words a row or
# chunk header, one a token); results 3 + tokens (+ logprobs: 1 + 2 * 20 words a token).
_RING_SLOTS = 4
_READY = 0x53504B59  # "SPKY": rank 0's first result-ring record, once every rank is ready
# The step loop's waits poll this long before napping: the driver waits out a whole decode
# step for rank 0's result (0.5-3 ms on an H200), a rank the driver's scheduling (tens of
# us), and a nap wakes 75-140 us late (runtime/peers.py): at batch 1 that would be up to a
# fifth of a step. A serving host has a core to spare for each (polls yield the core).
_HOT_SPIN_S = 3e-3
# While idle the driver refreshes the plan ring's heartbeat this often (the ranks wait
# indefinitely on a fresh heartbeat; they give up after timeout_s without one).
_IDLE_S = 0.05


def default_max_context(spec, requested: int | None) -> int:
    """Cache positions per request: the request, else the checkpoint's
    max_position_embeddings capped at 4096 (a cache of max_batch x 4096 positions)."""
    limit = int(getattr(spec, "max_position_embeddings", 0) or 4096)
    return min(limit, 4096) if requested is None else int(requested)


@dataclass(frozen=True)
class _Geometry:
    plan_bytes: int
    result_bytes: int

    @classmethod
    def of(cls, cfg: EngineConfig, chunk: int) -> _Geometry:
        rows = cfg.max_batch
        tokens = max(cfg.step_tokens, chunk) + chunk
        plan = 8 * (6 + 10 * (rows + tokens) + tokens)
        per_token = 1 + 2 * 20
        new = cfg.spec_k + 1 if cfg.speculative else 1
        result = 8 * (6 + (3 + new * (1 + per_token)) * (2 * rows + tokens))
        return cls(plan, result)


def serve_on_rank(world, cfg: EngineConfig, max_context: int, plan_handle, result_handle) -> None:
    """A rank of a serving engine: build the model, tell the driver it is ready (rank 0),
    then run every plan until the shutdown plan; close collectively."""
    import signal

    from sparkinfer.engine.session import ModelSession
    from sparkinfer.runtime.broadcast import BroadcastRing

    # Ctrl-C reaches the whole process group: the driver stops the ranks with a shutdown
    # plan (a rank interrupted mid-collective would fail its peers instead)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    results = None
    beat = None
    if world.rank == 0:
        results = BroadcastRing.create(result_handle.name, readers=1, slots=result_handle.slots,
                                       record_bytes=result_handle.record_bytes, timeout_s=result_handle.timeout_s)
        beat = _Heartbeat(results)  # loading may outlast the driver's deadline
    plans = BroadcastRing.attach(plan_handle, world.rank)
    session = None
    try:
        session = ModelSession.for_config(world, cfg, max_context)
        runner = session.runner()
        runner.warm_up()
        import torch.distributed as dist

        dist.barrier()  # every rank loaded and captured before the driver admits anything
        if results is not None:
            beat.stop()
            results.publish(np.asarray([_READY, runner.max_context], dtype=np.int64))
        while (rec := plans.read(spin_s=_HOT_SPIN_S)) is not None:
            plan = decode_plan(rec)
            if plan.shutdown:
                break
            res = runner.execute(plan)
            if results is not None:
                results.publish(encode_result(res))
        if session.comm is not None:
            session.comm.synchronize()
    finally:
        if beat is not None:
            beat.stop()
        if session is not None:
            session.close()
        plans.close()
        if results is not None:
            results.close()


class _Heartbeat:
    """Refreshes a ring's heartbeat from a thread while its owner is busy loading (a
    heartbeat is one word store; the owner publishes nothing meanwhile)."""

    def __init__(self, ring, every_s: float = 0.5):
        self._stop = threading.Event()

        def beat():
            while not self._stop.wait(every_s):
                ring.heartbeat()
        self._t = threading.Thread(target=beat, name="sparkinfer-heartbeat", daemon=True)
        self._t.start()

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


class _RankExecutor:
    """Runs plans on the ranks through the two rings."""

    def __init__(self, plans, results, engine: ServingEngine):
        self.plans, self.results, self.engine = plans, results, engine
        self.timeout_s = engine.config.timeout_s

    def execute(self, plan: StepPlan):
        self.plans.publish(encode_plan(plan))
        rec = self.results.read(timeout_s=self.timeout_s, spin_s=_HOT_SPIN_S)
        if rec is None:
            raise EngineFailed("rank 0 closed its result ring mid-step")
        return decode_result(rec)

    def idle(self) -> None:
        self.plans.heartbeat()
        self.plans.check_readers()


class ServingEngine:
    """An `EngineClient` over N rank processes (see the module docstring). Build it with
    `launch`; `close()` when done."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._launch_error: BaseException | None = None
        self._launcher: threading.Thread | None = None
        self._loop: threading.Thread | None = None
        self._stopping = threading.Event()
        self.core: EngineCore | None = None

    # ------------------------------------------------------------------ start
    @classmethod
    def launch(cls, config: EngineConfig, *, ready_timeout_s: float = 3600.0) -> ServingEngine:
        """Validate (`models.validate.validate_launch`), start the ranks, wait until each has
        loaded and captured its graphs (ready_timeout_s at most), start the engine loop.
        Raises the typed error of a bad config in one line before any rank starts,
        EngineFailed naming a rank that failed to start."""
        from pathlib import Path

        from sparkinfer.models.config import load_spec
        from sparkinfer.models.tokenizer import load_tokenizer
        from sparkinfer.models.validate import validate_launch
        from sparkinfer.runtime.broadcast import BroadcastRing
        from sparkinfer.runtime.ranks import resolve_backend
        from sparkinfer.runtime.ring_segment import RingHandle

        self = cls(config)
        spec = load_spec(config.model)
        validate_launch(spec, tp=config.tp, dcp=config.dcp, moe_format=config.moe_format,
                        max_context=config.max_context, self_draft=config.self_draft)  # before any rank starts
        self.spec = spec
        self.model_name = config.name or Path(config.model).resolve().name
        try:
            self.tokenizer = load_tokenizer(config.model)
        except CheckpointError:  # token ids in and out only (a random-weight benchmark checkpoint)
            self.tokenizer = None
        self.eos_token_ids = tuple(spec.eos_token_ids)
        self.vocab_size = spec.vocab_size
        max_context = default_max_context(spec, config.max_context)
        backend = resolve_backend(config.backend, config.tp)
        chunk = config.prefill_chunk
        geo = _Geometry.of(config, chunk)
        timeout = config.timeout_s
        plans = BroadcastRing.create(None, readers=config.tp, slots=_RING_SLOTS, record_bytes=geo.plan_bytes,
                                     timeout_s=timeout)
        result_handle = RingHandle(f"sparkinfer-res-{uuid.uuid4().hex[:16]}", 1, _RING_SLOTS, geo.result_bytes,
                                   timeout)
        self._plans = plans
        self._results = None
        self._start_ranks(backend, (config, max_context, plans.handle, result_handle))
        try:
            self._results = self._attach_results(result_handle, ready_timeout_s)
            plans.wait_attached(timeout_s=ready_timeout_s)
            rec = self._read_ready(ready_timeout_s)
        except BaseException as e:
            self._abandon()
            raise self._failure(e) from None
        caps = SchedulerCaps(slots=config.max_batch, max_context=int(rec[1]), chunk=chunk,
                             step_tokens=max(config.step_tokens, chunk), max_waiting=config.max_waiting,
                             speculative=config.speculative, prefill_wait_steps=config.prefill_wait_steps)
        self.max_context = caps.max_context
        self.core = EngineCore(_RankExecutor(plans, self._results, self), caps, tokenizer=self.tokenizer,
                               eos_ids=self.eos_token_ids, vocab_size=spec.vocab_size)
        self._loop = threading.Thread(target=self._run, name="sparkinfer-engine", daemon=True)
        self._loop.start()
        return self

    def _start_ranks(self, backend: str, args: tuple) -> None:
        from sparkinfer.runtime.ranks import run_ranks

        def launch():
            try:
                run_ranks(serve_on_rank, self.config.tp, backend=backend, args=args, timeout_s=float("inf"))
            except BaseException as e:  # noqa: BLE001 - reported to the engine loop and to callers
                self._launch_error = e
                if self.core is not None:
                    self.core.fail(_describe(e))

        self._launcher = threading.Thread(target=launch, name="sparkinfer-ranks", daemon=True)
        self._launcher.start()

    def _attach_results(self, handle, timeout_s: float):
        from sparkinfer.runtime.broadcast import BroadcastRing

        end = time.monotonic() + timeout_s
        while True:
            try:
                return BroadcastRing.attach(handle, 0)
            except SetupError:  # rank 0 has not created it yet
                if self._launch_error is not None or not self._launcher.is_alive():
                    raise EngineFailed("a rank failed before the engine was ready") from None
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)

    def _read_ready(self, timeout_s: float):
        rec = self._results.read(timeout_s=timeout_s)
        if rec is None:
            raise EngineFailed("rank 0 closed before it was ready")
        w = np.frombuffer(rec, dtype=np.int64)
        if int(w[0]) != _READY:
            raise EngineFailed(f"rank 0's first record is not its ready record ({int(w[0]):#x})")
        return w

    def _failure(self, e: BaseException) -> BaseException:
        """The error to show for `e`: the launcher's verdict (which names the failing rank)
        when it has one, waited for briefly since a dead rank takes its peers down too."""
        if isinstance(e, (RingError, EngineFailed)) and self._launcher is not None:
            self._launcher.join(timeout=3.0)
        le = self._launch_error
        if le is not None:
            rank = le.rank if isinstance(le, RankFailed) else None
            return EngineFailed(_describe(le), rank=rank)
        return e if not isinstance(e, RingError) else EngineFailed(_describe(e), rank=None)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        core, ex = self.core, self.core.executor
        last_idle = 0.0
        try:
            while not self._stopping.is_set():
                if core.step():
                    continue
                now = time.monotonic()
                if now - last_idle >= _IDLE_S:
                    ex.idle()
                    last_idle = now
                core.wait_for_work(_IDLE_S)
        except BaseException as e:  # noqa: BLE001 - every request ends with the cause
            core.fail(_describe(self._failure(e)))

    # ------------------------------------------------------------------ EngineClient
    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None):
        if self._stopping.is_set():
            raise EngineFailed("the engine is shutting down")
        return self.core.submit(prompt, params, request_id)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def stats(self) -> EngineStats:
        s = self.core.stats()
        if self._launch_error is not None and s.healthy:
            return EngineStats(s.running, s.waiting, s.slots_used, s.slots_total, s.max_waiting, False,
                               _describe(self._launch_error), s.steps)
        return s

    def rank_pids(self) -> list[int]:
        """The rank processes' ids, in rank order (for tests and operators)."""
        return self._plans.reader_pids()

    @property
    def failed_rank(self) -> int | None:
        le = self._launch_error
        return le.rank if isinstance(le, RankFailed) else None

    def close(self, *, timeout_s: float = 60.0) -> None:
        """Stop admitting, abort what is in flight, shut the ranks down collectively and wait
        for them (timeout_s at most); raises EngineFailed if a rank failed meanwhile."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        core = self.core
        if core is not None:
            for r in list(core._live.values()):
                core.abort(r.handle.request_id)
        if self._loop is not None:
            self._loop.join(timeout=timeout_s)
        if core is not None and core.error is None:
            try:
                core.step()  # the aborts land: every handle gets its last output
                self._plans.publish(encode_plan(StepPlan(-1, shutdown=True)), timeout_s=timeout_s)
            except BaseException as e:  # noqa: BLE001 - the launcher's verdict says more
                core.fail(_describe(self._failure(e)))
        if self._launcher is not None:
            self._launcher.join(timeout=timeout_s)
        self._abandon()
        if self._launch_error is not None:
            raise self._failure(self._launch_error)

    def _abandon(self) -> None:
        for ring in (self._plans, self._results):
            if ring is not None:
                ring.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _describe(e: BaseException) -> str:
    if isinstance(e, RankFailed):  # one line per distinct cause, the cause's first
        return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} failed: {line}"
                         for line, r in e.causes)
    return f"{type(e).__name__}: {e}"
