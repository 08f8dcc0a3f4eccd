"""The fault suite on a GPU (compiled kernels; skipped without CUDA or under the
interpreter): non-finite MoE routing logits, per token and through a whole layer;
a NaN lse in dcp_merge and the non-finite data tables of test_nonfinite*.py; two
ranks sharing one GPU (`cuda_shared`, start MPS first for speed) where one is
killed inside a replayed CUDA graph (skipped while MPS runs: see that test), and
where one arrives after its peer timed out and aborted the group.

Run with TRITON_INTERPRET=0 (tests/conftest.py sets 1 when it is unset)."""

import os
import shutil
import subprocess
import time

import pytest
import torch

from sparkinfer.runtime import run_ranks
from tests.faults._util import (
    CAP,
    assert_late_peer_outcomes,
    close_outcome,
    late_peer_outcomes,
    payload,
    spawn_ranks,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset)")

DEADLINE_S = 3.0  # above 2**31 ns, like WARM_S: both specialize the kernels' timeout argument as int64
WARM_S = 60.0  # the deadline while the ranks first compile each kernel (seconds apart on a busy host)
SLACK_S = 3.0  # two processes time-sliced on one GPU without MPS, and process scheduling


def _warm(world, calls) -> None:
    """Compile every kernel `calls(comm)` launches, in lockstep under a long deadline, so
    that a compile never makes a rank late under the short one (same specializations)."""
    from sparkinfer.comm import Communicator

    comm = Communicator(device=world.device, capacity_bytes=CAP, timeout_s=WARM_S)
    calls(comm)
    comm.synchronize()
    comm.close()


# ---------------------------------------------------------------- non-finite inputs
def _nonfinite_cases():
    from tests.moe.test_routing import NONFINITE

    return [pytest.param(spec, bad, id=cid) for cid, spec, bad in NONFINITE]


@pytest.mark.parametrize("spec,bad", _nonfinite_cases())
def test_gpu_routing_nonfinite_logits(spec, bad):
    """tests/moe/test_routing.py::test_routing_nonfinite_logits on cuda tensors: ids
    stay K distinct experts in [0, E), the bad token's weights are all NaN like the
    reference's, the other tokens match the reference."""
    from sparkinfer.moe.routing import route, route_reference

    t, e, k = 3, 8, 3
    logits = torch.randn(t, e)
    logits[1] = torch.tensor(bad)
    bias = torch.randn(e) * 0.1 if spec.routing == "sigmoid_grouped" else None
    ids = torch.full((t, k), -7, dtype=torch.int32, device="cuda")
    w = torch.full((t, k), 7.0, device="cuda")
    route(logits.cuda(), spec, (ids, w), bias=None if bias is None else bias.cuda())
    ids, w = ids.cpu(), w.cpu()
    rid, rw = route_reference(logits, spec, k, bias=bias)
    assert ((ids >= 0) & (ids < e)).all(), ids
    assert all(len(set(row.tolist())) == k for row in ids), ids
    assert w[1].isnan().all() and rw[1].isnan().all(), (w, rw)
    assert torch.equal(ids[[0, 2]], rid[[0, 2]])
    torch.testing.assert_close(w[[0, 2]], rw[[0, 2]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(), dict(routing="sigmoid_grouped", n_group=4, topk_group=2)],
                         ids=["softmax", "sigmoid-grouped"])
