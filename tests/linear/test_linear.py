"""`sparkinfer.linear.linear` against an fp32 reference (interpreter on the CPU;
the same tests run compiled on a GPU)."""

import pytest
import torch

from sparkinfer.envs import triton_interpret
from sparkinfer.errors import DTypeError, LayoutError, ShapeError
from sparkinfer.linear import LINEAR_MAX_ROWS, launch, linear, linear_sync
from sparkinfer.linear.launch import tile_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(1, 1024, 64), (3, 1090, 100), (16, 1024, 512), (5, 1030, 2048)]


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
    x, w, _ = _case(12, 1024, 320, 3, False)
    together = linear(x, w)
    for r in (0, 5, 11):
        assert torch.equal(linear(x[r:r + 1], w), together[r:r + 1])


def test_what_the_kernel_does_not_serve_goes_to_torch():
    """More rows than one tile, router-sized N, fp32: torch's matmul, the same bits."""
    cases = ((LINEAR_MAX_ROWS + 1, 1024, torch.bfloat16), (2, 128, torch.bfloat16), (2, 1024, torch.float32))
    for m, n, dtype in cases:
        x, w, b = (t.to(dtype) for t in _case(m, n, 64, 9, True))
        assert torch.equal(linear(x, w, b), torch.addmm(b, x, w.t()))


SPLIT_CASES = [(1, 1024, 1024), (3, 128, 2048), (16, 1090, 1000), (2, 1024, 4096)]


@pytest.mark.parametrize("m,n,k", SPLIT_CASES, ids=[f"m{m}_n{n}_k{k}" for m, n, k in SPLIT_CASES])
def test_split_k_matches_reference_is_repeatable_and_rearms(monkeypatch, m, n, k):
    """K split over an H200's 132 SMs (a router-sized N included): the slices'
    partials meet in fixed order, so the result is within one rounding of the fp32
    reference, the same bits again and for a row alone, and the semaphores are
    zero again after every call."""
    if DEV == "cpu":
        monkeypatch.setattr(launch, "_num_sms", lambda device: 132)
    split = tile_for(n, k, 2, 132)["SPLIT"]
    assert split > 1
    x, w, b = _case(m, n, k, 7 * m + n, True)
    sync = linear_sync(w)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    linear(x, w, b, out=out, sync=sync)
    assert not sync.any()
    ref = x.float() @ w.float().t() + b.float()
    ulp = 2 ** -7 if triton_interpret() else 2 ** -8
    err = (out.float() - ref).abs()
    assert (err <= ref.abs() * ulp + 1e-5 * ref.abs().max()).all(), err.max()
    assert torch.equal(linear(x, w, b, sync=sync), out)
    assert torch.equal(linear(x[-1:], w, b, sync=sync), out[-1:])
    assert not sync.any()


def test_split_depends_on_the_weight_and_device_only():
    assert tile_for(2048, 4096, 2, 132)["SPLIT"] == 4  # Qwen3-30B-A3B o: 32 blocks
    assert tile_for(5120, 2048, 2, 132)["SPLIT"] == 1  # its qkv: 80 blocks
    assert tile_for(2048, 4096, 2, 1)["SPLIT"] == 1  # the interpreter: one program at a time
    t = tile_for(1090, 1000, 2, 132)
    assert t["K_SLICE"] % t["BK"] == 0 and (t["SPLIT"] - 1) * t["K_SLICE"] < 1000 <= t["SPLIT"] * t["K_SLICE"]


def test_rejects_a_wrong_sync():
    x, w, _ = _case(2, 1024, 64, 1, False)
    for bad in (torch.zeros(16, dtype=torch.int64, device=DEV), torch.zeros(3, dtype=torch.int32, device=DEV)):
        with pytest.raises(LayoutError, match="sync must be linear_sync"):
            linear(x, w, sync=bad)


def test_tile_depends_on_the_weight_only():
    assert tile_for(5120, 2048)["BN"] == 64
    assert not tile_for(40, 100)["EVEN_K"]
    assert tile_for(5120, 4096, 4)["num_stages"] < tile_for(5120, 4096, 2)["num_stages"]


def test_rejects_bad_input():
    x, w, _ = _case(2, 1024, 64, 1, False)
    with pytest.raises(ShapeError, match="same K"):
        linear(x, w[:, :32])
    with pytest.raises(DTypeError, match="float dtype"):
        linear(x.float(), w)
    with pytest.raises(ShapeError, match="bias"):
        linear(x, w, torch.zeros(7, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(LayoutError, match="out must be"):
        linear(x, w, out=torch.empty(2, 9, dtype=torch.bfloat16, device=DEV))
