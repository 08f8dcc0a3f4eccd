"""Fused all-reduce + residual + RMSNorm on CPU ranks (Triton interpreter, shared
memory) against the fp32 reference: awkward shapes, both row paths (one tile,
two tiles), in place, bitwise equality across ranks, the NCCL composition, and
every rejection path.

All cases of one world size run inside one launch (the interpreter is slow);
the parametrized tests below only compare what the ranks returned.
"""

import dataclasses
import random

import pytest
import torch

from sparkinfer.comm.fused_norm.launch import (
    LL_SPLIT_MAX_BYTES,
    LL_SPLIT_ROW_BYTES,
    SPLIT_MAX_BYTES,
    check_config,
    norm_config,
)
from sparkinfer.comm.fused_norm.reference import all_reduce_add_rms_norm_reference
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
from tests.comm.graphs import GRAPH_BACKENDS, bits_diff, graph_steps, pack, unpack, worst_ulps

CAP = 256 << 10  # bytes of staging per lane: [17, 7168] bf16 fits, [20, 7168] does not
EPS = 1e-5
SEED = random.randrange(1 << 30)  # fresh inputs every session; printed on failure


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    shape: tuple  # x: [*, H]
    dtype: torch.dtype
    w_dtype: torch.dtype = None  # weight dtype (default: x's)
    inplace: bool = False  # out=x, residual_out=residual
    poison: bool = True  # pass NaN-filled outputs (else let the op allocate)
    path: str = "kernel"  # "kernel" | "nccl" (no peer access) | "over_capacity" (eager NCCL)
    algorithm: str = "auto"  # "auto" picks the LL kernel at these sizes; "fused" = flag-based kernel
    pieces: int = None  # force this many pieces per row (config=norm_config(..., pieces=)); None: the heuristic
    invariant: bool = True  # batch_invariant= (False: the heuristic may split rows that fit a tile)


# Interpreter configs (fused_norm.launch.norm_config): rows of < 8 KiB are one
# piece (H = 1024 bf16/fp16, H = 3072 bf16: the one-pass paths, whole rows per
# block); longer rows split into pieces (H = 7168 bf16: 3 pieces; H = 3072
# fp32: 3 pieces). `pieces` forces a shape through the config= argument.
CASES_2 = [
    Case("t1_h1024_bf16_ll", (1, 1024), torch.bfloat16),
    Case("t3_h7168_bf16_3_pieces", (3, 7168), torch.bfloat16, algorithm="fused"),
    Case("t3_h7168_bf16_3_pieces_ll", (3, 7168), torch.bfloat16),
    Case("t17_h1024_fp16_one_pass", (17, 1024), torch.float16, algorithm="fused"),
    Case("t17_h7168_bf16_at_capacity", (17, 7168), torch.bfloat16, algorithm="fused"),
    Case("t5_h3072_fp32_inplace_ll", (5, 3072), torch.float32, inplace=True),
    Case("t5_h3072_fp32_inplace", (5, 3072), torch.float32, inplace=True, algorithm="fused"),
    Case("b2x3_h1024_bf16_fp32_weight_alloc_ll", (2, 3, 1024), torch.bfloat16, torch.float32, poison=False),
    Case("t3_h1024_bf16_nccl_fallback", (3, 1024), torch.bfloat16, path="nccl"),
    Case("t3_h3072_bf16_ll_one_pass_masked_tile", (3, 3072), torch.bfloat16),  # 1536 words in a 2048-word tile
    Case("t2_h1024_fp32_bf16_weight_ll_one_pass", (2, 1024), torch.float32, torch.bfloat16),
    Case("t3_h1024_bf16_ll_2_pieces_forced", (3, 1024), torch.bfloat16, pieces=2),
    Case("t3_h7168_bf16_ll_1_piece_forced", (3, 7168), torch.bfloat16, pieces=1),  # S = 1, too wide for one pass
    Case("t20_h7168_bf16_over_capacity", (20, 7168), torch.bfloat16, path="over_capacity"),
]
CASES_3 = [
    Case("t1_h1024_bf16_ll", (1, 1024), torch.bfloat16),
    Case("t3_h7168_bf16_3_pieces_inplace", (3, 7168), torch.bfloat16, inplace=True, algorithm="fused"),
    Case("t17_h1024_fp16_ll", (17, 1024), torch.float16, algorithm="fused_ll"),
    Case("t2_h7168_fp16_ll_pieces_inplace", (2, 7168), torch.float16, inplace=True),  # LL split rows, 3 ranks
]


