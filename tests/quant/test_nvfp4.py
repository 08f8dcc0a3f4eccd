"""NVFP4 format: exact rounding tables, round trips, checkpoint import, rejections."""

import pytest
import torch

from sparkinfer.errors import DTypeError, ShapeError
from sparkinfer.quant import NVFP4Tensor, dequantize_nvfp4, from_checkpoint, pack_codes, quantize_nvfp4, unpack_codes
from sparkinfer.quant.reference import e2m1_codes_to_float, round_to_e2m1_codes, round_to_e4m3

E2M1_CASES = [  # (input, expected value) nearest-even, saturating at 6
    (0.0, 0.0), (0.25, 0.0), (0.2501, 0.5), (0.5, 0.5), (0.75, 1.0), (1.25, 1.0),
    (1.2501, 1.5), (1.75, 2.0), (2.5, 2.0), (2.51, 3.0), (3.5, 4.0), (5.0, 4.0), (5.01, 6.0),
    (6.0, 6.0), (7.0, 6.0), (1e9, 6.0), (-0.75, -1.0), (-2.5, -2.0), (-5.0, -4.0), (-100.0, -6.0),
    (-0.1, 0.0),
]


@pytest.mark.parametrize("x,want", E2M1_CASES, ids=[f"{x:g}->{w:g}" for x, w in E2M1_CASES])
def test_e2m1_round_nearest_even(x, want):
    code = round_to_e2m1_codes(torch.tensor([x]))
    assert e2m1_codes_to_float(code).item() == want


E4M3_CASES = [  # (input, expected)
    (448.0, 448.0), (500.0, 448.0), (1e6, 448.0), (2.0 ** -9, 2.0 ** -9),
    (2.0 ** -10, 0.0),  # half the smallest subnormal: tie to even (0)
    (3 * 2.0 ** -10, 2.0 ** -8),  # tie between 1 and 2 units of 2**-9: to even (2)
    (2.0 ** -6, 2.0 ** -6), (1.0625, 1.0), (1.1875, 1.25), (240.0, 240.0),
]


@pytest.mark.parametrize("x,want", E4M3_CASES, ids=[f"{x:g}->{w:g}" for x, w in E4M3_CASES])
def test_e4m3_round_saturate_subnormal(x, want):
    assert round_to_e4m3(torch.tensor([x])).float().item() == want


def test_pack_unpack_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_codes(packed), codes)


def test_exactly_representable_values_round_trip():
    # every block holds 6 (sets the block scale) and E2M1 grid values times 2**j
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 2)
    grid[8:] *= -1
    grid[8] = 6.0
    w = torch.stack([grid * 2.0 ** j for j in range(-3, 4)])  # [7, 16]
    q = quantize_nvfp4(w, torch.tensor(1.0))  # power-of-two global scale: exact products
    assert torch.equal(dequantize_nvfp4(q), w)


@pytest.mark.parametrize("shape", [(8, 32), (3, 4, 64), (2, 16, 128)], ids=str)
def test_random_round_trip_is_idempotent_and_close(shape):
    w = torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 10
    q = quantize_nvfp4(w.bfloat16())
    d = dequantize_nvfp4(q)
    cos = torch.nn.functional.cosine_similarity(d.flatten(), w.flatten(), dim=0)
    assert cos > 0.99
    # values already on the grid quantize to themselves (same global scale)
    q2 = quantize_nvfp4(d, q.global_scale)
    assert torch.equal(q2.packed, q.packed)
    assert torch.equal(q2.scales.view(torch.uint8), q.scales.view(torch.uint8))
    # the largest block scale sits at the top of the E4M3 range
    amax = w.bfloat16().float().abs().flatten(-2).amax(-1) if len(shape) > 2 else None
    if amax is not None:
        torch.testing.assert_close(q.global_scale, amax / (6 * 448))
    assert q.scales.float().amax() == 448.0


def test_zero_matrix_quantizes_to_zero():
    q = quantize_nvfp4(torch.zeros(4, 32))
    assert q.global_scale.item() == 1.0
    assert torch.equal(dequantize_nvfp4(q), torch.zeros(4, 32))


