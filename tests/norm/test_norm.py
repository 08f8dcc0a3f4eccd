import math

import pytest
import torch
import triton
import triton.language as tl

from sparkinfer.errors import DTypeError, ShapeError
from sparkinfer.norm import add_rms_norm, rms_norm
from sparkinfer.norm.kernel import sum_squares, sum_squares_2
from sparkinfer.norm.reference import add_rms_norm_reference

CASES = [(1, 64), (5, 100), (3, 1024), (2, 7168)]


@pytest.mark.parametrize("t,h", CASES, ids=[f"t{t}_h{h}" for t, h in CASES])
@pytest.mark.parametrize("with_res", [True, False], ids=["residual", "plain"])
def test_matches_reference(t, h, with_res):
    g = torch.Generator().manual_seed(t * h)
    x = torch.randn(t, h, generator=g).bfloat16()
    res = torch.randn(t, h, generator=g).bfloat16() if with_res else None
    w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16)
    res_out = torch.full((t, h), float("nan"), dtype=torch.bfloat16) if with_res else None
    o, r = add_rms_norm(x, res, w, 1e-6, out=out, residual_out=res_out)
    ro, rr = add_rms_norm_reference(x, res, w, 1e-6)
    assert o is out
    # residual_out: one fp32 add rounded once, exact (the interpreter truncates: 1 ulp)
    assert (r.float() - rr.float()).abs().le(rr.float().abs() * 2 ** -7).all()
    # out: the interpreter's truncated residual (1 ulp) plus its truncated output (1 ulp)
    assert (o.float() - ro.float()).abs().le(ro.float().abs() * 2 ** -6 + 1e-3).all()


def test_in_place_residual_and_plain_helper():
    g = torch.Generator().manual_seed(7)
    x, res = torch.randn(4, 256, generator=g).bfloat16(), torch.randn(4, 256, generator=g).bfloat16()
    w = torch.ones(256).bfloat16()
    expect = add_rms_norm_reference(x, res.clone(), w, 1e-5)
    o, r = add_rms_norm(x, res, w, 1e-5, residual_out=res)
    assert r is res
    # one bf16 ulp (2^-7 relative) for the interpreter's truncating casts, two for out
    assert torch.allclose(r.float(), expect[1].float(), rtol=2 ** -7, atol=0)
    assert torch.allclose(o.float(), expect[0].float(), rtol=2 ** -6, atol=1e-3)
    plain = rms_norm(x, w, 1e-5)
    assert torch.allclose(plain.float(), add_rms_norm_reference(x, None, w, 1e-5)[0].float(), rtol=2 ** -6, atol=1e-3)


def test_rejections():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ShapeError, match=r"x must be \[T, H=8\]"):
        add_rms_norm(x[:, :4], None, w, 1e-6)
    with pytest.raises(ShapeError, match="residual"):
        add_rms_norm(x, torch.randn(3, 8), w, 1e-6)
    with pytest.raises(DTypeError, match="int32"):
        add_rms_norm(x.int(), None, w, 1e-6)


# ---------------------------------------------------------------- the exact sum of squares


@triton.jit
def _sum_squares_kernel(p_x, p_out, N, BLOCK: tl.constexpr, HALVES: tl.constexpr):
    """p_out[0] = sum_squares of x[0:N] in one BLOCK tile, or (HALVES) over the even
    and odd elements as two tiles (the LL kernel's (lo, hi) words)."""
    o = tl.arange(0, BLOCK)
    if HALVES:
        lo = tl.load(p_x + 2 * o, mask=2 * o < N, other=0.0)
        hi = tl.load(p_x + 2 * o + 1, mask=2 * o + 1 < N, other=0.0)
        tl.store(p_out, sum_squares_2(lo, hi))
    else:
        tl.store(p_out, sum_squares(tl.load(p_x + o, mask=o < N, other=0.0), 0))


def _ss(x, block, halves=False):
    out = torch.full((1,), float("nan"))
    _sum_squares_kernel[(1,)](x, out, x.numel(), BLOCK=block, HALVES=halves)
    return out


def test_sum_squares_is_the_same_bits_in_any_order_and_tile():
    """bf16 rows spanning 2**-30..2**30: every tile width, the halves form and any
    permutation give one value, within one rounding of the exact sum (fsum)."""
    g = torch.Generator().manual_seed(11)
    for trial in range(4):
        n = 1000
        x = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float()))
        x = x.bfloat16().float()
        want = _ss(x, 1024)
        for got in (_ss(x, 2048), _ss(x, 512, halves=True), _ss(x[torch.randperm(n, generator=g)].contiguous(), 1024)):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), trial
        exact = torch.tensor(math.fsum(float(v) ** 2 for v in x.double()), dtype=torch.float64)
        assert abs(want.double() - exact) <= exact * 2 ** -23  # one fp32 rounding (and the 2**-32 truncation)


@pytest.mark.parametrize("values,want", [([0.0, -0.0], 0.0), ([float("inf"), 1.0], float("inf")),
                                         ([float("nan"), 1.0], float("nan")), ([float("-inf"), float("nan")],
                                                                               float("nan")),
                                         ([3e19, 1.0], float("inf")), ([-3.0, 4.0], 25.0), ([1e-30], 0.0)],
                         ids=["zeros", "inf", "nan", "inf-and-nan", "overflow", "3-4-5", "underflow"])
def test_sum_squares_of_special_values(values, want):
    """IEEE as a float sum would: inf over an inf square, NaN over a NaN, inf where
    the sum overflows, 0 where squares underflow."""
    got = _ss(torch.tensor(values), 4).item()
    assert (math.isnan(got) and math.isnan(want)) or got == want


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(12)
    x, res = torch.randn(64, 1024, generator=g).bfloat16(), torch.randn(64, 1024, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(1024, generator=g)).bfloat16()
    one, one_res = add_rms_norm(x[5:6], res[5:6], w, 1e-6)
    many, many_res = add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(many[5].view(torch.int16), one[0].view(torch.int16))
    assert torch.equal(many_res[5].view(torch.int16), one_res[0].view(torch.int16))