def make_inputs(case: Case, world_size: int, seed: int):
    """Every rank's x, the shared residual and weight: same bits on every process."""
    g = torch.Generator().manual_seed(seed + sum(map(ord, case.id)))
    xs = [torch.randn(case.shape, generator=g).to(case.dtype) for _ in range(world_size)]
    residual = (2 * torch.randn(case.shape, generator=g)).to(case.dtype)
    weight = (1 + 0.5 * torch.randn(case.shape[-1], generator=g)).to(case.w_dtype or case.dtype)
    return xs, residual, weight


def _run_case(comm, case, rank, world_size, seed):
    xs, residual, weight = make_inputs(case, world_size, seed)
    x = xs[rank]
    saved, kw = comm.context, dict(algorithm=case.algorithm)
    if case.pieces is not None:
        rows, H = x.numel() // x.shape[-1], x.shape[-1]
        kw["config"] = norm_config(comm.caps, rows, H, x.element_size(), ll=case.algorithm != "fused",
                                   pieces=case.pieces)
    if case.path == "nccl":
        comm.context = dataclasses.replace(saved, caps=dataclasses.replace(saved.caps, peer_access=False))
    try:
        if case.inplace:
            out, res_out = comm.all_reduce_add_rms_norm(x, residual, weight, EPS, out=x, residual_out=residual, **kw)
            assert out is x and res_out is residual
        elif case.poison:
            out = torch.full_like(x, float("nan"))
            res_out = torch.full_like(x, float("nan"))
            got = comm.all_reduce_add_rms_norm(x, residual, weight, EPS, out=out, residual_out=res_out, **kw)
            assert got[0] is out and got[1] is res_out
        else:
            out, res_out = comm.all_reduce_add_rms_norm(x, residual, weight, EPS, **kw)
    finally:
        comm.context = saved
    return out, res_out


def _torch_ops(comm, rank, W, seed):
    """torch.ops.sparkinfer.all_reduce_add_rms_norm(_) eagerly and under torch.compile
    give the bits of the direct call."""
    from sparkinfer.comm.torch_ops import register_ops

    register_ops()
    xs, residual, weight = make_inputs(Case("ops", (3, 1024), torch.bfloat16), W, seed)
    x = xs[rank]
    want = comm.all_reduce_add_rms_norm(x, residual, weight, EPS)

    def block(x, residual):
        out, res_out = torch.ops.sparkinfer.all_reduce_add_rms_norm(x, residual, weight, EPS, comm.id, "auto")
        return out * 1, res_out

    def block_(x, residual):
        x, residual = x.clone(), residual.clone()
        torch.ops.sparkinfer.all_reduce_add_rms_norm_(x, residual, weight, EPS, comm.id, "auto")
        return x, residual

    same = lambda got: all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))  # noqa: E731
    checks = {"eager": same(block(x, residual)), "in_place": same(block_(x, residual))}
    if W == 2:  # compiling is slow on CPU ranks: once is enough
        checks["compiled"] = same(torch.compile(block, backend="aot_eager", fullgraph=True)(x, residual))
        checks["compiled_in_place"] = same(torch.compile(block_, backend="aot_eager", fullgraph=True)(x, residual))
    return checks


def _ll_dirty_words(comm) -> int:
    """Nonzero bytes in this rank's LL region once every rank is done: LL words
    (the peers' rows and the split path's posted partial sums, which every
    block of a row reads) must all have been cleared."""
    import torch.distributed as dist

    dist.barrier()
    ch = comm.pool.get("eager")
    lay = ch.layout
    dirty = int(ch.slab.keep[1][lay.ll_off:lay.ll_off + 2 * lay.ll_slot_bytes].count_nonzero())
    dist.barrier()
    return dirty


