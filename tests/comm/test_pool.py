"""ChannelPool lifecycle: single-process with a fake backend (sharp, fast), and
real CPU ranks with shared memory where the behaviour crosses processes."""

import gc
import warnings

import pytest
import torch

from sparkinfer.comm import EAGER, ChannelPool
from sparkinfer.errors import (
    CaptureError,
    LifecycleError,
    SetupError,
    StreamAffinityError,
    TeardownError,
)
from sparkinfer.runtime import CpuStreams, LocalGroup, run_ranks
from tests.comm.faults import FakeBackend, FaultyHostBackend


def make_pool(**fail):
    streams = CpuStreams()
    backend = FakeBackend(fail)
    pool = ChannelPool(LocalGroup(), "cpu", 4096, backend=backend, streams=streams)
    return pool, streams, backend


def test_prepare_sorted_and_idempotent():
    pool, _, be = make_pool()
    assert pool.prepare(["target", "draft"]) == ["draft", "eager", "target"]
    assert pool.prepare(["draft"]) == []
    assert [pool.get(c).serial for c in ("draft", "eager", "target")] == [0, 1, 2]
    assert len(be.live) == 3
    pool.close()
    assert be.live == {}


def test_eager_channel_is_stream_affine():
    pool, streams, _ = make_pool()
    pool.prepare(["side"])
    assert pool.channel().channel_id == EAGER  # first eager stream takes "eager"
    with streams.use("s2"):
        with pytest.raises(StreamAffinityError, match="eager channel is owned by stream main"):
            pool.channel()
        pool.bind_stream("s2", "side")
        assert pool.channel().channel_id == "side"
    with pytest.raises(StreamAffinityError, match="already owned by stream s2"):
        pool.bind_stream("s3", "side")
    pool.close()


def test_nested_capture_target_and_draft_with_aliases_removed_lifo():
    pool, streams, _ = make_pool()
    pool.prepare(["target", "draft"])
    with pool.capture("sA", "target") as tgt:
        with streams.use("sA"):
            assert pool.channel() is tgt  # warm-up inside the scope, not capturing yet
        with streams.capture("sA"):
            assert pool.channel() is tgt
            with streams.capture("fork1"):  # a stream torch forked inside the capture
                assert pool.channel() is tgt
            with pool.capture("sB", "draft") as dft:
                with streams.capture("sB"):
                    assert pool.channel() is dft
                with streams.capture("fork2"):
                    assert pool.channel() is dft  # aliases the innermost scope
                with streams.capture("fork1"):
                    assert pool.channel() is tgt  # already an alias of the outer scope
            assert pool._scopes[-1].aliases == ["fork1"]
        assert pool.scope_depth() == 1
    assert pool.scope_depth() == 0
    assert pool.get("target").graph_owned and pool.get("draft").graph_owned
    # a recycled stream key never reaches a graph's channel after exit
    with streams.use("fork1"):
        assert pool.channel().channel_id == EAGER
    pool.close()


def test_capture_errors():
    pool, streams, _ = make_pool()
    pool.prepare(["target"])
    with pytest.raises(LifecycleError, match="channel 'nope' is not prepared"):
        with pool.capture("s", "nope"):
            pass
    with pool.capture("s", "target"):
        with pytest.raises(CaptureError, match="already being captured by an enclosing scope"):
            with pool.capture("s2", "target"):
                pass
        with streams.capture("s"):
            pool.channel()  # a collective captured into the graph
            with pytest.raises(CaptureError, match="prepare\\(\\) allocates peer memory"):
                pool.prepare(["late"])
    with pytest.raises(CaptureError, match="owned by an earlier graph"):
        with pool.capture("s", "target"):
            pass
    with pool.capture("s", "target", reuse=True):
        pass
    with streams.capture("loose"):
        with pytest.raises(CaptureError, match="outside pool.capture"):
            pool.channel()
    pool.channel()  # "main" takes the eager channel
    with pytest.raises(StreamAffinityError, match="owned by eager stream main"):
        with pool.capture("other", EAGER):
            pass
    pool.close()


