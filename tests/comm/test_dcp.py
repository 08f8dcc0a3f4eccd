"""Decode-context-parallel merge and head gather on CPU ranks (Triton
interpreter, shared memory) against the fp32 reference: awkward shapes, strided
(head-major) inputs, empty shards whose o is NaN, all-but-one empty shards,
rows empty on every rank, lse values that overflow a naive exp, both lse bases,
scatter and replicate, the NCCL composition, and every rejection path.

All cases of one world size run inside one launch (the interpreter is slow).
"""

import dataclasses
import random

import pytest
import torch

from sparkinfer.comm.dcp.launch import row_config
from sparkinfer.comm.dcp.reference import dcp_merge_reference
from sparkinfer.comm.topology import TopologyCaps
from sparkinfer.errors import (
    CapacityError,
    CaptureError,
    CollectiveMismatch,
    DeviceError,
    DTypeError,
    LayoutError,
    PlanError,
    ShapeError,
)
from sparkinfer.runtime import LocalGroup, run_ranks
from tests.comm.graphs import GRAPH_BACKENDS, graph_steps, pack, unpack

CAP = 64 << 10  # staging bytes per lane: [17, 12, 128] bf16 + lse fits, [40, 8, 128] does not
SEED = random.randrange(1 << 30)
NAN, NEG_INF = float("nan"), float("-inf")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    T: int
    H: int
    D: int
    dtype: torch.dtype
    scatter: bool = False
    base: str = "e"
    head_major: bool = False  # o as [H, T, D].transpose(0, 1), lse as [H, T].t()
    empty: str = "none"  # "none" | "one_shard" (rank 0) | "all_but_one" | "mixed" (random, some rows on every rank)
    lse_shift: float = 0.0  # 1e4: exp(lse) overflows fp32
    path: str = "kernel"  # "kernel" | "nccl" (algorithm="nccl") | "over_capacity" (eager NCCL)


CASES_2 = [
    Case("t1_h16_d128_bf16", 1, 16, 128, torch.bfloat16),
    Case("t3_h6_d64_fp16_scatter_base2_head_major", 3, 6, 64, torch.float16, True, "2", True),
    Case("t17_h12_d128_bf16_mixed_empty_lse1e4_head_major", 17, 12, 128, torch.bfloat16, head_major=True,
         empty="mixed", lse_shift=1e4),
    Case("t3_h10_d80_fp32_scatter_all_but_one_empty", 3, 10, 80, torch.float32, True, empty="all_but_one"),
    Case("t2_h4_d512_bf16_rank0_empty_base2", 2, 4, 512, torch.bfloat16, base="2", empty="one_shard"),
    Case("t3_h6_d64_bf16_scatter_mixed_nccl", 3, 6, 64, torch.bfloat16, True, empty="mixed", path="nccl"),
    Case("t40_h8_d128_bf16_over_capacity", 40, 8, 128, torch.bfloat16, empty="mixed", path="over_capacity"),
]
CASES_3 = [
    Case("t3_h6_d64_bf16_scatter_mixed", 3, 6, 64, torch.bfloat16, True, empty="mixed"),
    Case("t17_h5_d128_bf16_all_but_one_lse1e4", 17, 5, 128, torch.bfloat16, empty="all_but_one", lse_shift=1e4),
    Case("t1_h9_d128_fp16_scatter_base2_head_major", 1, 9, 128, torch.float16, True, "2", True),
]
# (T, Hs, D, dtype, head_major, path) of all_gather_heads
GATHERS = [(3, 3, 64, torch.bfloat16, False, "kernel"), (17, 5, 128, torch.float16, True, "kernel"),
           (2, 3, 80, torch.float32, False, "nccl")]


def make_inputs(case: Case, world_size: int, seed: int):
    """Every rank's (o [T, H, D], lse [T, H]); empty shards get lse = -inf and o = NaN."""
    g = torch.Generator().manual_seed(seed + sum(map(ord, case.id)))
    T, H, D = case.T, case.H, case.D
    os_, lses = [], []
    for r in range(world_size):
        o = torch.randn(H, T, D, generator=g).to(case.dtype)  # head-major storage
        lse = torch.randn(H, T, generator=g) * 4 + case.lse_shift
        if case.empty == "mixed":
            gone = torch.rand(H, T, generator=g) < 0.35
            gone[0, 0] = True  # one row empty on every rank: o = 0, lse = -inf
        elif case.empty == "all_but_one":
            gone = torch.full((H, T), r != world_size - 1)
        else:
            gone = torch.full((H, T), case.empty == "one_shard" and r == 0)
        lse[gone] = NEG_INF
        o[gone] = NAN
        if case.head_major:
            os_.append(o.transpose(0, 1))
            lses.append(lse.t())
        else:
            os_.append(o.transpose(0, 1).contiguous())
            lses.append(lse.t().contiguous())
    return os_, lses