INVARIANT_ROWS = (1, 3, 9)  # rows beside and including the probe


def _invariance_inputs(W, seed):
    g = torch.Generator().manual_seed(seed + 7)
    n = max(INVARIANT_ROWS)
    xs = [torch.randn(n, 3072, generator=g).bfloat16() for _ in range(W)]
    return xs, (2 * torch.randn(n, 3072, generator=g)).bfloat16(), (1 + 0.5 * torch.randn(3072, generator=g)).bfloat16()


def _invariance(comm, rank, W, seed):
    """The last row of [T, 3072] bf16 at each T of INVARIANT_ROWS, over the LL kernel
    ("auto" at these sizes) and the flag kernel ("fused"): (out, residual_out) packed.
    Batch-invariant calls keep whole rows, whose exact sum of squares is the same
    bits over either kernel's tile (norm.kernel.sum_squares)."""
    xs, residual, weight = _invariance_inputs(W, seed)
    n = max(INVARIANT_ROWS)
    got = {}
    for t in INVARIANT_ROWS:
        for algorithm in ("auto", "fused"):
            out, res_out = comm.all_reduce_add_rms_norm(xs[rank][n - t:], residual[n - t:], weight, EPS,
                                                        algorithm=algorithm)
            got[f"{algorithm}-t{t}"] = (pack(out[-1]), pack(res_out[-1]))
    return got


def _worker(world, cases, seed):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=5)
    W, rank = world.world_size, world.rank
    results = {c.id: tuple(map(pack, _run_case(comm, c, rank, W, seed))) for c in cases}
    if W == 2:
        results["invariance"] = _invariance(comm, rank, W, seed)
    results["ll_dirty_words"] = _ll_dirty_words(comm)
    results["torch_ops"] = _torch_ops(comm, rank, W, seed)
    # Different hidden sizes at the same sequence number are detected, not mixed.
    x = torch.zeros(2, 1024 * (rank + 1), dtype=torch.bfloat16)
    w = torch.ones(x.shape[-1], dtype=torch.bfloat16)
    with pytest.raises(CollectiveMismatch, match="called a different collective or size"):
        comm.all_reduce_add_rms_norm(x, x.clone(), w, EPS)
    comm.close()
    return results


@pytest.fixture(scope="module")
def ranks():
    return {
        2: run_ranks(_worker, 2, backend="cpu", args=(CASES_2, SEED), timeout_s=300),
        3: run_ranks(_worker, 3, backend="cpu", args=(CASES_3, SEED), timeout_s=300),
    }


def assert_close_ulps(actual, ref, ulps: int, what: str):
    """|actual - ref| <= ulps * eps(dtype) * |ref| (+ a tiny floor): the interpreter
    truncates fp32 -> bf16 where the GPU and the reference round."""
    eps = torch.finfo(ref.dtype).eps
    a, r = actual.float(), ref.float()
    tol = ulps * eps * r.abs() + ulps * eps * 1e-3
    bad = ((a - r).abs() > tol) | ~torch.isfinite(a)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off by more than {ulps} ulp (seed {SEED}); "
        f"first at {bad.nonzero()[0].tolist()}: {a[bad][0].item()} vs {r[bad][0].item()}"
    )


