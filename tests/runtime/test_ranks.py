import os
import time

import pytest

from sparkinfer.errors import RankFailed, SetupError, ShapeError
from sparkinfer.runtime import run_ranks


def _ok(world, base):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(world.rank + base)])
    dist.all_reduce(t)
    return (world.rank, world.world_size, world.backend, t.item(), os.environ.get("TRITON_INTERPRET"))


def _raise_on_1(world):
    import torch.distributed as dist

    # every rank is up first: a rank that raises while the others still connect gloo's mesh
    # makes them fail too ("connectFullMesh failed"), a second cause within the grace second
    dist.barrier()
    if world.rank == 1:
        raise ValueError("rank one is unhappy")
    time.sleep(30)  # the others would wait; the launcher must not


def _two_causes(world):
    import torch.distributed as dist

    dist.barrier()  # every rank is up: all three reports reach the launcher within its grace second
    if world.rank == 1:
        raise ValueError("rank one is unhappy\nsecond line")
    raise ShapeError("ranks 0 and 2 agree")


def _die_on_0(world):
    if world.rank == 0:
        os._exit(3)
    time.sleep(30)


def _die_on_0_and_1_complains(world):
    import torch.distributed as dist

    dist.barrier()  # both up: rank 1's report is this error, not a gloo one from a half-built mesh
    if world.rank == 0:
        os._exit(3)
    time.sleep(0.1)  # rank 0 is gone; rank 1's report still reaches the queue first
    raise RuntimeError("connection closed by peer")


def _hang(world):
    time.sleep(60)


def test_results_in_rank_order():
    out = run_ranks(_ok, 3, backend="cpu", args=(10,), timeout_s=120)
    assert out == [(r, 3, "cpu", 33.0, "1") for r in range(3)]


def test_raising_rank_fails_fast_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 failed:(.|\n)*ValueError: rank one is unhappy") as ei:
        run_ranks(_raise_on_1, 2, backend="cpu", timeout_s=120)
    assert ei.value.rank == 1 and ei.value.causes == (("ValueError: rank one is unhappy", (1,)),)
    assert time.monotonic() - t0 < 25


def test_distinct_causes_are_one_line_each_with_their_ranks():
    with pytest.raises(RankFailed) as ei:
        run_ranks(_two_causes, 3, backend="cpu", timeout_s=120)
    causes = dict(ei.value.causes)
    assert causes == {"ShapeError: ranks 0 and 2 agree": (0, 2), "ValueError: rank one is unhappy": (1,)}
    assert ei.value.rank in ei.value.causes[0][1]  # the cause named first


def test_dead_rank_fails_the_launch():
    with pytest.raises(RankFailed, match=r"rank 0 failed:\nprocess exited with code 3"):
        run_ranks(_die_on_0, 2, backend="cpu", timeout_s=120)


def test_silent_death_is_named_before_the_errors_it_causes():
    # CI (two cores, 2026-12-02): rank 0 exited while rank 1 was still in init, and rank 1's gloo "connection closed"
    # reached the launcher first, which then blamed rank 1
    with pytest.raises(RankFailed, match=r"rank 0 failed:\nprocess exited with code 3 without a result\n\n"
                                         r"also failed \(likely because of the above\):\n"
                                         r"rank 1: RuntimeError: connection closed by peer$") as ei:
        run_ranks(_die_on_0_and_1_complains, 2, backend="cpu", timeout_s=120)
    assert ei.value.rank == 0
    assert ei.value.causes == (("process exited with code 3 without a result", (0,)),
                               ("RuntimeError: connection closed by peer", (1,)))


def test_hung_ranks_are_named_after_the_timeout():
    with pytest.raises(RankFailed, match=r"ranks \[0, 1\] still running after 3 s") as ei:
        run_ranks(_hang, 2, backend="cpu", timeout_s=3)
    assert ei.value.causes == (("still running after 3 s (stacks dumped to stderr)", (0, 1)),)


@pytest.mark.parametrize("kw,match", [(dict(backend="tpu"), "backend must be"),
                                      (dict(backend="cpu", world_size=0), "world_size must be")])
def test_bad_arguments(kw, match):
    ws = kw.pop("world_size", 2)
    with pytest.raises(SetupError, match=match):
        run_ranks(_ok, ws, args=(0,), **kw)


def test_gpu_backends_without_gpus_raise():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    with pytest.raises(SetupError, match="needs 1 GPU"):
        run_ranks(_ok, 2, backend="cuda_shared", args=(0,))
    with pytest.raises(SetupError, match="needs 2 GPU"):
        run_ranks(_ok, 2, backend="cuda", args=(0,))


def _flag(world):
    from sparkinfer.engine import engine

    return engine.MIXED_ROWS


def test_ranks_apply_the_launchers_sparkinfer_flags(monkeypatch):
    """SPARKINFER_FLAGS reaches every rank, which sets the flag before its work; unset, the
    default (the launcher's own module is not changed by a rank)."""
    from sparkinfer.engine import engine

    default = engine.MIXED_ROWS
    monkeypatch.setenv("SPARKINFER_FLAGS", "sparkinfer.engine.engine.MIXED_ROWS=8")
    assert run_ranks(_flag, 2, backend="cpu", timeout_s=120) == [8, 8]
    monkeypatch.delenv("SPARKINFER_FLAGS")
    assert run_ranks(_flag, 2, backend="cpu", timeout_s=120) == [default, default] and engine.MIXED_ROWS == default