def test_warm_up_only_scope_leaves_the_channel_free():
    pool, streams, _ = make_pool()
    pool.prepare(["target"])
    with pool.capture("s", "target"):
        with streams.use("s"):
            pool.channel()  # warm-up, nothing captured
    assert not pool.get("target").graph_owned
    with pool.capture("s", "target"):  # so capturing it is no re-capture
        with streams.capture("s"):
            pool.channel()
    assert pool.get("target").graph_owned
    pool.close()


def test_rollback_closes_exactly_post_checkpoint_channels():
    pool, streams, be = make_pool()
    pool.prepare(["target"])
    cp = pool.checkpoint()
    pool.prepare(["try1", "try2"])
    with pool.capture("s", "try1"), streams.capture("s"):
        pool.channel()
    keep = {id(pool.get(c).slab) for c in ("eager", "target")}
    assert sorted(pool.rollback(cp)) == ["try1", "try2"]
    assert pool.channel_ids == ["eager", "target"]
    assert set(be.live) == keep
    assert pool.rollback(cp) == []
    pool.close()


def test_failed_unmap_leaves_channels_owned_and_retryable():
    pool, _, be = make_pool()
    pool.prepare()
    cp = pool.checkpoint()
    pool.prepare(["attempt"])
    ch = pool.get("attempt")
    ch.peers[1] = be.open(1, b"x", 10)  # pretend a peer mapping exists
    be.fail["close"] = 1
    with pytest.raises(TeardownError, match="phase 'unmap imports' failed on rank 0.*nothing was freed"):
        pool.rollback(cp)
    assert pool.channel_ids == ["attempt", "eager"] and not ch.slab.freed  # still owned
    assert pool.rollback(cp) == ["attempt"]
    assert ch.slab.freed and ch.peers[1].closed
    pool.close()


def test_failed_free_can_be_finished_by_calling_close_again():
    pool, _, be = make_pool(free=1)
    pool.prepare(["a"])
    with pytest.raises(TeardownError, match="phase 'free exports'.*call close\\(\\)/rollback\\(\\) again"):
        pool.close()
    assert not pool.closed
    pool.close()
    assert pool.closed and be.live == {}
    pool.close()  # idempotent


def test_use_after_close_raises():
    pool, _, _ = make_pool()
    pool.prepare()
    pool.close()
    with pytest.raises(LifecycleError, match="ChannelPool is closed"):
        pool.channel()
    with pytest.raises(LifecycleError, match="closed"):
        pool.prepare(["x"])


def test_gc_warns_and_never_frees():
    pool, _, be = make_pool()
    pool.prepare()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del pool
        gc.collect()
    assert any(issubclass(x.category, ResourceWarning) and "dropped without close" in str(x.message) for x in w)
    assert len(be.live) == 1 and "free" not in be.calls


def test_bad_ids_and_capacity():
    with pytest.raises(SetupError, match="capacity must be a positive"):
        ChannelPool(LocalGroup(), "cpu", 0, backend=FakeBackend())
    pool, _, _ = make_pool()
    with pytest.raises(SetupError, match="non-empty strings"):
        pool.prepare([""])
    pool.close()


def test_setup_failure_leaves_no_channel():
    pool, _, be = make_pool(allocate=1)
    with pytest.raises(SetupError, match="allocation failed on rank 0"):
        pool.prepare()
    assert pool.channel_ids == [] and be.live == {}
    pool.prepare()
    pool.close()


# ---------------------------------------------------------------- real CPU ranks


def _mp_capture_orders(world):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=4096, timeout_s=10, channel_ids=("target", "draft"))
    pool, streams = comm.pool, comm.streams
    order = ["target", "draft"] if world.rank == 0 else ["draft", "target"]
    resolved = {}
    for cid in order:  # ranks enter their capture scopes in different orders
        with pool.capture(cid + "-stream", cid):
            with streams.capture(cid + "-stream"):
                resolved[cid] = pool.channel()
    got = {}
    for cid in ("target", "draft"):  # graphs replay in one order; each id meets its peer's slab
        with pool.capture(cid + "-stream", cid, reuse=True):
            x = torch.full((64,), float(world.rank + 1))
            with streams.use(cid + "-stream"):
                assert pool.channel() is resolved[cid]
                got[cid] = comm.all_reduce(x, algorithm="oneshot")[0].item()
    comm.close()
    return got