@pytest.mark.parametrize(
    "world,case", [(2, c) for c in CASES_2] + [(3, c) for c in CASES_3], ids=lambda v: v if isinstance(v, int) else v.id
)
def test_matches_fp32_reference_and_ranks_agree_bitwise(ranks, world, case):
    per_rank = [tuple(map(unpack, res[case.id])) for res in ranks[world]]
    xs, residual, weight = make_inputs(case, world, SEED)
    if case.path != "kernel":  # the NCCL composition rounds the sum to x's dtype before the residual add
        xs = [sum(x.float() for x in xs).to(case.dtype)]
    ref_out, ref_res = all_reduce_add_rms_norm_reference(xs, residual, weight, EPS)
    for rank, (out, res_out) in enumerate(per_rank):
        assert out.shape == ref_out.shape and out.dtype == case.dtype
        assert_close_ulps(res_out, ref_res, 2, f"rank {rank} residual_out")
        assert_close_ulps(out, ref_out, 4, f"rank {rank} out")
    out0, res0 = per_rank[0]
    for rank, (out, res_out) in enumerate(per_rank[1:], 1):
        assert torch.equal(out.view(torch.uint8), out0.view(torch.uint8)), f"out of rank {rank} differs from rank 0"
        assert torch.equal(res_out.view(torch.uint8), res0.view(torch.uint8)), f"residual_out of rank {rank} differs"


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_nor_on_the_kernel(ranks):
    """2 ranks: the probe row alone and beside 2 and 8 others, over the LL and the flag
    kernel (the byte size picks one or the other on a GPU): one set of bits, on
    both ranks, within the fp32 reference's tolerance."""
    xs, residual, weight = _invariance_inputs(2, SEED)
    ref_out, ref_res = all_reduce_add_rms_norm_reference([x[-1:] for x in xs], residual[-1:], weight, EPS)
    want = tuple(map(unpack, ranks[2][0]["invariance"]["auto-t1"]))
    assert_close_ulps(want[0], ref_out[0], 4, "probe out")
    assert_close_ulps(want[1], ref_res[0], 2, "probe residual_out")
    for rank, res in enumerate(ranks[2]):
        for k, v in res["invariance"].items():
            out, res_out = map(unpack, v)
            assert torch.equal(out.view(torch.int16), want[0].view(torch.int16)), f"rank {rank}: {k} out differs"
            assert torch.equal(res_out.view(torch.int16), want[1].view(torch.int16)), f"rank {rank}: {k} residual"


@pytest.mark.parametrize("world", [2, 3])
def test_ll_region_is_clean_after_every_case(ranks, world):
    assert [res["ll_dirty_words"] for res in ranks[world]] == [0] * world


@pytest.mark.parametrize("world", [2, 3])
def test_torch_ops_eager_and_compiled_match_the_direct_call(ranks, world):
    for rank, res in enumerate(ranks[world]):
        assert all(res["torch_ops"].values()), f"rank {rank}: {res['torch_ops']}"


# ---------------------------------------------------------------- eager -> capture -> replay -> new inputs -> replay


GRAPH_CASES = [  # seven ops in one graph (an odd count): LL (rows split on the GPU), flag with pieces, flag in place
    Case("g_t1_h7168_ll", (1, 7168), torch.bfloat16, invariant=False),
    Case("g_t2_h4096_fp16_ll", (2, 4096), torch.float16, invariant=False),  # GPU: 8 one-piece blocks per row
    Case("g_t1_h2048_fp32_ll", (1, 2048), torch.float32, invariant=False),  # GPU: 8 one-piece blocks, a value a word
    Case("g_t8_h4096_ll_inplace", (8, 4096), torch.bfloat16, inplace=True, invariant=False),
    Case("g_t3_h7168_ll", (3, 7168), torch.bfloat16, invariant=False),
    Case("g_t3_h7168_flag", (3, 7168), torch.bfloat16, algorithm="fused"),
    Case("g_t2_h1024_flag_inplace", (2, 1024), torch.bfloat16, inplace=True, algorithm="fused"),
]