def _run_case(comm, case, rank, W, seed):
    os_, lses = make_inputs(case, W, seed)
    Hs = case.H // W if case.scatter else case.H
    out = torch.full((case.T, Hs, case.D), NAN, dtype=case.dtype)
    lse_out = torch.full((case.T, Hs), NAN)
    algo = "nccl" if case.path == "nccl" else "auto"
    got = comm.dcp_merge(os_[rank], lses[rank], scatter_heads=case.scatter, lse_base=case.base, return_lse=True,
                         out=out, lse_out=lse_out, algorithm=algo)
    assert got[0] is out and got[1] is lse_out
    return pack(out), pack(lse_out)


def _run_gather(comm, spec, rank, W, seed):
    T, Hs, D, dtype, head_major, path = spec
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(Hs, T, D, generator=g).to(dtype).transpose(0, 1)
    x = x if head_major else x.contiguous()
    out = torch.full((T, W * Hs, D), NAN, dtype=dtype)
    comm.all_gather_heads(x, out, algorithm=path if path == "nccl" else "auto")
    return pack(x), pack(out)


def _torch_ops(comm, rank, W, seed):
    """torch.ops.sparkinfer.dcp_merge / all_gather_heads eagerly and under torch.compile
    give the bits of the direct calls."""
    from sparkinfer.comm.torch_ops import register_ops

    register_ops()
    case = Case("ops", 3, 2 * W, 64, torch.bfloat16, empty="mixed")
    os_, lses = make_inputs(case, W, seed)
    o, lse = os_[rank], lses[rank]
    want = (*comm.dcp_merge(o, lse, scatter_heads=True, return_lse=True), comm.all_gather_heads(o))

    def block(o, lse):
        out, lse_out = torch.ops.sparkinfer.dcp_merge(o, lse, comm.id, True, "e")
        return out, lse_out, torch.ops.sparkinfer.all_gather_heads(o, comm.id)

    same = lambda got: all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))  # noqa: E731
    checks = {"eager": same(block(o, lse))}
    if W == 2:  # compiling is slow on CPU ranks: once is enough
        checks["compiled"] = same(torch.compile(block, backend="aot_eager", fullgraph=True)(o, lse))
    return checks


def _worker(world, seed):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=5)
    W, rank = world.world_size, world.rank
    cases = CASES_2 if W == 2 else CASES_3
    merged = {c.id: _run_case(comm, c, rank, W, seed) for c in cases}
    gathered = [_run_gather(comm, spec, rank, W, seed) for spec in GATHERS]
    merged["torch_ops"] = _torch_ops(comm, rank, W, seed)
    o, lse = torch.zeros(2, W + 1, 64), torch.zeros(2, W + 1)
    with pytest.raises(ShapeError, match=f"splits H = {W + 1} heads over {W} ranks"):
        comm.dcp_merge(o, lse, scatter_heads=True)
    # Different head counts at the same sequence number are detected, not mixed.
    o, lse = torch.zeros(1, 2 + 2 * rank, 64), torch.zeros(1, 2 + 2 * rank)
    with pytest.raises(CollectiveMismatch, match="called a different collective or size"):
        comm.dcp_merge(o, lse)
    comm.close()
    return merged, gathered


@pytest.fixture(scope="module")
def ranks():
    return {w: run_ranks(_worker, w, backend="cpu", args=(SEED,), timeout_s=300) for w in (2, 3)}


TOL_ULPS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 16}


def assert_close_ulps(actual, ref, what: str):
    """|a - r| <= k * eps * (|r| + 0.05): the interpreter truncates fp32 -> bf16/fp16
    where the GPU and the reference round; exp/log differ in the last fp32 bits."""
    k, eps = TOL_ULPS[ref.dtype], torch.finfo(ref.dtype).eps
    a, r = actual.float(), ref.float()
    bad = ((a - r).abs() > k * eps * (r.abs() + 0.05)) | ~torch.isfinite(a)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} off by more than {k} ulp (seed {SEED}); "
        f"first at {bad.nonzero()[0].tolist()}: {a[bad][0].item()} vs {r[bad][0].item()}"
    )


