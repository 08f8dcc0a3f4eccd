"""Host-side rejections are typed and say what to do: an unknown algorithm= of any
op raises PlanError (a SparkInferError), before anything runs and even for empty
tensors, and leaves the communicator usable."""

import pytest
import torch

from sparkinfer.errors import PlanError, SparkInferError
from sparkinfer.runtime import LocalGroup
from tests.faults._util import CAP

# op -> (call(comm, rows, algorithm), a kernel algorithm of that op: one rank has no torch.distributed path)
OPS = {
    "all_reduce": (lambda c, n, a: c.all_reduce(torch.ones(n), algorithm=a), "oneshot"),
    "all_reduce_add_rms_norm": (lambda c, n, a: c.all_reduce_add_rms_norm(torch.ones(n, 16), torch.ones(n, 16),
                                                                           torch.ones(16), algorithm=a), "fused"),
    "dcp_merge": (lambda c, n, a: c.dcp_merge(torch.ones(n, 2, 16), torch.zeros(n, 2), algorithm=a), "kernel"),
    "all_gather_heads": (lambda c, n, a: c.all_gather_heads(torch.ones(n, 2, 16), algorithm=a), "kernel"),
}


@pytest.fixture(scope="module")
def comm():
    from sparkinfer.comm import Communicator

    c = Communicator(LocalGroup(), device="cpu", capacity_bytes=CAP, timeout_s=5)
    yield c
    c.close()


@pytest.mark.parametrize("rows", [2, 0], ids=["data", "empty"])
@pytest.mark.parametrize("op", list(OPS))
def test_unknown_algorithm_is_a_typed_error(comm, op, rows):
    call, good = OPS[op]
    with pytest.raises(PlanError, match=r"algorithm must be .*got 'ring'; pass 'auto'") as ei:
        call(comm, rows, "ring")
    assert isinstance(ei.value, SparkInferError)
    call(comm, rows, good)  # usable: nothing ran, no sequence number was consumed
