"""Collectives on CPU ranks (Triton interpreter, shared memory): exact results
on rank-encoded integer payloads, parity across many ops, timeouts, mismatches."""

import pytest
import torch

from sparkinfer.errors import CollectiveMismatch, CollectiveTimeout
from sparkinfer.runtime import run_ranks

CAP = 8192  # bytes: small, so "capacity" and "capacity + 1" are cheap to test
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def payload(rank, n, dtype, salt=0):
    """Small integers: every partial sum is exact in bf16/fp16/fp32."""
    return ((torch.arange(n) * 5 + rank * 3 + salt) % 11).to(dtype)


def expected_sum(world, n, dtype, salt=0):
    return sum(payload(r, n, torch.float32, salt) for r in range(world)).to(dtype)


def _all_ops(world):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=90)
    W, r = world.world_size, world.rank
    fails, salt = [], 0
    for dtype in DTYPES:
        isz = torch.empty(0, dtype=dtype).element_size()
        limit = CAP // isz
        for n in (1, 7, 64, 333, limit, limit + 1):
            for algo in ("ll", "oneshot", "twoshot", "auto"):
                salt += 1
                if algo != "auto" and n > limit or algo == "ll" and 2 * n > limit:
                    continue
                x = payload(r, n, dtype, salt)
                out = torch.full_like(x, float("nan"))
                comm.all_reduce(x, out, algorithm=algo)
                if not torch.equal(out, expected_sum(W, n, dtype, salt)):
                    fails.append(("all_reduce", algo, str(dtype), n))
            m = (n // W) * W
            if m and m <= limit:
                x = payload(r, m, dtype, salt)
                out = torch.full((m // W,), float("nan"), dtype=dtype)
                comm.reduce_scatter(x, out)
                if not torch.equal(out, expected_sum(W, m, dtype, salt)[r * (m // W):(r + 1) * (m // W)]):
                    fails.append(("reduce_scatter", str(dtype), m))
            k = max(1, n // W)
            x = payload(r, k, dtype, salt)
            out = torch.full((W * k,), float("nan"), dtype=dtype)
            comm.all_gather(x, out)
            if not torch.equal(out, torch.cat([payload(q, k, dtype, salt) for q in range(W)])):
                fails.append(("all_gather", str(dtype), k))
    # in place
    x = payload(r, 100, torch.float32)
    comm.all_reduce(x, x)
    if not torch.equal(x, expected_sum(W, 100, torch.float32)):
        fails.append(("in-place",))
    comm.synchronize()
    comm.close()
    return fails


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"{w}ranks")
def test_every_op_every_dtype_exact(world):
    assert run_ranks(_all_ops, world, backend="cpu", timeout_s=600) == [[]] * world


def _parity(world):
    """Odd-length sequences of ops with different algorithms and grids keep the
    device-owned epoch/slot parity aligned: 3 ops per round, 7 rounds."""
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=90)
    W, r = world.world_size, world.rank
    ok = True
    for rnd in range(7):
        for i, (n, algo) in enumerate([(6, "ll"), (1500, "twoshot"), (900, "oneshot")]):
            salt = rnd * 3 + i
            out = comm.all_reduce(payload(r, n, torch.float32, salt), algorithm=algo)
            ok &= torch.equal(out, expected_sum(W, n, torch.float32, salt))
    ch = comm.pool.get("eager")
    epoch = ch.slab.keep[1][:8].view(torch.int64).item()
    comm.close()
    return ok, epoch


def test_odd_op_parity_and_epoch_count():
    out = run_ranks(_parity, 2, backend="cpu", timeout_s=300)
    assert out == [(True, 21)] * 2


def _skip(world, victim, algo):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=5)
    x = payload(world.rank, 64, torch.float32)
    comm.all_reduce(x, algorithm=algo)  # everyone takes part once
    result = None
    if world.rank != victim:
        try:
            comm.all_reduce(x, algorithm=algo)
        except CollectiveTimeout as e:
            result = ("timeout", e.peer, e.op, e.epoch, str(e))
    comm.close()
    return result


@pytest.mark.parametrize("world,victim,algo", [(2, 1, "oneshot"), (3, 2, "oneshot"), (2, 1, "ll"), (3, 0, "twoshot")])
def test_rank_that_stops_participating_is_named(world, victim, algo):
    out = run_ranks(_skip, world, backend="cpu", args=(victim, algo), timeout_s=120)
    for r, res in enumerate(out):
        if r == victim:
            assert res is None
            continue
        kind, peer, op, epoch, msg = res
        assert (kind, peer, op, epoch) == ("timeout", victim, f"all_reduce_{algo}", 1)
        assert f"waiting for rank {victim}" in msg


def _mismatch(world, what, algo="oneshot"):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=90)
    r = world.rank
    try:
        if what == "size":
            comm.all_reduce(payload(r, 64 * (r + 1), torch.float32), algorithm=algo)
        else:  # different collectives at the same sequence number
            if r == 0:
                comm.all_reduce(payload(r, 64, torch.float32), algorithm="oneshot")
            else:
                comm.all_gather(payload(r, 64, torch.float32))
        res = None
    except CollectiveMismatch as e:
        res = (e.peer, str(e))
    comm.close()
    return res


@pytest.mark.parametrize("what,algo", [("size", "oneshot"), ("size", "ll"), ("kind", "oneshot")])
def test_ranks_calling_different_collectives_raise_mismatch(what, algo):
    out = run_ranks(_mismatch, 2, backend="cpu", args=(what, algo), timeout_s=120)
    for r, res in enumerate(out):
        assert res is not None, f"rank {r} did not detect the mismatch"
        assert res[0] == 1 - r and "different collective or size" in res[1]


def _rejections(world):
    from sparkinfer.comm import Communicator
    from sparkinfer.errors import CapacityError, DeviceError, DTypeError, LayoutError, PlanError, ShapeError

    comm = Communicator(capacity_bytes=CAP, timeout_s=90)
    x = payload(world.rank, 64, torch.float32)
    cases = [
        (DTypeError, "dtype torch.int32; supported: bfloat16, float16, float32", lambda: comm.all_reduce(x.int())),
        (DTypeError, "must be a torch.Tensor", lambda: comm.all_reduce([1, 2])),
        (DeviceError, "is on meta, this communicator's device is cpu", lambda: comm.all_reduce(x.to("meta"))),
        (LayoutError, "not contiguous; pass .contiguous", lambda: comm.all_reduce(x.view(8, 8).t())),
        (ShapeError, "out must match x", lambda: comm.all_reduce(x, torch.empty(65))),
        (ShapeError, "splits dim 0 over 2 ranks; x has shape \\(7,\\)", lambda: comm.reduce_scatter(x[:7])),
        (ShapeError, "out must have shape \\(128,\\)", lambda: comm.all_gather(x, torch.empty(64))),
        (ShapeError, "0-dimensional", lambda: comm.all_gather(x[0])),
        (CapacityError, r"all_reduce stages 8196 B but the staging capacity is 8192 B \(algorithm='oneshot'\)",
         lambda: comm.all_reduce(payload(0, CAP // 4 + 1, torch.float32), algorithm="oneshot")),
        (PlanError, "algorithm must be 'auto' or one of", lambda: comm.all_reduce(x, algorithm="ring")),
    ]
    seen = []
    for exc, match, fn in cases:
        try:
            fn()
            seen.append(("no error", match))
        except exc as e:
            import re

            seen.append(("ok" if re.search(match, str(e)) else f"wrong message: {e}", match))
    # over capacity during capture raises instead of falling back
    comm.pool.prepare(["g"])
    with comm.pool.capture("gs", "g"):
        with comm.streams.capture("gs"):
            try:
                comm.all_reduce(payload(0, CAP, torch.float32))
                seen.append(("no error", "capacity in capture"))
            except CapacityError as e:
                seen.append(("ok" if "during graph capture" in str(e) else str(e), "capacity in capture"))
    comm.close()
    return [s for s in seen if s[0] != "ok"]


def test_bad_inputs_raise_typed_errors():
    assert run_ranks(_rejections, 2, backend="cpu", timeout_s=120) == [[], []]


def _wrap(world, start):
    """Sequence numbers wrap (16 bits in LL flags, 32 in barrier flags): start
    the device epoch just below each wrap point and keep going."""
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=90)
    ch = comm.pool.get("eager")
    ch.slab.keep[1][:8].view(torch.int64).fill_(start)  # header word 0: the epoch
    W, r = world.world_size, world.rank
    ok = True
    for i in range(6):
        for algo in ("ll", "oneshot", "twoshot"):
            out = comm.all_reduce(payload(r, 40, torch.bfloat16, i), algorithm=algo)
            ok &= torch.equal(out, expected_sum(W, 40, torch.bfloat16, i))
    comm.close()
    return ok


@pytest.mark.parametrize("start", [(1 << 15) - 3, (1 << 16) - 4, (1 << 32) - 5],
                         ids=["ll-sign-bit", "ll-wrap", "flag-wrap"])
def test_sequence_numbers_wrap(start):
    assert run_ranks(_wrap, 2, backend="cpu", args=(start,), timeout_s=300) == [True, True]


def _ll_region_stays_clean(world):
    """The LL region holds only fresh LL words: other ops never write it and
    readers zero what they consumed, so between ops it reads all zeros (a raw
    payload left there could otherwise pass for a flag)."""
    import torch.distributed as dist

    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=90)
    ch = comm.pool.get("eager")
    lay = ch.layout
    region = ch.slab.keep[1][lay.ll_off:lay.ll_off + 2 * lay.ll_slot_bytes]
    W, r = world.world_size, world.rank
    dirty, wrong = 0, 0
    for i, algo in enumerate(["ll", "oneshot", "twoshot", "ll", "ll", "oneshot", "ll"]):
        x = payload(r, 600, torch.bfloat16, i)
        wrong += not torch.equal(comm.all_reduce(x, algorithm=algo), expected_sum(W, 600, torch.bfloat16, i))
        dist.barrier()
        dirty += int(region.count_nonzero())
        dist.barrier()
    del region
    comm.close()
    return dirty, wrong


def test_ll_region_holds_only_fresh_words():
    assert run_ranks(_ll_region_stays_clean, 2, backend="cpu", timeout_s=300) == [(0, 0)] * 2


def _pipelined(world):
    """Pieces per block (GridConfig.pipe = 2, flag phases 0..3) give the same
    exact results as unpipelined launches, for every algorithm that uses them."""
    from sparkinfer.comm import Communicator, GridConfig
    from sparkinfer.comm.all_reduce.launch import all_reduce
    from sparkinfer.comm.reduce_scatter.launch import reduce_scatter

    comm = Communicator(capacity_bytes=CAP, timeout_s=90)
    W, r = world.world_size, world.rank
    bad = []
    for pipe in (2, 1, 2):
        cfg = GridConfig(grid=2, block=64, num_warps=1, pipe=pipe)
        for n in (1, 100, 1000, 2000):
            for algo in ("oneshot", "twoshot"):
                out = all_reduce(comm.context, payload(r, n, torch.float32, n + pipe), algorithm=algo, config=cfg)
                if not torch.equal(out, expected_sum(W, n, torch.float32, n + pipe)):
                    bad.append((pipe, algo, n))
            m = (n // W) * W
            if m:
                rs = reduce_scatter(comm.context, payload(r, m, torch.bfloat16, pipe), config=cfg)
                if not torch.equal(rs, expected_sum(W, m, torch.bfloat16, pipe)[r * (m // W):(r + 1) * (m // W)]):
                    bad.append((pipe, "rs", m))
    comm.close()
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_pieces_are_exact(world):
    assert run_ranks(_pipelined, world, backend="cpu", timeout_s=600) == [[]] * world