def graph_ops(comm, world):
    """Fixed buffers for GRAPH_CASES on this rank: (bufs, load(seed), run()).
    load writes fresh inputs in place (poisoning out-of-place outputs); run
    launches the seven ops. Shared with tests/comm/stress_fused_graph.py."""
    W, rank, dev = world.world_size, world.rank, comm.device
    bufs = []
    for c in GRAPH_CASES:
        x = torch.empty(c.shape, dtype=c.dtype, device=dev)
        res, w = torch.empty_like(x), torch.empty(c.shape[-1], dtype=c.dtype, device=dev)
        o, r = (x, res) if c.inplace else (torch.empty_like(x), torch.empty_like(x))
        bufs.append((c, x, res, w, o, r))

    def load(s):
        for c, x, res, w, o, r in bufs:
            xs, residual, weight = make_inputs(c, W, s)
            x.copy_(xs[rank])
            res.copy_(residual)
            w.copy_(weight)
            if not c.inplace:
                o.fill_(float("nan"))
                r.fill_(float("nan"))

    def run():
        for c, x, res, w, o, r in bufs:
            comm.all_reduce_add_rms_norm(x, res, w, EPS, out=o, residual_out=r, algorithm=c.algorithm,
                                         batch_invariant=c.invariant)

    return bufs, load, run


def _graph_worker(world, seed):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=10, channel_ids=("g",))
    bufs, load, run = graph_ops(comm, world)

    def results():
        return [(pack(o.cpu()), pack(r.cpu())) for c, x, res, w, o, r in bufs]

    steps = graph_steps(comm, run, load, results, seed)
    comm.close()
    return steps


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_eager_capture_replay_new_inputs_replay(backend):
    steps = run_ranks(_graph_worker, 2, backend=backend, args=(SEED,), timeout_s=300)
    for rank, st in enumerate(steps):
        for i, c in enumerate(GRAPH_CASES):
            eager, replay = [tuple(map(unpack, st[k][i])) for k in ("eager", "replay")]
            diff = [d for a, b, n in zip(eager, replay, ("out", "residual_out")) if (d := bits_diff(a, b, n))]
            assert not diff, f"rank {rank} {c.id}: replay differs from eager (seed {SEED}): {diff}; " + "; ".join(
                f"{k} {n} {worst_ulps(unpack(st[k][i][j]), ref)}" for k in ("eager", "replay")
                for j, (n, ref) in enumerate(zip(("out", "res"), all_reduce_add_rms_norm_reference(
                    *make_inputs(c, 2, SEED), EPS))))
            for seed, key in ((SEED, "eager"), (SEED + 1, "replay_new_inputs")):
                out, res_out = map(unpack, st[key][i])
                ref_out, ref_res = all_reduce_add_rms_norm_reference(*make_inputs(c, 2, seed), EPS)
                assert_close_ulps(res_out, ref_res, 2, f"rank {rank} {c.id} {key} residual_out")
                assert_close_ulps(out, ref_out, 4, f"rank {rank} {c.id} {key} out")
        assert all(torch.equal(unpack(a[0]).view(torch.uint8), unpack(b[0]).view(torch.uint8))
                   for a, b in zip(st["replay_new_inputs"], steps[0]["replay_new_inputs"])), f"rank {rank} differs"


# ---------------------------------------------------------------- rejections (one rank, in process)


@pytest.fixture(scope="module")
def comm1():
    from sparkinfer.comm import Communicator

    comm = Communicator(LocalGroup(), device="cpu", capacity_bytes=16 << 10, timeout_s=5, channel_ids=("g",))
    yield comm
    comm.close()


def _args(shape=(2, 1024), dtype=torch.bfloat16):
    x = torch.randn(shape).to(dtype)
    return x, torch.randn(shape).to(dtype), torch.ones(shape[-1], dtype=dtype)


def test_single_rank_is_residual_plus_norm(comm1):
    x, res, w = _args((3, 1024))
    out, res_out = comm1.all_reduce_add_rms_norm(x, res, w, EPS)
    ref_out, ref_res = all_reduce_add_rms_norm_reference([x], res, w, EPS)
    assert_close_ulps(res_out, ref_res, 2, "residual_out")
    assert_close_ulps(out, ref_out, 4, "out")


