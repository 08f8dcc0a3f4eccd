"""Non-finite data into the comm ops on CPU ranks: NaN and +/-inf are carried as
data. Every all_reduce algorithm (ll, oneshot, twoshot, nccl, auto, and auto
above the staging capacity, which falls back to torch.distributed),
reduce_scatter and all_gather (kernel and fallback) and all_gather_heads give
the fp32 reference's NaN / +inf / -inf pattern (gathers: the exact bits, NaN
payloads included), and a replicated result has the same bits on every rank.
The fused norm and dcp_merge are in test_nonfinite_norm_dcp.py; a NaN lse in
dcp_merge is below.

All cases of both files run inside one launch (conftest.nonfinite_outcomes: the
interpreter is slow); the parametrized tests only read what the ranks returned."""

import pytest
import torch

from tests.faults._util import CAP, bits, nonfinite_problems, payload

W = 2  # the spots below are written for two ranks
N = 128  # elements: two-shot gives each rank one half, both halves get spots
INF = float("inf")
# NaNs with payloads and either sign, as raw bits: a gather must carry them unchanged
_NAN_BITS = {torch.float32: (0x7FC00123, -0x003FFF89), torch.bfloat16: (0x7FC3, -0x003B),
             torch.float16: (0x7E03, -0x01FB)}
_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def nan(dtype, k: int = 0) -> torch.Tensor:
    """A NaN of `dtype` with a payload (k = 1: negative sign)."""
    return torch.tensor([_NAN_BITS[dtype][k]], dtype=_INT_OF[dtype]).view(dtype)[0]


# index (mod N) -> value per rank; what the sum must be is the fp32 reference's business
SPOTS = {3: {0: "nan"}, 70: {1: "nan-"}, 10: {0: INF}, 80: {1: -INF}, 20: {0: INF, 1: -INF},
         90: {0: INF, 1: INF}, 100: {0: "nan", 1: INF}, 40: {0: 60000.0, 1: 60000.0}}  # 40: fp16 overflows


def spotted(rank: int, n: int, dtype, salt: int = 0) -> torch.Tensor:
    """payload(rank, n) with this rank's SPOTS at every index i + k * N < n."""
    x = payload(rank, n, dtype, salt)
    for i, vals in SPOTS.items():
        v = vals.get(rank)
        if v is None:
            continue
        t = nan(dtype, v == "nan-") if isinstance(v, str) else torch.tensor(v, dtype=dtype)
        x[i::N] = t
    return x


def _sum_ref(n, dtype):
    """fp32 rank-order sum of every rank's spotted vector, in dtype (what all_reduce_reference does)."""
    acc = torch.zeros(n)
    for q in range(W):
        acc += spotted(q, n, dtype).float()
    return acc.to(dtype)


def _heads(rank, dtype, T=2, Hs=2, D=32):
    return spotted(rank, T * Hs * D, dtype).view(T, Hs, D)


def _same_bits(name, got, want) -> list:
    return [] if bits(got) == bits(want) else [f"{name}: bits differ from the reference"]


def _all_reduce(algorithm, dtype, n=N):
    def run(comm, r):
        got = comm.all_reduce(spotted(r, n, dtype), algorithm=algorithm)
        return nonfinite_problems(got, _sum_ref(n, dtype)), [got]
    return run


def _reduce_scatter(dtype, n=W * N):
    def run(comm, r):
        got = comm.reduce_scatter(spotted(r, n, dtype))
        return nonfinite_problems(got, _sum_ref(n, dtype).chunk(W)[r]), []
    return run


def _all_gather(dtype, n=N):
    def run(comm, r):
        got = comm.all_gather(spotted(r, n, dtype))
        return _same_bits("all_gather", got, torch.cat([spotted(q, n, dtype) for q in range(W)])), [got]
    return run


def _all_gather_heads(dtype, algorithm="auto"):
    def run(comm, r):
        got = comm.all_gather_heads(_heads(r, dtype), algorithm=algorithm)
        return _same_bits("all_gather_heads", got, torch.cat([_heads(q, dtype) for q in range(W)], dim=1)), [got]
    return run