def assert_lse_close(actual, ref, what: str):
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(actual), inf) and (actual[inf] < 0).all(), f"{what}: -inf rows differ (seed {SEED})"
    a, r = actual[~inf], ref[~inf]
    assert torch.isfinite(a).all() and ((a - r).abs() <= 1e-6 * r.abs() + 1e-5).all(), f"{what} (seed {SEED})"


@pytest.mark.parametrize(
    "world,case", [(2, c) for c in CASES_2] + [(3, c) for c in CASES_3], ids=lambda v: v if isinstance(v, int) else v.id
)
def test_merge_matches_fp32_reference(ranks, world, case):
    os_, lses = make_inputs(case, world, SEED)
    ref_o, ref_lse = dcp_merge_reference(os_, lses, case.base)
    assert torch.isfinite(ref_o.float()).all()
    Hs = case.H // world if case.scatter else case.H
    outs = [tuple(map(unpack, merged[case.id])) for merged, _ in ranks[world]]
    for rank, (o, lse) in enumerate(outs):
        heads = slice(rank * Hs, (rank + 1) * Hs) if case.scatter else slice(None)
        assert_close_ulps(o, ref_o[:, heads], f"rank {rank} o")
        assert_lse_close(lse, ref_lse[:, heads], f"rank {rank} lse")
        if case.empty == "all_but_one":  # one live shard: its o passes through bitwise, its lse exactly
            assert torch.equal(o.view(torch.uint8), os_[-1][:, heads].contiguous().view(torch.uint8))
            assert torch.equal(lse, lses[-1][:, heads])
        if case.empty == "mixed":  # a row empty on every rank: o = 0, lse = -inf
            head0 = 0 if not case.scatter or rank == 0 else None
            if head0 is not None:
                assert (o[0, head0] == 0).all() and lse[0, head0] == NEG_INF
    if not case.scatter:
        for rank, (o, lse) in enumerate(outs[1:], 1):
            assert torch.equal(o.view(torch.uint8), outs[0][0].view(torch.uint8)), f"rank {rank} o differs from rank 0"
            assert torch.equal(lse.view(torch.uint8), outs[0][1].view(torch.uint8)), f"rank {rank} lse differs"


@pytest.mark.parametrize("world", [2, 3])
def test_torch_ops_eager_and_compiled_match_the_direct_calls(ranks, world):
    for rank, (merged, _) in enumerate(ranks[world]):
        assert all(merged["torch_ops"].values()), f"rank {rank}: {merged['torch_ops']}"


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_heads_is_bitwise(ranks, world):
    for i, spec in enumerate(GATHERS):
        xs = [unpack(gathered[i][0]) for _, gathered in ranks[world]]
        expect = torch.cat(xs, dim=1).view(torch.uint8)
        for rank, (_, gathered) in enumerate(ranks[world]):
            assert torch.equal(unpack(gathered[i][1]).view(torch.uint8), expect), f"gather {spec} on rank {rank}"


# ---------------------------------------------------------------- eager -> capture -> replay -> new inputs -> replay

GRAPH_CASES = [  # three ops in one graph (an odd count)
    Case("g_t3_h6_d64_mixed", 3, 6, 64, torch.bfloat16, empty="mixed"),
    Case("g_t2_h4_d128_scatter_head_major", 2, 4, 128, torch.bfloat16, True, head_major=True, empty="one_shard"),
]