def test_empty_rows_return_outputs_untouched(comm1):
    x, res, w = _args((0, 1024))
    out, res_out = comm1.all_reduce_add_rms_norm(x, res, w, EPS)
    assert out.shape == res_out.shape == (0, 1024)


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda a: a.update(x=a["x"].int()), DTypeError, r"x has dtype torch.int32"),
        (lambda a: a.update(x=torch.tensor(1.0), residual=torch.tensor(1.0)), ShapeError, "0-dimensional"),
        (lambda a: a.update(x=a["x"].to("meta")), DeviceError, "x is on meta"),
        (lambda a: a.update(x=a["x"].t().contiguous().t()), LayoutError, r"strides \(1, 2\) is not contiguous"),
        (lambda a: a.update(residual=a["residual"][:1]), ShapeError, r"residual must match x's shape \(2, 1024\)"),
        (lambda a: a.update(residual=a["residual"].half()), DTypeError,
         r"residual has dtype torch.float16 but x has torch.bfloat16; cast it"),
        (lambda a: a.update(weight=a["weight"][:512]), ShapeError, r"weight must have shape \(1024,\).*\(512,\)"),
        (lambda a: a.update(out=torch.empty(2, 1024)), DTypeError, r"out has dtype torch.float32 but x has"),
        (lambda a: a.update(residual_out=torch.empty(2, 1000, dtype=torch.bfloat16)), ShapeError,
         "residual_out must match"),
        (lambda a: a.update(residual_out=a["out"]), LayoutError, "same memory"),
        (lambda a: a.update(eps=-1.0), DTypeError, "eps must be a non-negative Python float, got -1.0"),
        (lambda a: a.update(eps=None), DTypeError, "got None"),
    ],
    ids=["int_dtype", "zero_dim", "wrong_device", "not_contiguous", "residual_shape", "residual_dtype",
         "weight_shape", "out_dtype", "residual_out_shape", "out_is_residual_out", "negative_eps", "eps_none"],
)
def test_rejects(comm1, mutate, error, match):
    x, res, w = _args()
    a = dict(x=x, residual=res, weight=w, eps=EPS, out=torch.empty_like(x), residual_out=None)
    mutate(a)
    with pytest.raises(error, match=match):
        comm1.all_reduce_add_rms_norm(a["x"], a["residual"], a["weight"], a["eps"], out=a["out"],
                                      residual_out=a["residual_out"])


def test_rejects_rows_not_16_byte_aligned_and_bad_algorithms(comm1):
    x, res, w = _args((2, 1028))  # 2056 B rows
    with pytest.raises(ShapeError,
                       match="hidden size 1028 x 2 B is not a multiple of 16 bytes; pad H to a multiple of 8"):
        comm1.all_reduce_add_rms_norm(x, res, w, EPS)
    x, res, w = _args((2, 1024))
    with pytest.raises(PlanError,
                       match=r"algorithm must be one of \('auto', 'fused', 'fused_ll', 'nccl'\), got 'ring'"):
        comm1.all_reduce_add_rms_norm(x, res, w, EPS, algorithm="ring")
    big = _args((5, 2048))  # 20 KB > 16 KB capacity
    with pytest.raises(CapacityError,
                       match=r"stages 20480 B but the staging capacity is 16384 B \(algorithm='fused'\)"):
        comm1.all_reduce_add_rms_norm(*big, EPS, algorithm="fused")


def _ll_splits(T, row_bytes):
    return (T == 1 or row_bytes >= LL_SPLIT_ROW_BYTES) and T * row_bytes < LL_SPLIT_MAX_BYTES