def test_gpu_layer_nan_logit_gives_a_nan_row(kw):
    """A whole MoE layer (bf16 weights) with a NaN router logit in token 1: that
    output row is NaN like the reference's, never zeros; the others match it."""
    from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, moe_reference, prepare_weights, run
    from sparkinfer.moe.routing import route_reference
    from tests.moe._util import assert_moe_close, random_layer

    spec = MoESpec(**kw)
    t, e, k, h = 3, 8, 2, 64
    caps = MoECaps(max_tokens=32, num_experts=e, top_k=k, hidden=h, intermediate=32)
    p, _, src, _ = random_layer(caps, spec)
    w = prepare_weights(p, *(s.cuda() for s in src))
    x = torch.randn(t, h).bfloat16()
    logits = torch.randn(t, e)
    logits[1, 3] = float("nan")
    bias = torch.randn(e) if spec.routing == "sigmoid_grouped" else None
    out = torch.full((t, h), 7.0, dtype=torch.bfloat16, device="cuda")
    b = bind(p, allocate_scratch(p, "cuda"), w, x=x.cuda(), out=out, logits=logits.cuda(),
             bias=None if bias is None else bias.cuda())
    run(b)
    got = b.out.cpu()
    ref = moe_reference(x, src, route_reference(logits, spec, k, bias=bias), spec=spec)
    assert got[1].isnan().all() and ref[1].isnan().all()
    assert_moe_close(got[[0, 2]], ref[[0, 2]])


def test_gpu_dcp_merge_nan_lse_on_two_ranks():
    from tests.faults.test_nonfinite import dcp_nan

    assert run_ranks(dcp_nan, 2, backend="cuda_shared", timeout_s=300) == [[], []]


@pytest.mark.parametrize("module", ["tests.faults.test_nonfinite", "tests.faults.test_nonfinite_norm_dcp"])
def test_gpu_nonfinite_data_on_two_ranks(module):
    """The non-finite case tables on compiled kernels, two ranks on one GPU. The
    torch.distributed cases are left out: NCCL takes one GPU per rank."""
    from tests.faults._util import run_case_table

    out = run_ranks(run_case_table, 2, backend="cuda_shared", args=(module, ("nccl", "above-capacity")),
                    timeout_s=600)
    bad = {(r, cid): problems for r, got in enumerate(out) for cid, (problems, _) in got.items() if problems}
    assert bad == {}, bad
    assert {c: h for c, (_, h) in out[0].items()} == {c: h for c, (_, h) in out[1].items()}, "bits differ across ranks"


# ---------------------------------------------------------------- a rank killed inside a replayed graph
COLLECTIVES_PER_GRAPH = 3  # odd, and more than one: the victim dies waiting in the first


def _killed_in_replay(world, victim):
    from sparkinfer.comm import Communicator
    from sparkinfer.errors import CollectiveTimeout
    from tests.comm.graphs import Captured

    x = payload(world.rank, 256).cuda()
    _warm(world, lambda c: c.all_reduce(x, algorithm="oneshot"))
    comm = Communicator(device=world.device, capacity_bytes=CAP, timeout_s=DEADLINE_S, channel_ids=("target",))
    ys = []

    def step():
        ys[:] = [comm.all_reduce(x * (i + 1), algorithm="oneshot") for i in range(COLLECTIVES_PER_GRAPH)]

    cap = Captured(comm, step, "target")
    want = sum(payload(r, 256) for r in range(world.world_size)).cuda()
    for _ in range(3):  # lockstep replays: exact sums
        cap.replay()
        assert all(torch.equal(y, want * (i + 1)) for i, y in enumerate(ys))
    comm.group.barrier()
    if world.rank == victim:
        cap.graph.replay()  # its first collective signals, then waits for the survivor...
        time.sleep(0.2)
        os._exit(3)  # ...and the process dies inside the replay
    time.sleep(1.0)  # the victim is gone before this rank's replay starts
    t0 = time.monotonic()
    cap.graph.replay()
    try:
        comm.synchronize()
        res = "returned"
    except CollectiveTimeout as e:
        res = ("CollectiveTimeout", e.peer, str(e))
    elapsed = time.monotonic() - t0
    closed = close_outcome(comm)
    return res, elapsed, closed


MPS_PIPE_DIR = "/tmp/nvidia-mps"  # where CUDA clients look for the MPS control daemon unless told otherwise