def _graph_worker(world, seed):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=10, channel_ids=("g",))
    W, rank, dev = world.world_size, world.rank, comm.device
    bufs = []
    for c in GRAPH_CASES:
        os_, lses = make_inputs(c, W, seed)
        o = torch.empty_strided(os_[rank].shape, os_[rank].stride(), dtype=c.dtype, device=dev)
        lse = torch.empty_strided(lses[rank].shape, lses[rank].stride(), dtype=torch.float32, device=dev)
        hs = c.H // W if c.scatter else c.H
        bufs.append((c, o, lse, torch.empty(c.T, hs, c.D, dtype=c.dtype, device=dev), torch.empty(c.T, hs, device=dev)))
    gathered = torch.empty(3, W * 4, 64, dtype=torch.bfloat16, device=dev)

    def load(s):
        for c, o, lse, out, lse_out in bufs:
            os_, lses = make_inputs(c, W, s)
            o.copy_(os_[rank])
            lse.copy_(lses[rank])
            out.fill_(NAN)
            lse_out.fill_(NAN)
        gathered.fill_(NAN)

    def run():
        for c, o, lse, out, lse_out in bufs:
            comm.dcp_merge(o, lse, scatter_heads=c.scatter, lse_base=c.base, out=out, lse_out=lse_out)
        comm.all_gather_heads(bufs[0][1][:, :4], gathered)

    def results():
        return [(pack(out.cpu()), pack(lse_out.cpu())) for _, _, _, out, lse_out in bufs] + [pack(gathered.cpu())]

    steps = graph_steps(comm, run, load, results, seed)
    comm.close()
    return steps


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_eager_capture_replay_new_inputs_replay(backend):
    steps = run_ranks(_graph_worker, 2, backend=backend, args=(SEED,), timeout_s=300)
    for rank, st in enumerate(steps):
        for a, b in zip(st["eager"][:-1], st["replay"][:-1]):
            assert all(torch.equal(unpack(x).view(torch.uint8), unpack(y).view(torch.uint8)) for x, y in zip(a, b))
        assert torch.equal(unpack(st["eager"][-1]).view(torch.uint8), unpack(st["replay"][-1]).view(torch.uint8))
        for i, c in enumerate(GRAPH_CASES):
            for seed, key in ((SEED, "eager"), (SEED + 1, "replay_new_inputs")):
                os_, lses = make_inputs(c, 2, seed)
                ref_o, ref_lse = dcp_merge_reference(os_, lses, c.base)
                heads = slice(rank * c.H // 2, (rank + 1) * c.H // 2) if c.scatter else slice(None)
                o, lse = map(unpack, st[key][i])
                assert_close_ulps(o, ref_o[:, heads], f"rank {rank} {c.id} {key} o")
                assert_lse_close(lse, ref_lse[:, heads], f"rank {rank} {c.id} {key} lse")
        os_, _ = make_inputs(GRAPH_CASES[0], 2, SEED + 1)
        want = torch.cat([x[:, :4] for x in os_], dim=1)
        assert torch.equal(unpack(st["replay_new_inputs"][-1]).view(torch.uint8), want.view(torch.uint8))


# ---------------------------------------------------------------- one rank, in process


@pytest.fixture(scope="module")
def comm1():
    from sparkinfer.comm import Communicator

    comm = Communicator(LocalGroup(), device="cpu", capacity_bytes=16 << 10, timeout_s=5, channel_ids=("g",))
    yield comm
    comm.close()


def test_single_rank_merge_passes_live_rows_and_zeroes_empty_ones(comm1):
    o = torch.randn(3, 5, 64).to(torch.bfloat16)
    lse = torch.randn(3, 5)
    lse[1, 2] = NEG_INF
    o[1, 2] = NAN
    out, lse_out = comm1.dcp_merge(o, lse, return_lse=True)
    live = torch.ones(3, 5, dtype=torch.bool)
    live[1, 2] = False
    assert torch.equal(out[live], o[live]) and torch.equal(lse_out[live], lse[live])
    assert (out[1, 2] == 0).all() and lse_out[1, 2] == NEG_INF
    assert comm1.dcp_merge(o[:0], lse[:0]).shape == (0, 5, 64)


def _merge_args(T=2, H=4, D=64):
    return dict(out_partial=torch.randn(T, H, D).to(torch.bfloat16), lse=torch.randn(T, H))


def _call(comm, a):
    a = dict(a)
    return comm.dcp_merge(a.pop("out_partial"), a.pop("lse"), **a)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(out_partial=torch.zeros(2, 64)), ShapeError, r"out_partial must be \[T, H, D\]; got shape \(2, 64\)"),
        (dict(out_partial=torch.zeros(2, 4, 128)[..., ::2]), LayoutError,
         r"strides \(512, 128, 2\): the head dim D must be contiguous"),
        (dict(out_partial=torch.zeros(2, 4, 64, dtype=torch.int32)), DTypeError, "out_partial has dtype torch.int32"),
        (dict(out_partial=torch.zeros(2, 4, 64, device="meta")), DeviceError, "out_partial is on meta"),
        (dict(lse=torch.zeros(2, 4, dtype=torch.bfloat16)), DTypeError,
         "lse has dtype torch.bfloat16; supported: float32"),
        (dict(lse=torch.zeros(4, 2)), ShapeError, r"lse must be \[T, H\] = \(2, 4\).*\(4, 2\)"),
        (dict(lse_base="10"), PlanError, "lse_base must be 'e' .* got '10'"),
        (dict(out=torch.zeros(2, 4, 32, dtype=torch.bfloat16)), ShapeError, r"out must have shape \(2, 4, 64\)"),
        (dict(out=torch.zeros(4, 2, 64, dtype=torch.bfloat16).transpose(0, 1)), LayoutError, "not contiguous"),
        (dict(out=torch.zeros(2, 4, 64)), DTypeError, "out has dtype torch.float32; supported: bfloat16"),
        (dict(lse_out=torch.zeros(2, 4, dtype=torch.float16)), DTypeError, "lse_out has dtype torch.float16"),
        (dict(algorithm="ring"), PlanError, "dcp_merge: algorithm must be one of .* got 'ring'"),
        (dict(out_partial=torch.zeros(40, 4, 64), lse=torch.zeros(40, 4), algorithm="kernel"), CapacityError,
         r"dcp_merge stages 41600 B but the staging capacity is 16384 B \(algorithm='kernel'\)"),
    ],
    ids=["o_2d", "d_strided", "o_int", "o_meta", "lse_bf16", "lse_shape", "lse_base", "out_shape", "out_strided",
         "out_dtype", "lse_out_dtype", "algorithm", "kernel_over_capacity"],
)
def test_merge_rejects(comm1, change, error, match):
    a = _merge_args()
    a.update(change)
    with pytest.raises(error, match=match):
        _call(comm1, a)