@pytest.mark.parametrize("invariant", [False, True], ids=["heuristic", "batch-invariant"])
@pytest.mark.parametrize("interpret", [False, True], ids=["h200", "interpreter"])
def test_norm_config_covers_every_piece_once_on_co_resident_blocks(interpret, invariant):
    """Every config covers its rows on co-resident blocks; the heuristic splits rows
    over blocks where it measured faster, batch-invariant configs keep every row that
    fits a tile (16 KiB of LL words) whole at every T."""
    caps = TopologyCaps(2, True, "host" if interpret else "nvlink", 132, 64 << 20, interpret=interpret)
    for T in (1, 2, 3, 5, 8, 17, 64, 100, 133, 256, 1000):
        for H, isz in ((1024, 2), (2048, 2), (4096, 2), (5120, 2), (7168, 2), (8192, 2), (16384, 2), (3072, 4)):
            for ll in (False, True):
                c = norm_config(caps, T, H, isz, ll=ll, batch_invariant=invariant)
                check_config(c, caps, rows=T, hidden=H, itemsize=isz)
                pieces = T * c.pieces
                assert 1 <= c.grid <= (2 if interpret else 132), (T, H, c)
                assert (c.grid - 1) * c.per < pieces <= c.grid * c.per, (T, H, c)  # no empty block, none left out
                assert c.chunk % 64 == 0 and (c.pieces - 1) * c.chunk < H <= c.pieces * c.chunk, (T, H, c)
                assert c.block_c & (c.block_c - 1) == 0 and c.block_h & (c.block_h - 1) == 0
                assert c.one_pass == (c.pieces == 1 and H <= c.block_h and (not ll or H * isz <= 16 << 10)), (T, H, c)
                if c.one_pass:
                    assert c.block_w * 4 >= H * isz, (T, H, c)  # the LL kernel's tile holds the row
                if invariant and H <= (4096 if interpret else 8192) and (not ll or H * isz <= 16 << 10):
                    assert c.one_pass, (T, H, c)
                elif interpret:  # blocks run one after another there: a row never spans two blocks
                    assert c.per % c.pieces == 0, (T, H, c)
                elif H <= 8192 and (not _ll_splits(T, H * isz) if ll else T * H * isz >= SPLIT_MAX_BYTES):
                    assert c.pieces == 1 and (T > 132 or c.grid == T), (T, H, c)
                elif T * H * isz <= 132 * 2048:
                    assert c.grid >= min(132, T * H * isz // 2048 // 2), (T, H, c)  # split rows spread out
    for pieces in (1, 2, 3, 7):  # forced shapes are covers too
        c = norm_config(caps, 5, 7168, 2, pieces=pieces)
        check_config(c, caps, rows=5, hidden=7168, itemsize=2)
        assert c.pieces == pieces


def test_rejects_configs_that_do_not_cover_x(comm1):
    x, res, w = _args((2, 1024))
    with pytest.raises(PlanError, match="config must be a fused_norm.launch.NormConfig .* got tuple"):
        comm1.all_reduce_add_rms_norm(x, res, w, EPS, config=(1, 2))
    for wrong in (norm_config(comm1.caps, 2, 2048, 2), norm_config(comm1.caps, 3, 1024, 2)):  # other H, other T
        with pytest.raises(PlanError, match=r"does not cover x: \[2, 1024\] on <= 2 co-resident blocks"):
            comm1.all_reduce_add_rms_norm(x, res, w, EPS, config=wrong)
    narrow = dataclasses.replace(norm_config(comm1.caps, 2, 1024, 2), block_w=64)  # one pass, tile < row
    with pytest.raises(PlanError, match="does not cover x"):
        comm1.all_reduce_add_rms_norm(x, res, w, EPS, config=narrow)


def test_capture_rejects_unwarmed_config_and_over_capacity(comm1):
    x, res, w = _args((1, 1536))  # a size no other test has run (nothing compiled for it)
    big = _args((5, 2048))  # 20 KB > 16 KB capacity
    with comm1.pool.capture("sA", "g"):
        with comm1.streams.capture("sA"):
            with pytest.raises(CaptureError, match="would compile during graph capture"):
                comm1.all_reduce_add_rms_norm(x, res, w, EPS)
            with pytest.raises(CapacityError, match=r"staging capacity is 16384 B \(during graph capture\)"):
                comm1.all_reduce_add_rms_norm(*big, EPS)
        with comm1.streams.use("sA"):
            comm1.all_reduce_add_rms_norm(x, res, w, EPS)  # warm-up inside the scope
        with comm1.streams.capture("sA"):
            out, _ = comm1.all_reduce_add_rms_norm(x, res, w, EPS)  # now legal
    assert torch.isfinite(out.float()).all()
