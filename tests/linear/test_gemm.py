"""`gemm`, the prefill projection: against an fp32 reference on random inputs (bias, ragged
M, N and K), and a row's result the same bits at any M beside any rows (batch invariance)."""

import pytest
import torch

from sparkinfer.errors import DTypeError, LayoutError, ShapeError
from sparkinfer.linear import gemm
from sparkinfer.linear.gemm import GEMM_CANDIDATES

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU (TRITON_INTERPRET=1)


def _ref(x, w, bias=None):
    y = x.float() @ w.float().T
    return y + bias.float() if bias is not None else y


@pytest.mark.parametrize("m,n,k,bias", [(1, 64, 64, False), (200, 96, 80, True), (130, 300, 136, False)],
                         ids=["row", "ragged-bias", "two-row-tiles"])
def test_matches_the_fp32_reference(m, n, k, bias):
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(DEV)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(DEV) if bias else None
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)  # poisoned: every element written
    y = gemm(x, w, b, out=out)
    ref = _ref(x, w, b)
    assert y is out and torch.isfinite(y).all()
    # fp32 sums rounded once to bf16: within one bf16 ulp (2**-7 relative: the interpreter's
    # casts truncate, the GPU's round to nearest, half that), plus the fp32 sum's own rounding
    assert torch.allclose(y.float(), ref, rtol=2 ** -7, atol=1e-5 * k), (y.float() - ref).abs().max()


def test_a_row_is_the_same_bits_at_any_m_beside_any_rows():
    g = torch.Generator().manual_seed(1)
    k, n = 96, 160
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(DEV)
    probe = torch.randn(1, k, generator=g).to(torch.bfloat16).to(DEV)
    alone = gemm(probe, w)
    for m, at in ((2, 1), (130, 129), (257, 0), (300, 200), (4096, 3000), (12300, 12000)):  # the last: wide tiles
        x = (torch.randn(m, k, generator=g).to(torch.bfloat16) * 30).to(DEV)  # neighbours of another scale
        x[at] = probe[0]
        assert torch.equal(gemm(x, w)[at], alone[0]), (m, at)


def test_the_tile_follows_the_output_size():
    from sparkinfer.linear.gemm import GEMM_MID, GEMM_NARROW, GEMM_WIDE, gemm_tile

    assert gemm_tile(256, 2048) == GEMM_NARROW and gemm_tile(1024, 2048) == GEMM_WIDE
    assert gemm_tile(256, 5120) == GEMM_MID and gemm_tile(512, 2048) == GEMM_MID
    assert gemm_tile(4096, 128) == GEMM_NARROW  # a router: 32 wide tiles would idle most SMs


@pytest.fixture(scope="module")
def ragged():
    """x, w ragged in every dimension and the planned tile's output."""
    g = torch.Generator().manual_seed(2)
    m, n, k = 200, 192, 160
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(DEV)
    return x, w, gemm(x, w)


_LOADS = ((False, "tiles"), (True, "tiles"), (False, "persistent"), (True, "persistent"), (True, "ws"))


@pytest.mark.parametrize("tma,schedule", _LOADS, ids=[f"{'tma' if t else 'ptr'}-{s}" for t, s in _LOADS])
@pytest.mark.parametrize("name", GEMM_CANDIDATES)
def test_every_tile_gives_the_same_bits(ragged, name, tma, schedule):
    """The tile follows the output's size (`gemm_tile`), so a row's bits must not follow
    the tile: each candidate of the tile sweep, by per-thread loads and by TMA
    descriptors, one program a tile and persistent (warp-specialized with TMA), against
    the planned one, bitwise (one case each, so a run names the one that fails or stalls)."""
    x, w, planned = ragged
    out = torch.full(planned.shape, float("nan"), dtype=torch.bfloat16, device=DEV)
    bm, _, _, _, warps, _ = GEMM_CANDIDATES[name]
    if schedule == "ws" and bm > 64 and warps == 4:  # stalled on an H100: refused (gemm.GEMM_SCHEDULE)
        with pytest.raises(LayoutError, match="stalled"):
            gemm(x, w, out=out, tile=GEMM_CANDIDATES[name], tma=tma, schedule=schedule)
        return
    assert torch.equal(gemm(x, w, out=out, tile=GEMM_CANDIDATES[name], tma=tma, schedule=schedule), planned)


def test_unaligned_rows_take_per_thread_loads():
    """A TMA descriptor needs 16-byte aligned rows: a view of odd K stride loads per
    thread (the same bits), and asking for TMA there is refused."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, 72, generator=g).to(torch.bfloat16).to(DEV)
    x = base[:, :67]  # row stride 72 elements (aligned), K = 67
    odd = torch.randn(40, 69, generator=g).to(torch.bfloat16).to(DEV)[:, :67]  # row stride 69: unaligned
    odd.copy_(x)
    w = (torch.randn(24, 72, generator=g) / 67 ** 0.5).to(torch.bfloat16).to(DEV)[:, :67]
    assert torch.equal(gemm(odd, w), gemm(x, w, tma=True))
    with pytest.raises(LayoutError, match="16-byte aligned"):
        gemm(odd, w, tma=True)
    with pytest.raises(LayoutError, match="'ws' with TMA loads"):
        gemm(odd, w, schedule="ws")
    with pytest.raises(LayoutError, match="schedule must be one of"):
        gemm(x, w, schedule="stream")


def test_bad_inputs_are_refused():
    x, w = torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16)
    with pytest.raises(ShapeError):
        gemm(x, torch.zeros(16, 48, dtype=torch.bfloat16))
    with pytest.raises(DTypeError):
        gemm(x.float(), w.float())
    with pytest.raises(LayoutError):
        gemm(x, torch.zeros(32, 16, dtype=torch.bfloat16).T)
    with pytest.raises(ShapeError):
        gemm(x, w, torch.zeros(8, dtype=torch.bfloat16))
