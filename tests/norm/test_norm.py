import pytest
import torch

from sparkinfer.errors import DTypeError, ShapeError
from sparkinfer.norm import add_rms_norm, rms_norm
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
