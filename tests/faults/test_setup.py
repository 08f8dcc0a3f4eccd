"""Communicator setup: every argument is checked, and every rank reaches the
same verdict (SetupError everywhere, never one rank raising while the others
wait); an environment variable that cannot be read says which and why."""

import pytest
import torch

from sparkinfer.errors import DeviceError, SetupError
from sparkinfer.runtime import LocalGroup, run_ranks
from tests.faults._util import CAP, expect_raises, expected_sum, payload


def _bad_arguments(world):
    from sparkinfer.comm import Communicator

    r = world.rank
    cases = [
        ("channel_ids-bare-string", SetupError, r"bare string 'target'.*pass \('target',\)",
         lambda: Communicator(capacity_bytes=CAP, channel_ids="target")),
        ("capacity-differs", SetupError, r"different capacity_bytes \[8192, 16384\]",
         lambda: Communicator(capacity_bytes=CAP * (r + 1))),
        ("timeout-on-one-rank", SetupError,
         "timeout_s must be a positive finite number of seconds, got -1" if r == 1 else
         r"rejected on rank 1 \(SetupError: timeout_s must be a positive",
         lambda: Communicator(capacity_bytes=CAP, timeout_s=-1 if r == 1 else 5)),
        ("capacity-not-int", SetupError, "capacity_bytes must be a positive int",
         lambda: Communicator(capacity_bytes=8.5)),
        ("device-meta", DeviceError, "a Communicator runs on 'cpu' or 'cuda:<index>', not 'meta'",
         lambda: Communicator(capacity_bytes=CAP, device="meta")),
        # the rank with the bad argument raises its own typed error, the others SetupError naming it
        ("device-meta-on-one-rank", DeviceError if r == 1 else SetupError,
         "not 'meta'" if r == 1 else r"rejected on rank 1 \(DeviceError: device='meta': a Communicator runs on",
         lambda: Communicator(capacity_bytes=CAP, device="meta" if r == 1 else "cpu", timeout_s=5)),
    ]
    bad = expect_raises(cases)
    comm = Communicator(capacity_bytes=CAP, device="cpu:0", timeout_s=60)  # "cpu:0" is the CPU
    x = payload(r, 64)
    if not torch.equal(comm.all_reduce(x), expected_sum(world.world_size, 64)):
        bad.append(("cpu:0", "wrong sum"))
    comm.close()
    return bad


def test_bad_arguments_give_setup_error_on_every_rank():
    assert run_ranks(_bad_arguments, 2, backend="cpu", timeout_s=180) == [[], []]


@pytest.mark.parametrize("value", ["-1", "0", "abc", "inf", "nan"])
def test_timeout_environment_variable_is_checked(monkeypatch, value):
    from sparkinfer.comm import Communicator

    monkeypatch.setenv("SPARKINFER_TIMEOUT_S", value)
    with pytest.raises(SetupError, match=f"SPARKINFER_TIMEOUT_S='{value}' is not a positive number of seconds"):
        Communicator(LocalGroup(), device="cpu", capacity_bytes=CAP)