def test_from_checkpoint_accepts_raw_bytes_and_scalar_global_scale():
    q = quantize_nvfp4(torch.randn(8, 64))
    t = from_checkpoint(q.packed.view(torch.int8), q.scales.view(torch.uint8),
                        q.global_scale.reshape(1))
    assert isinstance(t, NVFP4Tensor) and t.shape == (8, 64)
    assert torch.equal(dequantize_nvfp4(t), dequantize_nvfp4(q))


REJECT = [
    ("packed-dtype", lambda q: (q.packed.float(), q.scales, q.global_scale), DTypeError,
     "packed dtype"),
    ("scales-dtype", lambda q: (q.packed, q.scales.float(), q.global_scale), DTypeError,
     "scales dtype"),
    ("gscale-dtype", lambda q: (q.packed, q.scales, q.global_scale.double()), DTypeError,
     "global_scale dtype"),
    ("scales-shape", lambda q: (q.packed, q.scales[:, :2], q.global_scale), ShapeError,
     "does not match"),
    ("gscale-shape", lambda q: (q.packed, q.scales, torch.ones(3)), ShapeError,
     "one per matrix"),
    ("packed-1d", lambda q: (q.packed[0, 0], q.scales[0, 0], q.global_scale), ShapeError, "need"),
]


@pytest.mark.parametrize("make,err,match", [r[1:] for r in REJECT], ids=[r[0] for r in REJECT])
def test_from_checkpoint_rejects(make, err, match):
    q = quantize_nvfp4(torch.randn(2, 8, 64))
    with pytest.raises(err, match=match):
        from_checkpoint(*make(q))


def test_quantize_rejects_bad_inputs():
    with pytest.raises(DTypeError, match="dtype"):
        quantize_nvfp4(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ShapeError, match="multiple of 16"):
        quantize_nvfp4(torch.ones(4, 24))
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_nvfp4(torch.full((4, 16), float("nan")))
    with pytest.raises(ShapeError, match="one per matrix"):
        quantize_nvfp4(torch.ones(2, 4, 16), torch.ones(3))


@pytest.mark.parametrize("lead", [(7,), (3, 4)], ids=["experts", "two-lead-dims"])
def test_stacks_quantize_a_few_matrices_at_a_time_with_the_same_bits(monkeypatch, lead):
    """nvfp4.QUANTIZE_CHUNK_BYTES bounds the quantizers' temporaries: a stack of matrices goes
    through in chunks (two matrices here, the last one alone), NVFP4 with and without given
    global scales and FP8 blocks (partial blocks too), and gives the whole stack's bits; a NaN
    in the last chunk is still refused."""
    import sparkinfer.quant.nvfp4 as nv
    from sparkinfer.quant.fp8 import quantize_fp8_block

    g = torch.Generator().manual_seed(11)
    w = torch.randn(*lead, 48, 64, generator=g).bfloat16()
    w.view(-1, 48, 64)[2] = 0  # a matrix of zeros: global scale 1
    gs = torch.rand(lead, generator=g) + 0.1
    whole = [quantize_nvfp4(w), quantize_nvfp4(w, gs), quantize_fp8_block(w[..., :40, :50])]
    monkeypatch.setattr(nv, "QUANTIZE_CHUNK_BYTES", 2 * 48 * 64 * 4)
    assert nv.matrices_per_chunk(w) == 2
    chunked = [quantize_nvfp4(w), quantize_nvfp4(w, gs), quantize_fp8_block(w[..., :40, :50])]

    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    for a, b in zip(whole[:2], chunked[:2]):
        for x, y in ((a.packed, b.packed), (a.scales, b.scales), (a.global_scale, b.global_scale)):
            assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(bits(x), bits(y))
    assert torch.equal(bits(whole[2].weight), bits(chunked[2].weight)) and torch.equal(whole[2].scale, chunked[2].scale)
    assert chunked[2].scale.shape == (*lead, 1, 1)
    bad = w.clone()
    bad.view(-1, 48, 64)[-1, 5, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_nvfp4(bad)
