"""Start N ranks and join them; a rank that raises or dies fails the launch
with that rank's traceback instead of hanging the others.

    results = run_ranks(fn, 2, backend="cpu", args=(payload,))

`fn(world, *args)` runs once per rank in a fresh (spawned) process; `world` is a
`World` with the rank, the world size, the torch.distributed group and the
device. CPU ranks use gloo and run Triton kernels through the interpreter
(TRITON_INTERPRET=1 is set in the child before Triton is imported).

Backends: "cuda" (rank r on cuda:r, NCCL group), "cpu" (gloo, interpreter) and
"cuda_shared" (every rank on cuda:0, gloo group): several ranks on one GPU, for
multi-rank correctness on a one-GPU host. Start MPS first so the ranks' kernels
run concurrently; its timings mean nothing.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sparkinfer.errors import RankFailed, SetupError

__all__ = ["World", "run_ranks", "resolve_backend", "check_world_size", "BACKENDS", "MAX_WORLD_SIZE"]

BACKENDS = ("auto", "cpu", "cuda", "cuda_shared")
MAX_WORLD_SIZE = 16  # one box of up to 16 GPUs (README); the kernels are unrolled over W


def check_world_size(world_size) -> int:
    """world_size as an int in [1, MAX_WORLD_SIZE]; SetupError quoting it otherwise."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise SetupError(f"world size {world_size!r}: SparkInfer runs 1 to {MAX_WORLD_SIZE} ranks")
    return world_size


@dataclass(frozen=True)
class World:
    """One rank's view of the launched world.

    rank, world_size: this process's global rank and the number of ranks.
    backend: "cuda" (one GPU per rank, NCCL group), "cuda_shared" (all ranks on
        cuda:0, gloo group) or "cpu" (gloo group).
    device: torch.device of this rank (cuda:rank, cuda:0 or cpu).
    """

    rank: int
    world_size: int
    backend: str

    @property
    def device(self):
        import torch

        if self.backend == "cuda":
            return torch.device(f"cuda:{self.rank}")
        return torch.device("cuda:0") if self.backend == "cuda_shared" else torch.device("cpu")

    @property
    def group(self):
        """The default torch.distributed process group."""
        import torch.distributed as dist

        return dist.group.WORLD


