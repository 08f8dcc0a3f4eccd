"""The driver: the engine loop (`EngineCore`) over N rank processes that follow its
step plans. It runs in the engine process (`serving.ServingEngine` starts it).

    driver = Driver.launch(config, ready_timeout_s=600, handle_type=RequestHandle)
    while driver.core.step(): ...
    driver.close()

Why a driver rather than rank 0 owning the scheduler (the original brief): the
scheduler never competes with rank 0's kernel launches for its interpreter lock, a
dead rank (rank 0 included) is reported by a process that outlives it. The cost is
one more hop per step: rank 0's result comes back through a second ring (16-25 us
median round trip on the loaded 2-core CI machine, `broadcast_cpu.json`).

Per step the driver publishes the plan into the plan ring (every rank reads it),
every rank runs it (`ModelRunner.execute`), and rank 0 publishes the result into the
result ring. Ranks are started by `run_ranks` on a thread of the driver, which
reports a rank that raised or died. Every wait is bounded by `timeout_s`: a rank
that stops answering fails every request with an error that names it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from sparkinfer.engine.config import EngineConfig
from sparkinfer.engine.core import EngineCore
from sparkinfer.engine.plan import (
    PLAN_HEAD,
    RESULT_HEAD,
    StepPlan,
    decode_plan,
    decode_result,
    encode_plan,
    encode_result,
)
from sparkinfer.engine.scheduler import SchedulerCaps
from sparkinfer.errors import CheckpointError, EngineFailed, RankFailed, RingError, SetupError

__all__ = ["Driver", "serve_on_rank", "default_max_context", "describe"]

# Ring geometry: a plan holds R rows and the step's prompt tokens (10 words a row or
# chunk header, one a token); results 3 + tokens (+ logprobs: 1 + 2 * 20 words a token).
_RING_SLOTS = 4
_READY = 0x53504B59  # "SPKY": rank 0's first result-ring record, once every rank is ready
# The step loop's waits poll this long before napping: the driver waits out a whole decode
# step for rank 0's result (0.5-3 ms on an H200), a rank the driver's scheduling (tens of
# us), and a nap wakes 75-140 us late (runtime/peers.py): at batch 1 that would be up to a
# fifth of a step. A serving host has a core to spare for each (polls yield the core).
_HOT_SPIN_S = 3e-3


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
        tokens = 2 * (max(cfg.step_tokens, chunk) + chunk)  # the plan's chunks and those it announces
        plan = 8 * (PLAN_HEAD + 10 * (rows + tokens) + tokens + 3 * rows)  # rows: at most one copy a slot
        per_token = 1 + 2 * 20
        new = cfg.spec_k + 1 if cfg.speculative else 1
        result = 8 * (RESULT_HEAD + (3 + new * (1 + per_token)) * (2 * rows + tokens))
        return cls(plan, result)


def serve_on_rank(world, cfg: EngineConfig, max_context: int, plan_handle, result_handle) -> None:
    """A rank of a serving engine: build the model, tell the driver it is ready (rank 0),
    then run every plan until the shutdown plan; close collectively."""
    import signal

    from sparkinfer.engine.profile import StepProfiler
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
        runner = session.runner(mixed=cfg.mixed_steps)
        runner.warm_up()
        import torch.distributed as dist

        dist.barrier()  # every rank loaded and captured before the driver admits anything
        if results is not None:
            beat.stop()
            results.publish(np.asarray([_READY, runner.max_context, runner.announce_tokens], dtype=np.int64))
        profiler = StepProfiler(runner, world.rank)  # off unless engine.profile.STEPS is set
        while (rec := plans.read(spin_s=_HOT_SPIN_S)) is not None:
            plan = decode_plan(rec)
            if plan.shutdown:
                break
            res = profiler.run(plan)
            if results is not None:
                results.publish(encode_result(res))
        profiler.finish()  # a window cut short by shutdown still writes what it holds
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

    def __init__(self, plans, results, engine: Driver):
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


class Driver:
    """The engine core over N rank processes (see the module docstring). Build it with
    `launch`; the caller runs `core.step()`; `close()` when done."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._launch_error: BaseException | None = None
        self._launcher: threading.Thread | None = None
        self.core: EngineCore | None = None

    @classmethod
    def launch(cls, config: EngineConfig, *, ready_timeout_s: float, handle_type=None) -> Driver:
        """Start the ranks, wait until each has loaded and captured its graphs
        (ready_timeout_s at most), build the core (its handles of `handle_type`).
        Raises EngineFailed naming a rank that failed to start. The caller has validated
        the config (`models.validate.validate_launch`)."""
        from sparkinfer.engine.client import RequestHandle
        from sparkinfer.models.config import load_spec
        from sparkinfer.models.tokenizer import load_tokenizer
        from sparkinfer.runtime.broadcast import BroadcastRing
        from sparkinfer.runtime.ranks import resolve_backend
        from sparkinfer.runtime.ring_segment import RingHandle

        self = cls(config)
        spec = load_spec(config.model)
        try:
            tokenizer = load_tokenizer(config.model)
        except CheckpointError:  # token ids in and out only (a random-weight benchmark checkpoint)
            tokenizer = None
        max_context = default_max_context(spec, config.max_context)
        backend = resolve_backend(config.backend, config.tp)
        self.config = config = dataclasses.replace(config, timeout_s=config.stall_s(backend))
        chunk = config.prefill_chunk
        geo = _Geometry.of(config, chunk)
        timeout = config.timeout_s
        plans = BroadcastRing.create(None, readers=config.tp, slots=_RING_SLOTS, record_bytes=geo.plan_bytes,
                                     timeout_s=timeout)
        # named by this process, as the plans' ring and the ranks' slabs are by theirs
        result_handle = RingHandle(f"sparkinfer-res-{os.getpid()}-{uuid.uuid4().hex[:16]}", 1, _RING_SLOTS,
                                   geo.result_bytes, timeout)
        self._plans = plans
        self._results = None
        self.ring_names = (plans.handle.name, result_handle.name)  # for a caller that outlives this process
        self._start_ranks(backend, (config, max_context, plans.handle, result_handle))
        try:
            self._results = self._attach_results(result_handle, ready_timeout_s)
            plans.wait_attached(timeout_s=ready_timeout_s)
            rec = self._read_ready(ready_timeout_s)
        except BaseException as e:
            self._abandon()
            raise self._failure(e) from None
        self.caps = SchedulerCaps(slots=config.max_batch, max_context=int(rec[1]), chunk=chunk,
                                  step_tokens=max(config.step_tokens, chunk), max_waiting=config.max_waiting,
                                  speculative=config.speculative, prefill_wait_steps=config.prefill_wait_steps,
                                  announce=int(rec[2]), reuse_prefix=config.prefix_reuse)
        self.core = EngineCore(_RankExecutor(plans, self._results, self), self.caps, tokenizer=tokenizer,
                               eos_ids=tuple(spec.eos_token_ids), vocab_size=spec.vocab_size,
                               handle_type=handle_type or RequestHandle)
        return self
    def _start_ranks(self, backend: str, args: tuple) -> None:
        from sparkinfer.envs import cpu_rank_env
        from sparkinfer.runtime.ranks import run_ranks

        def launch():
            try:
                run_ranks(serve_on_rank, self.config.tp, backend=backend, args=args, timeout_s=float("inf"),
                          env=cpu_rank_env(backend))
            except BaseException as e:  # noqa: BLE001 - reported to the engine loop and to callers
                self._launch_error = e
                if self.core is not None:
                    self.core.fail(describe(e))

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
            return EngineFailed(describe(le), rank=rank)
        return e if not isinstance(e, RingError) else EngineFailed(describe(e), rank=None)

    # ------------------------------------------------------------------ the loop's hooks
    def idle(self) -> None:
        """Between steps while nothing runs: keep the plan ring's heartbeat fresh and
        check that every rank still reads it."""
        self.core.executor.idle()

    def fail(self, e: BaseException) -> str:
        """End every request with `e`'s best description (the launcher's verdict names the
        rank); that description."""
        why = describe(self._failure(e))
        self.core.fail(why)
        return why

    @property
    def error(self) -> tuple[str, int | None] | None:
        """(message, failed rank or None) once the engine failed, else None."""
        le = self._launch_error
        if le is not None:
            return describe(le), (le.rank if isinstance(le, RankFailed) else None)
        if self.core is not None and self.core.error is not None:
            return self.core.error, None
        return None

    def rank_pids(self) -> list[int]:
        """The rank processes' ids, in rank order (for tests and operators)."""
        return self._plans.reader_pids()

    def close(self, *, timeout_s: float = 60.0) -> None:
        """Abort what is in flight, shut the ranks down collectively and wait for them
        (timeout_s at most); raises EngineFailed if a rank failed meanwhile."""
        core = self.core
        if core is not None:
            for r in list(core._live.values()):
                core.abort(r.handle.request_id)
        if core is not None and core.error is None:
            try:
                core.step()  # the aborts land: every handle gets its last output
                self._plans.publish(encode_plan(StepPlan(-1, shutdown=True)), timeout_s=timeout_s)
            except BaseException as e:  # noqa: BLE001 - the launcher's verdict says more
                core.fail(describe(self._failure(e)))
        if self._launcher is not None:
            self._launcher.join(timeout=timeout_s)
        self._abandon()
        if self._launch_error is not None:
            raise self._failure(self._launch_error)

    def _abandon(self) -> None:
        for ring in (self._plans, self._results):
            if ring is not None:
                ring.close()


def describe(e: BaseException) -> str:
    """One line for `e`: a RankFailed's causes by rank, an EngineFailed's message, else
    the type and message."""
    if isinstance(e, EngineFailed):
        return str(e)
    if isinstance(e, RankFailed):  # one line per distinct cause, the cause's first
        return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} failed: {line}"
                         for line, r in e.causes)
    return f"{type(e).__name__}: {e}"
