"""A rank that dies during setup, before close or in the middle of close(): the
survivors get SetupError / TeardownError (never a raw gloo RuntimeError), within
the exchange's failure time, and no slab name is left in /dev/shm, the dead
rank's included once it had published its name."""

import os

import pytest

from sparkinfer.comm.memory import HostSlabBackend
from tests.faults._util import CAP, close_outcome, shm_files, spawn_ranks


class _DieOnAllocate(HostSlabBackend):
    """The victim's backend: the process dies where setup allocates its slab."""

    def allocate(self, nbytes):
        os._exit(3)


def _die_in_setup(world, victim):
    from sparkinfer.comm import Communicator
    from sparkinfer.errors import SetupError

    backend = _DieOnAllocate() if world.rank == victim else None
    try:
        Communicator(capacity_bytes=CAP, timeout_s=2, backend=backend)
        return "constructed", shm_files(os.getpid())
    except SetupError as e:
        return "SetupError: " + str(e), shm_files(os.getpid())
    except Exception as e:  # noqa: BLE001 - reported, so the test names the wrong type
        return f"{type(e).__name__}: {e}", shm_files(os.getpid())


def test_rank_dying_in_setup_gives_setup_error_and_no_shm_leak():
    out = spawn_ranks(_die_in_setup, 3, args=(2,), timeout_s=120)
    assert 2 not in out
    for r in (0, 1):
        status, (msg, left) = out[r]
        assert status == "ok", msg
        assert msg.startswith("SetupError:") and "a peer died, stalled or left" in msg, msg
        assert left == [], left


def _die_before_close(world, victim):
    import time

    from sparkinfer.comm import Communicator
    from sparkinfer.errors import LifecycleError

    comm = Communicator(capacity_bytes=CAP, timeout_s=2)
    if world.rank == victim:
        os._exit(3)
    time.sleep(1.0)  # the victim is gone
    res = close_outcome(comm)
    try:
        comm.all_reduce(__import__("torch").ones(4))
        after = "usable"
    except LifecycleError as e:
        after = "LifecycleError: " + str(e)
    except Exception as e:  # noqa: BLE001
        after = f"{type(e).__name__}: {e}"
    return res, after, shm_files(os.getpid())


def test_close_after_a_peer_died_raises_teardown_error():
    out = spawn_ranks(_die_before_close, 2, args=(1,), timeout_s=120)
    status, (res, after, left) = out[0]
    assert status == "ok", res
    assert res.startswith("TeardownError:") and "a peer died, stalled or left" in res and "pool is closed" in res, res
    assert after.startswith("LifecycleError:"), after
    assert left == []


class _DieIn(HostSlabBackend):
    """The victim's backend: the process dies in backend method `where` (os._exit:
    nothing of it runs afterwards), after writing its pid where the test finds it."""

    def __init__(self, where, pid_file):
        self.where = where
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))

    def _maybe_die(self, where):
        if where == self.where:
            os._exit(3)

    def open(self, peer, handle, nbytes):  # setup, between publishing its name and its seal
        self._maybe_die("open")
        return super().open(peer, handle, nbytes)

    def seal(self, slab):  # setup, every slab mapped everywhere, its own name not yet dropped
        self._maybe_die("seal")
        return super().seal(slab)

    def close(self, mapping):  # close(), after the 'synchronize' phase, unmapping its imports
        self._maybe_die("close")
        return super().close(mapping)


def _die_in(world, where, pid_file):
    from sparkinfer.comm import Communicator
    from sparkinfer.errors import SetupError

    backend = _DieIn(where, pid_file) if world.rank == 1 else None
    try:
        comm = Communicator(capacity_bytes=CAP, timeout_s=2, backend=backend)
    except SetupError as e:
        return "SetupError: " + str(e), shm_files(os.getpid())
    return close_outcome(comm), shm_files(os.getpid())


@pytest.mark.parametrize("where", ["open", "seal", "close"])
def test_rank_dying_part_way_through_setup_or_close(where, tmp_path):
    """open: the victim published its slab's name and dies mapping its peer's; seal: setup
    finished everywhere but the victim's own seal; close: between close()'s phases. The
    survivor: SetupError, or a communicator whose close() raises TeardownError; no name of
    either process is left in /dev/shm (the survivor drops the dead peer's)."""
    pid_file = tmp_path / "victim"
    out = spawn_ranks(_die_in, 2, args=(where, str(pid_file)), timeout_s=60)
    assert 1 not in out, out.get(1)
    status, (msg, left) = out[0]
    assert status == "ok", msg
    want = "SetupError:" if where == "open" else "TeardownError:"
    assert msg.startswith(want) and "a peer died, stalled or left" in msg, msg
    assert left == [], left
    assert shm_files(int(pid_file.read_text())) == [], "the dead rank's slab name is left in /dev/shm"