def resolve_backend(backend: str, world_size: int) -> str:
    """"auto" picks "cuda" when this host has at least `world_size` GPUs,
    "cuda_shared" when it has fewer but at least one (the GPU kernels, every rank
    on cuda:0: the interpreter would need the test setup's numpy pin), else "cpu".
    An explicit "cuda" or "cuda_shared" on a host without enough GPUs raises SetupError."""
    if backend not in BACKENDS:
        raise SetupError(f"backend must be one of {BACKENDS}, got {backend!r}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "cuda" if gpus >= world_size else "cuda_shared" if gpus else "cpu"
    need = world_size if backend == "cuda" else 1 if backend == "cuda_shared" else 0
    if gpus < need:
        raise SetupError(f"backend {backend!r} with {world_size} ranks needs {need} GPU(s); this host has "
                         f"{gpus}. Use backend 'cpu' (Triton interpreter) or 'auto'")
    return backend


def _die_with_launcher(launcher_pid: int, store_dir: str | None) -> None:
    """Exit this rank when its launcher is gone (killed, crashed) instead of living on as an
    orphan: a daemon thread polls the parent pid (portable; a launcher killed by SIGKILL runs
    no cleanup) and removes the rendezvous directory the launcher can no longer remove."""
    import threading

    def watch():
        while os.getppid() == launcher_pid:
            time.sleep(_ORPHAN_POLL_S)
        if store_dir:
            shutil.rmtree(store_dir, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="sparkinfer-launcher-watch", daemon=True).start()


_ORPHAN_POLL_S = 0.5  # how late a rank notices its launcher died; a getppid() per poll costs nothing


def _child(fn, rank, world_size, backend, init_method, args, env, results, launcher_pid=None):
    if launcher_pid is not None:
        _die_with_launcher(launcher_pid, os.path.dirname(init_method.removeprefix("file://")))
    os.environ.update(env)
    if backend == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        from sparkinfer.runtime import interpreter

        interpreter.install()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        from sparkinfer import envs

        envs.apply_flags()  # SPARKINFER_FLAGS, inherited from the launcher
        import torch
        import torch.distributed as dist

        if backend != "cpu":
            torch.cuda.set_device(rank if backend == "cuda" else 0)
        dist.init_process_group(
            "nccl" if backend == "cuda" else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            **({"device_id": torch.device(f"cuda:{rank}")} if backend == "cuda" else {}),
        )
        try:
            out = fn(World(rank, world_size, backend), *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
                pass
        # plain pickle copies tensors into the message: the queue's own pickler would
        # pass them as shared-memory handles that die with this process
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        results.put(("err", rank, (traceback.format_exc(), _summary(exc))))
        results.close()
        results.join_thread()  # the traceback must reach the parent before we exit
        sys.stderr.flush()
        os._exit(1)


def _summary(exc: BaseException) -> str:
    """One line for a rank's error: its type and its message's first line."""
    lines = str(exc).strip().splitlines()
    return type(exc).__name__ + (f": {lines[0]}" if lines else "")


def _causes(failed: dict[int, tuple[str, str]], cause: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The distinct one-line summaries of `failed` ({rank: (traceback, summary)}), the
    cause's first, each with the ranks that reported it in rank order."""
    order = [failed[cause][1]] + [summary for _, summary in failed.values()]
    return tuple((line, tuple(r for r in sorted(failed) if failed[r][1] == line))
                 for line in dict.fromkeys(order))


# How long the launcher keeps listening after the first failure: a rank that dies takes
# its peers' connections with it, and their "connection closed" reports can reach the
# queue before the launcher sees the death itself (CI, 2 cores: rank 1's gloo error
# arrived first). A dead peer's socket closes as it exits, so the death is visible well
# within a second; a later, independent failure is only appended.
_FAILURE_GRACE_S = 1.0


def _failure(errors: dict, procs, results, done) -> RankFailed | None:
    """The RankFailed to raise once some rank has failed (None if none did after all).

    Drains reports for `_FAILURE_GRACE_S`, then names as the cause a rank that died
    without a report (a crash or kill; its peers' errors follow from it), else the
    first rank that reported one; the others' last lines are appended. A rank that
    exited after a result still in flight is not a failure: its result lands in `done`.
    """
    end = time.monotonic() + _FAILURE_GRACE_S
    while time.monotonic() < end:
        try:
            status, rank, payload = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "err":
            errors.setdefault(rank, payload)
        else:
            done[rank] = pickle.loads(payload)
    silent = {r: (f"process exited with code {p.exitcode} without a result",) * 2
              for r, p in enumerate(procs) if r not in done and r not in errors and not p.is_alive()}
    failed = {**silent, **errors}
    if not failed:
        return None
    cause = next(iter(failed))
    detail = failed[cause][0]
    others = [f"rank {r}: {text.strip().splitlines()[-1]}" for r, (text, _) in failed.items() if r != cause]
    if others:
        detail = detail.rstrip("\n") + "\n\nalso failed (likely because of the above):\n" + "\n".join(others)
    return RankFailed(cause, detail, causes=_causes(failed, cause))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "auto",
    args: Sequence[Any] = (),
    timeout_s: float = 300.0,
    env: dict | None = None,
) -> list:
    """Run `fn(world, *args)` on `world_size` ranks; return their results in rank order.

    Raises RankFailed with the first failing rank's traceback if any rank raises
    or exits without a result, and RankFailed naming every unfinished rank if the
    launch outlives `timeout_s` (their Python stacks are dumped to stderr first).
    Never returns while a rank is still running. If this process dies, its ranks
    exit within a second and remove the `sparkinfer_launch_*` rendezvous directory.
    """
    if world_size < 1:
        raise SetupError(f"world_size must be >= 1, got {world_size}")
    backend = resolve_backend(backend, world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # Rendezvous through a file in a fresh directory: a free TCP port picked here
    # could be taken by another process before rank 0 binds it.
    store_dir = tempfile.mkdtemp(prefix="sparkinfer_launch_")
    init_method = "file://" + os.path.join(store_dir, "store")
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, backend, init_method, tuple(args), dict(env or {}), results, os.getpid()),
            daemon=True,
        )
        for r in range(world_size)
    ]
    # CPU ranks must see TRITON_INTERPRET=1 from their first import: unpickling `fn` and
    # `args` can import kernel modules, and @triton.jit reads the variable when it decorates.
    # And one BLAS thread unless the caller chose: interpreted dots are small matmuls, and
    # OpenBLAS's threads spinning beside the ranks made a [64, 64] x [64, 128] one take 601 us
    # against 199 on one thread (a busy 2-core host, numpy 2.2's OpenBLAS 0.3.29).
    spawn_env = {"TRITON_INTERPRET": "1"} if backend == "cpu" else {}
    if backend == "cpu" and "OPENBLAS_NUM_THREADS" not in os.environ:
        spawn_env["OPENBLAS_NUM_THREADS"] = "1"
    saved = {k: os.environ.get(k) for k in spawn_env}
    os.environ.update(spawn_env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            try:
                status, rank, payload = results.get(timeout=0.2)
            except queue.Empty:
                if any(r not in done and not p.is_alive() for r, p in enumerate(procs)):
                    failure = _failure({}, procs, results, done)
                    if failure is not None:
                        raise failure from None
                    continue
                if time.monotonic() > deadline:
                    stuck = [r for r in range(world_size) if r not in done]
                    for r in stuck:
                        if procs[r].is_alive():
                            os.kill(procs[r].pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    what = f"still running after {timeout_s:.0f} s (stacks dumped to stderr)"
                    raise RankFailed(stuck[0], f"ranks {stuck} {what}", causes=((what, tuple(stuck)),)) from None
                continue
            if status == "err":
                raise _failure({rank: payload}, procs, results, done)
            done[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(done) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    return [done[r] for r in range(world_size)]