def test_ranks_capturing_in_different_orders_agree():
    out = run_ranks(_mp_capture_orders, 2, backend="cpu", timeout_s=120)
    assert out == [{"target": 3.0, "draft": 3.0}] * 2


def _mp_unmap_failure(world):
    be = FaultyHostBackend({"close": 1} if world.rank == 1 else {})
    pool = ChannelPool(__import__("sparkinfer.runtime", fromlist=["TorchGroup"]).TorchGroup(), "cpu", 4096, backend=be)
    pool.prepare(["a"])
    try:
        pool.close()
        first = "closed"
    except TeardownError as e:
        first = str(e)
    frees_after_failure = be.frees
    pool.close()
    return first, frees_after_failure, be.frees, pool.closed


def test_one_rank_failing_unmap_blocks_every_free():
    out = run_ranks(_mp_unmap_failure, 3, backend="cpu", timeout_s=120)
    for first, frees_after_failure, frees, closed in out:
        assert "phase 'unmap imports' failed on rank 1" in first
        assert frees_after_failure == 0  # nobody freed memory a peer may still map
        assert frees == 2 and closed  # retry finished the job everywhere


def _mp_setup_failure(world, phase):
    from sparkinfer.runtime import TorchGroup

    be = FaultyHostBackend({phase: 1} if world.rank == 2 else {})
    pool = ChannelPool(TorchGroup(), "cpu", 4096, backend=be)
    try:
        pool.prepare(["x"])
        return "no error"
    except SetupError as e:
        return str(e), pool.channel_ids, be.frees
    finally:
        pool.prepare(["x"])  # the failure left nothing half-built: setup can be retried
        pool.close()


@pytest.mark.parametrize("phase", ["allocate", "open"])
def test_rank_failing_setup_raises_everywhere(phase):
    out = run_ranks(_mp_setup_failure, 3, backend="cpu", args=(phase,), timeout_s=120)
    for r, (msg, ids, frees) in enumerate(out):
        assert "on rank 2" in msg and "no channel was created" in msg
        assert ids == []
        assert frees == (0 if phase == "allocate" and r == 2 else 1)


def test_debug_log_reports_lifecycle(monkeypatch, capsys):
    monkeypatch.setenv("SPARKINFER_LOG", "debug")
    pool, streams, _ = make_pool()
    pool.prepare(["target"])
    with pool.capture("s", "target"), streams.capture("s"):
        pool.channel()
    pool.close()
    err = capsys.readouterr().err
    assert "[sparkinfer rank 0] channel 'target' #" in err
    assert "capture scope 'target' exited (captured=True)" in err and "pool closed (2 channels)" in err


def test_capture_that_fails_midway_leaves_no_channel_slab_or_alias():
    """The engine's pattern: checkpoint, capture on a new channel, fail inside (after torch
    forked a nested capture stream), roll back."""
    pool, streams, be = make_pool()
    pool.prepare(["target"])
    live = set(be.live)
    cp = pool.checkpoint()
    pool.prepare(["draft"])
    with pytest.raises(RuntimeError, match="capture failed"):
        with pool.capture("s", "draft") as ch, streams.capture("s"):
            assert pool.channel() is ch
            with streams.capture("nested"):
                assert pool.channel() is ch  # a nested capture stream aliases the scope's channel
            raise RuntimeError("capture failed")
    assert pool.rollback(cp) == ["draft"]
    assert pool.channel_ids == ["eager", "target"] and set(be.live) == live
    with streams.capture("nested"), pytest.raises(CaptureError):
        pool.channel()  # the alias went with the scope
    pool.close()
