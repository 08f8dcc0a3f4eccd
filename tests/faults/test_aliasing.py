"""Outputs that partially overlap inputs raise AliasingError on every op that
takes `out=` (all_reduce, reduce_scatter, all_gather, the fused norm's out and
residual_out, dcp_merge's out and lse_out, all_gather_heads' out); exact in-place
aliasing stays legal and exact where an op allows it, and the communicator stays
usable after the rejections. Strided inputs (dcp_merge reads head-major views)
are compared element by element: a buffer in their gaps does not overlap them."""

import pytest
import torch

from sparkinfer.errors import AliasingError
from sparkinfer.runtime import run_ranks
from tests.faults._util import CAP, expect_raises, expected_sum, payload


def _overlaps(world):
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=CAP, timeout_s=60)
    r, W = world.rank, world.world_size
    buf = torch.zeros(1100)
    buf[:1000] = payload(r, 1000)
    rows = torch.zeros(4 * 64 + 32)
    w = torch.ones(64)
    T, H, D = 2, 4, 32
    o, lse = torch.zeros(T, H, D), torch.zeros(T, H)
    both = torch.zeros(T * H * D + T * H)  # an out and an lse_out that share their last row
    heads = torch.zeros(T, W * 2, D)
    cases = [
        ("all_reduce-shifted", AliasingError, "out .* overlaps x .* by 3600 B",
         lambda: comm.all_reduce(buf[0:1000], buf[100:1100])),
        ("reduce_scatter-inside", AliasingError, "overlaps x",
         lambda: comm.reduce_scatter(buf[:1000], buf[:500])),
        ("all_gather-inside", AliasingError, "overlaps x",
         lambda: comm.all_gather(buf[:500], buf[:1000])),
        ("fused-out-shifted", AliasingError, "out .* overlaps x",
         lambda: comm.all_reduce_add_rms_norm(rows[:128].view(2, 64), torch.zeros(2, 64), w,
                                              out=rows[32:160].view(2, 64))),
        ("fused-residual_out-on-x", AliasingError, "residual_out .* overlaps x",
         lambda: comm.all_reduce_add_rms_norm(rows[:128].view(2, 64), torch.zeros(2, 64), w,
                                              residual_out=rows[:128].view(2, 64))),
        ("fused-out-on-weight", AliasingError, "out .* overlaps weight",
         lambda: comm.all_reduce_add_rms_norm(rows[:128].view(2, 64), torch.zeros(2, 64), rows[160:224],
                                              out=rows[128:256].view(2, 64))),
        ("dcp_merge-out-in-place", AliasingError, "out .* overlaps out_partial",
         lambda: comm.dcp_merge(o, lse, out=o)),
        ("dcp_merge-out-on-lse", AliasingError, "out .* overlaps lse",
         lambda: comm.dcp_merge(o, both[: T * H].view(T, H),
                                out=both[T * H - 4: T * H - 4 + T * H * D].view(T, H, D))),
        ("dcp_merge-lse_out-in-place", AliasingError, "lse_out .* overlaps lse",
         lambda: comm.dcp_merge(o, lse, lse_out=lse, return_lse=True)),
        ("dcp_merge-lse_out-on-out", AliasingError, "lse_out .* overlaps out",
         lambda: comm.dcp_merge(o, lse, out=both[: T * H * D].view(T, H, D),
                                lse_out=both[T * H * D - 4:T * H * D - 4 + T * H].view(T, H), return_lse=True)),
        ("dcp_merge-scatter-out-in-own-heads", AliasingError, "out .* overlaps out_partial",
         lambda: comm.dcp_merge(o, lse, scatter_heads=True, out=o.view(-1)[: T * H * D // W].view(T, H // W, D))),
        ("all_gather_heads-x-is-own-slot", AliasingError, "out .* overlaps x",
         lambda: comm.all_gather_heads(heads[:, 2 * r: 2 * r + 2], heads)),
    ]
    bad = expect_raises(cases)
    x = buf[:1000]
    comm.all_reduce(x, x)  # exactly in place: legal
    if not torch.equal(x, expected_sum(W, 1000)):
        bad.append(("in-place", "wrong sum"))
    comm.close()
    return bad


def test_partial_overlap_raises_and_in_place_stays_exact():
    assert run_ranks(_overlaps, 2, backend="cpu", timeout_s=180) == [[], []]


def test_strided_inputs_are_compared_element_by_element():
    """A head-major view and a buffer in its gaps share no byte (legal); a buffer on one
    of its rows does (AliasingError). Host-side only, no ranks."""
    from sparkinfer.comm.dispatch import check_overlap

    store = torch.zeros(4, 2, 3, 32)  # [H, 2, T, D]: heads of o interleaved with gaps
    o = store[:, 0].transpose(0, 1)  # [T, H, D], strides (D, 2 T D, 1)
    check_overlap("out", store[1, 1], "out_partial", o, in_place=False)  # a gap: [T, D], contiguous
    with pytest.raises(AliasingError, match="out .* overlaps out_partial .* in some elements"):
        check_overlap("out", store[1, 0, 1:], "out_partial", o, in_place=False)  # rows of head 1
