"""Non-finite data into the fused all-reduce + RMSNorm and into dcp_merge on CPU
ranks (the plain collectives are in test_nonfinite.py).

Fused norm, every algorithm (fused, fused_ll, nccl, auto, auto above the
staging capacity): NaN or inf in one rank's x, NaN in the residual, NaN or inf
in the weight give the fp32 reference's NaN / +inf / -inf pattern in out and
residual_out, with the same bits on every rank.

dcp_merge (kernel, kernel scattering heads, NCCL composition): NaN or inf in a
shard's o whose lse is finite reaches the output even where that shard's weight
underflows to 0 (0 * NaN is NaN, as in attention over the whole sequence); an
empty shard (lse -inf) is ignored, NaN o and all; a +inf lse makes the row's o
NaN and its lse +inf (softmax with a +inf score is NaN, its logsumexp +inf),
a NaN lse makes both NaN. Kernel, NCCL composition and reference agree."""

import pytest
import torch

from tests.faults._util import CAP, nonfinite_problems, payload

W = 2
INF, NAN = float("inf"), float("nan")
ROWS, HID = 5, 64  # fused norm x: [ROWS, HID]
EPS = 1e-6
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the largest finite element


def norm_inputs(rank: int, dtype, where: str, rows: int = ROWS):
    """(x of `rank`, residual, weight), the same on every process. where: "x" puts
    the non-finite values in x and the residual (one row each), "weight" in the weight."""
    x = (payload(rank, rows * HID, salt=1) - 5).view(rows, HID)
    residual = (payload(7, rows * HID, salt=2) - 5).view(rows, HID)
    weight = 1 + payload(9, HID) / 10
    if where == "x":
        if rank == 0:
            x[0, 5] = NAN  # row 0: a NaN in one rank's x
            x[3, 1] = INF  # row 3: +inf on one rank, -inf on the other: NaN
        else:
            x[1, 7] = INF  # row 1: +inf in one rank's x (the row's rstd is 0)
            x[3, 1] = -INF
        residual[2, 9] = NAN  # row 2: a NaN in the residual; row 4 stays finite
    else:
        weight[11], weight[12], weight[13] = NAN, INF, -INF
    return x.to(dtype), residual.to(dtype), weight.to(dtype)


def _norm_ref(dtype, where, rows):
    from sparkinfer.comm.fused_norm.reference import all_reduce_add_rms_norm_reference

    ins = [norm_inputs(q, dtype, where, rows) for q in range(W)]
    return all_reduce_add_rms_norm_reference([i[0] for i in ins], ins[0][1], ins[0][2], EPS)


def _norm(algorithm, dtype, where, rows=ROWS):
    def run(comm, r):
        x, residual, weight = norm_inputs(r, dtype, where, rows)
        out, res_out = comm.all_reduce_add_rms_norm(x, residual, weight, EPS, algorithm=algorithm)
        ref_out, ref_res = _norm_ref(dtype, where, rows)
        bad = [f"out: {p}" for p in nonfinite_problems(out, ref_out, atol=ATOL[dtype])]
        bad += [f"residual_out: {p}" for p in nonfinite_problems(res_out, ref_res, atol=ATOL[dtype])]
        return bad, [out, res_out]
    return run


T, H, D = 3, 4, 32
DEEP = -200.0  # below a shard's lse by this much: exp underflows to exactly 0 in fp32