def _mps_daemon() -> str | None:
    """The pipe directory of an MPS control daemon that this process's CUDA clients (and
    the ranks, which inherit its environment) would join, or None. Found the way the CUDA
    driver finds it, through CUDA_MPS_PIPE_DIRECTORY (default MPS_PIPE_DIR), not by a
    /proc scan for the daemon's process: that misses a daemon in another PID namespace
    (a container given the host's pipe directory) or hidden by /proc's hidepid, and
    counts one whose pipe directory no client here uses."""
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIR
    if not os.path.isdir(pipe_dir):
        return None  # nothing to connect through: CUDA runs here without MPS
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None:
        return pipe_dir  # cannot ask: a wrong skip costs one test, a wrong run every later one
    try:
        res = subprocess.run([ctl], input="get_server_list\n", capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return pipe_dir
    # asked through the same pipe directory (the control program reads the same variable), since
    # the path alone is no proof: a daemon that quit leaves it and its `control` socket behind
    # (H200, driver 580.159.04); the answer then is "Cannot find MPS control daemon process"
    gone = res.returncode != 0 and "cannot find mps control daemon" in (res.stdout + res.stderr).lower()
    return None if gone else pipe_dir


def test_gpu_rank_killed_inside_a_replayed_graph():
    """Two processes on one GPU, without MPS. Under MPS (H200, d9c7b07) the survivor did not
    return this test's result, and the next test's ranks could not initialise CUDA ("MPS
    server is not ready to accept new MPS client requests", error 807): a client killed
    inside a kernel takes the MPS server down for the others. So the test skips itself
    while an MPS daemon listens, and the GPU test files pass together with or without MPS.
    Not a fresh subprocess instead: the ranks already are fresh processes; what breaks is
    the server every later CUDA process joins, which only not killing a client under MPS
    spares. Checked when the test starts, not at collection."""
    pipe_dir = _mps_daemon()
    if pipe_dir is not None:
        pytest.skip(f"an MPS control daemon listens at {pipe_dir}: a client killed under MPS takes the MPS "
                    "server down for every later test (error 807); run this test with MPS stopped "
                    "(echo quit | nvidia-cuda-mps-control)")
    out = spawn_ranks(_killed_in_replay, 2, args=(1,), backend="cuda_shared", timeout_s=300)
    assert 1 not in out
    status, got = out[0]
    assert status == "ok", got  # the survivor's traceback
    res, elapsed, closed = got
    assert res[:2] == ("CollectiveTimeout", 1) and "timed out waiting for rank 1" in res[2], res
    assert elapsed < DEADLINE_S + SLACK_S, elapsed
    assert closed.startswith("TeardownError:") and "rank(s) [1] did not reach" in closed, closed


# ---------------------------------------------------------------- a late peer
LATE_S = 2.5 * DEADLINE_S


def _late_ops():
    return {
        "all_reduce_ll": lambda c, x: c.all_reduce(x, algorithm="ll"),
        "all_reduce_oneshot": lambda c, x: c.all_reduce(x, algorithm="oneshot"),
        "all_reduce_twoshot": lambda c, x: c.all_reduce(x, algorithm="twoshot"),
        "all_gather": lambda c, x: c.all_gather(x),
        "reduce_scatter": lambda c, x: c.reduce_scatter(x),
        "all_reduce_add_rms_norm": lambda c, x: c.all_reduce_add_rms_norm(
            x.view(2, 32), torch.zeros(2, 32, device=x.device), torch.ones(32, device=x.device)),
    }


def _late_on_gpu(world):
    from sparkinfer.comm import Communicator

    ops = _late_ops()
    x = payload(world.rank, 64).cuda()
    _warm(world, lambda c: [op(c, x) for op in ops.values()])
    return late_peer_outcomes(world, ops, lambda: Communicator(device=world.device, capacity_bytes=CAP,
                                                               timeout_s=DEADLINE_S), x, LATE_S, sync=True)


def test_gpu_a_late_peer_learns_of_the_abort_on_every_transport():
    r0, r1 = run_ranks(_late_on_gpu, 2, backend="cuda_shared", timeout_s=300)
    assert_late_peer_outcomes(r0, r1, _late_ops())
