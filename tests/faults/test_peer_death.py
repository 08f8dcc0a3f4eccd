"""A rank that dies during setup or before close: the survivors get SetupError /
TeardownError (never a raw gloo RuntimeError), within the exchange's failure
time, and leave no slab named in /dev/shm."""

import os

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