def dcp_inputs(rank: int, dtype=torch.float32):
    """(o [T, H, D], lse [T, H]) of `rank`, the same on every process; rows (t, h) marked below."""
    g = torch.Generator().manual_seed(300 + rank)  # on the CPU, the same bits on every device
    o, lse = torch.randn(T, H, D, generator=g, device="cpu"), torch.randn(T, H, generator=g, device="cpu")
    lse0 = torch.randn(T, H, generator=torch.Generator().manual_seed(300), device="cpu")[2, 0]  # rank 0's lse[2, 0]
    if rank == 0:
        o[0, 1, 5] = NAN  # (0, 1): NaN in o with a finite lse -> NaN in that element
        o[0, 0, 3] = INF  # (0, 0): +inf in o -> +inf in that element
        o[1, 1, 6] = INF  # (1, 1): +inf here, -inf on rank 1 -> NaN
        o[2, 3] = NAN  # (2, 3): an empty shard's o is NaN: ignored
        lse[2, 3] = -INF
        lse[0, 3] = INF  # (0, 3): +inf here, NaN on rank 1 -> NaN o and lse
        lse[2, 1] = INF  # (2, 1): +inf on both -> NaN o, lse +inf
    else:
        o[1, 1, 6] = -INF
        lse[1, 2] = INF  # (1, 2): +inf on one rank -> NaN o, lse +inf
        o[2, 0, 4] = NAN  # (2, 0): NaN in o whose weight underflows to 0 -> still NaN
        lse[2, 0] = lse0 + DEEP
        lse[0, 3] = NAN
        lse[2, 1] = INF
    return o.to(torch.get_default_device(), dtype), lse.to(torch.get_default_device())


def _expected_marks(o, lse) -> list:
    """The rows marked in dcp_inputs, checked one by one: a regression here is not
    hidden by a reference that regressed the same way."""
    want = [((0, 1, 5), o[0, 1, 5].isnan()), ((0, 0, 3), o[0, 0, 3] == INF), ((1, 1, 6), o[1, 1, 6].isnan()),
            ((2, 3), o[2, 3].isfinite().all()), ((0, 3), o[0, 3].isnan().all() and lse[0, 3].isnan()),
            ((2, 1), o[2, 1].isnan().all() and lse[2, 1] == INF), ((1, 2), o[1, 2].isnan().all() and lse[1, 2] == INF),
            ((2, 0, 4), o[2, 0, 4].isnan() and o[2, 0, :4].isfinite().all())]
    return [f"row {where} is not as documented" for where, ok in want if not bool(ok)]


def _dcp(algorithm, dtype=torch.float32, scatter=False):
    def run(comm, r):
        from sparkinfer.comm.dcp.reference import dcp_merge_reference

        o, lse = dcp_inputs(r, dtype)
        got_o, got_l = comm.dcp_merge(o, lse, return_lse=True, algorithm=algorithm, scatter_heads=scatter)
        ref_o, ref_l = dcp_merge_reference(*zip(*[dcp_inputs(q, dtype) for q in range(W)]))
        bad = [f"reference {p}" for p in _expected_marks(ref_o.float(), ref_l)]
        if scatter:
            heads = slice(r * H // W, (r + 1) * H // W)
            ref_o, ref_l = ref_o[:, heads], ref_l[:, heads]
        else:
            bad += _expected_marks(got_o.float(), got_l)
        bad += [f"o: {p}" for p in nonfinite_problems(got_o, ref_o, atol=ATOL[dtype])]
        bad += [f"lse: {p}" for p in nonfinite_problems(got_l, ref_l, atol=1e-5)]
        return bad, [] if scatter else [got_o, got_l]
    return run


OVER_ROWS = CAP // (4 * HID) + 8  # fp32 rows above the staging capacity: "auto" takes torch.distributed
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = {
    **{f"norm-{a}-{where}-{d}": _norm(a, dt, where) for a in ("fused", "fused_ll", "auto")
       for where in ("x", "weight") for d, dt in DTYPES.items()},
    **{f"norm-nccl-{where}-fp32": _norm("nccl", torch.float32, where) for where in ("x", "weight")},
    "norm-auto-above-capacity-x-fp32": _norm("auto", torch.float32, "x", OVER_ROWS),
    **{f"dcp_merge-kernel-{d}": _dcp("kernel", dt) for d, dt in DTYPES.items()},
    "dcp_merge-kernel-scatter-fp32": _dcp("kernel", scatter=True),
    "dcp_merge-nccl-fp32": _dcp("nccl"),
    "dcp_merge-nccl-scatter-fp32": _dcp("nccl", scatter=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nonfinite_data_follows_the_reference_on_every_rank(nonfinite_outcomes, case):
    per_rank = [o[case] for o in nonfinite_outcomes]
    for r, (problems, _) in enumerate(per_rank):
        assert problems == [], (r, problems)
    assert per_rank[0][1] == per_rank[1][1], "a replicated result differs across ranks"