DCP_NAN = "dcp_merge-nan-lse-kernel-nccl-reference"  # a case added below, with a test of its own
OVER = CAP // 4 + 64  # fp32 elements above the staging capacity: algorithm="auto" takes torch.distributed
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CASES = {
    **{f"all_reduce-{a}-{d}": _all_reduce(a, dt) for a in ("ll", "oneshot", "twoshot", "nccl", "auto")
       for d, dt in DTYPES.items()},
    "all_reduce-auto-above-capacity-fp32": _all_reduce("auto", torch.float32, OVER),
    **{f"reduce_scatter-{d}": _reduce_scatter(dt) for d, dt in DTYPES.items()},
    "reduce_scatter-above-capacity-fp32": _reduce_scatter(torch.float32, W * OVER),
    **{f"all_gather-{d}": _all_gather(dt) for d, dt in DTYPES.items()},
    "all_gather-above-capacity-fp32": _all_gather(torch.float32, OVER),
    **{f"all_gather_heads-{d}": _all_gather_heads(dt) for d, dt in DTYPES.items()},
    "all_gather_heads-nccl-fp32": _all_gather_heads(torch.float32, "nccl"),
}


@pytest.mark.parametrize("case", [c for c in CASES if c != DCP_NAN])  # DCP_NAN: its own test below
def test_nonfinite_data_follows_the_reference_on_every_rank(nonfinite_outcomes, case):
    per_rank = [o[case] for o in nonfinite_outcomes]
    for r, (problems, _) in enumerate(per_rank):
        assert problems == [], (r, problems)
    assert per_rank[0][1] == per_rank[1][1], "a replicated result differs across ranks"


T, H, D = 3, 4, 32


def _inputs(rank: int, device="cpu"):
    g = torch.Generator().manual_seed(100 + rank)
    o = torch.randn(T, H, D, generator=g)
    lse = torch.randn(T, H, generator=g)
    if rank == 1:
        lse[1, 2] = float("nan")  # one row, one rank
        lse[2, 0] = float("-inf")  # an empty shard beside it stays ignored
    return o.to(device), lse.to(device)


def dcp_nan_problems(comm, rank: int, world_size: int, device) -> list:
    """The failures of dcp_merge with a NaN lse on one rank (kernel, NCCL composition and
    reference), on `comm` (CPU ranks here, cuda_shared in test_gpu_faults)."""
    from sparkinfer.comm.dcp.reference import dcp_merge_reference

    o, lse = _inputs(rank, device)
    ref_o, ref_l = dcp_merge_reference(*zip(*[_inputs(r, device) for r in range(world_size)]))
    bad = []
    for algo in ("kernel", "nccl"):
        got_o, got_l = (t.cpu() for t in comm.dcp_merge(o, lse, return_lse=True, algorithm=algo))
        if not (got_o[1, 2].isnan().all() and got_l[1, 2].isnan()):
            bad.append((algo, "NaN row not NaN"))
        if not (torch.allclose(got_o, ref_o, equal_nan=True, atol=1e-5)
                and torch.allclose(got_l, ref_l, equal_nan=True, atol=1e-5)):
            bad.append((algo, "differs from the reference"))
    if not (ref_o[1, 2].isnan().all() and ref_l[1, 2].isnan()):
        bad.append(("reference", "NaN row not NaN"))
    return bad


def dcp_nan(world):
    """dcp_nan_problems on a communicator of its own (test_gpu_faults runs it on a GPU)."""
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=60, device=world.device)
    bad = dcp_nan_problems(comm, world.rank, world.world_size, world.device)
    comm.close()
    return bad


CASES[DCP_NAN] = lambda comm, r: ([str(p) for p in dcp_nan_problems(comm, r, W, comm.context.device)], [])


def test_dcp_merge_nan_lse_propagates_in_kernel_nccl_and_reference(nonfinite_outcomes):
    assert [o[DCP_NAN][0] for o in nonfinite_outcomes] == [[], []]