@pytest.mark.parametrize(
    "x,out,error,match",
    [
        (torch.zeros(2, 64), None, ShapeError, r"x must be \[T, H, D\]"),
        (torch.zeros(2, 3, 128)[..., ::2], None, LayoutError, "the head dim D must be contiguous"),
        (torch.zeros(2, 3, 64), torch.zeros(2, 4, 64), ShapeError,
         r"out must have shape \(2, 3, 64\), got \(2, 4, 64\)"),
    ],
    ids=["x_2d", "d_strided", "out_shape"],
)
def test_all_gather_heads_rejects(comm1, x, out, error, match):
    with pytest.raises(error, match=match):
        comm1.all_gather_heads(x, out)


@pytest.mark.parametrize("interpret", [False, True], ids=["h200", "interpreter"])
def test_row_config_tiles_are_powers_of_two_on_co_resident_blocks(interpret):
    caps = TopologyCaps(2, True, "host" if interpret else "nvlink", 132, 64 << 20, interpret=interpret)
    for n_rows in (1, 3, 8, 16, 100, 1024, 8192, 32768):
        for D, isz in ((64, 2), (80, 4), (128, 2), (512, 2)):
            c = row_config(caps, n_rows, D, isz)
            assert 1 <= c.grid <= (2 if interpret else 132) and c.grid <= -(-n_rows // c.rows), (n_rows, D, c)
            assert c.rows & (c.rows - 1) == 0 and c.block_d >= D and c.block_d & (c.block_d - 1) == 0
            assert c.rows * c.block_d <= 4096
            if not interpret and n_rows * D * isz >= 4096:
                assert c.grid >= 2, (n_rows, D, c)  # ~2 KiB per block: small merges still spread out


def test_capture_rejects_unwarmed_config_and_over_capacity(comm1):
    a = _merge_args(T=1, H=7, D=96)  # a configuration nothing else has compiled
    big = _merge_args(T=40, H=4, D=64)
    with comm1.pool.capture("sA", "g"):
        with comm1.streams.capture("sA"):
            with pytest.raises(CaptureError, match="would compile during graph capture"):
                _call(comm1, a)
            with pytest.raises(CapacityError, match="staging capacity is 16384 B"):
                _call(comm1, big)
        with comm1.streams.use("sA"):
            _call(comm1, a)  # warm-up inside the scope
        with comm1.streams.capture("sA"):
            out = _call(comm1, a)
    assert torch.equal(out, a["out_partial"])
