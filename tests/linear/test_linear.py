"""`sparkinfer.linear.linear` against an fp32 reference (interpreter on the CPU;
the same tests run compiled on a GPU)."""

import pytest
import torch

from sparkinfer.envs import triton_interpret
from sparkinfer.errors import DTypeError, LayoutError, ShapeError
from sparkinfer.linear import LINEAR_MAX_ROWS, linear
from sparkinfer.linear.launch import tile_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(1, 40, 64), (3, 130, 100), (16, 256, 512), (5, 33, 2048)]


def _case(m, n, k, seed, bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16().to(DEV)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16().to(DEV)
    b = torch.randn(n, generator=g).bfloat16().to(DEV) if bias else None
    return x, w, b


@pytest.mark.parametrize("m,n,k", CASES, ids=[f"m{m}_n{n}_k{k}" for m, n, k in CASES])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_fp32_reference(m, n, k, bias):
    x, w, b = _case(m, n, k, m * n + k, bias)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert linear(x, w, b, out=out) is out
    ref = x.float() @ w.float().t() + (b.float() if bias else 0)
    # one rounding of an fp32 sum to bf16: half a spacing, <= 2^-8 of the value (the
    # interpreter truncates: a whole spacing, < 2^-7), plus fp32 summation-order noise
    ulp = 2 ** -7 if triton_interpret() else 2 ** -8
    err = (out.float() - ref).abs()
    assert (err <= ref.abs() * ulp + 1e-5 * ref.abs().max()).all(), err.max()


def test_rows_do_not_depend_on_the_batch():
    """Each row is the same bits alone and among 11 others (speculative verify steps
    and plain decode steps then round alike)."""
    x, w, _ = _case(12, 96, 320, 3, False)
    together = linear(x, w)
    for r in (0, 5, 11):
        assert torch.equal(linear(x[r:r + 1], w), together[r:r + 1])


def test_more_rows_than_the_kernel_serves_go_to_torch():
    x, w, b = _case(LINEAR_MAX_ROWS + 1, 24, 64, 9, True)
    assert torch.equal(linear(x, w, b), torch.addmm(b, x, w.t()))


def test_tile_depends_on_the_weight_only():
    assert tile_for(5120, 2048)["BN"] == 64 and tile_for(128, 2048)["BN"] == 16
    assert not tile_for(40, 100)["EVEN_K"] and tile_for(5120, 4096, 4)["num_stages"] < tile_for(5120, 4096, 2)["num_stages"]


def test_rejects_bad_input():
    x, w, _ = _case(2, 8, 64, 1, False)
    with pytest.raises(ShapeError, match="same K"):
        linear(x, w[:, :32])
    with pytest.raises(DTypeError, match="float dtype"):
        linear(x.float(), w)
    with pytest.raises(ShapeError, match="bias"):
        linear(x, w, torch.zeros(7, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(LayoutError, match="out must be"):
        linear(x, w, out=torch.empty(2, 9, dtype=torch.bfloat16, device=DEV))
