"""FP8 block format: E4M3 rounding against the arithmetic definition, block and
group quantization against a per-block loop, checkpoint import, rejections."""

import pytest
import torch

from sparkinfer.errors import CheckpointError, DTypeError, ShapeError
from sparkinfer.quant import (
    FP8BlockTensor,
    dequantize_fp8_block,
    dequantize_fp8_groups,
    quantize_fp8_block,
    quantize_fp8_groups,
)
from sparkinfer.quant.fp8 import ACT_AMIN, from_checkpoint, round_to_e4m3_signed
from sparkinfer.quant.reference import e4m3_rne_reference

E4M3_CASES = [  # (input, expected) nearest even, saturating at 448, subnormals kept
    (0.0, 0.0), (448.0, 448.0), (464.0, 448.0), (480.0, 448.0), (1e9, 448.0), (-1e9, -448.0),
    (17.0, 16.0),  # tie between 16 and 18: even mantissa (16)
    (19.0, 20.0),  # tie between 18 and 20: even (20)
    (-17.0, -16.0), (1.0625, 1.0), (1.1875, 1.25), (2.0 ** -9, 2.0 ** -9),
    (2.0 ** -10, 0.0),  # half the smallest subnormal: to even (0)
    (3 * 2.0 ** -10, 2.0 ** -8),  # 1.5 units of 2**-9: to even (2 units)
    (2.0 ** -6 - 2.0 ** -10, 2.0 ** -6),  # 7.5 subnormal units: to 8 = the smallest normal
    (-3 * 2.0 ** -11, -2.0 ** -9),
]


@pytest.mark.parametrize("x,want", E4M3_CASES, ids=[f"{x:g}->{w:g}" for x, w in E4M3_CASES])
def test_e4m3_cases(x, want):
    t = torch.tensor([x])
    assert e4m3_rne_reference(t).item() == want
    assert round_to_e4m3_signed(t).float().item() == want


def _e4m3_values() -> torch.Tensor:
    """Every finite non-negative E4M3 value, ascending."""
    v = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)].sort().values


def test_every_midpoint_and_neighbour_rounds_to_nearest_even():
    v = _e4m3_values()
    mid = (v[1:] + v[:-1]) / 2  # exact in fp32
    xs = torch.cat([v, mid, torch.nextafter(mid, torch.zeros_like(mid)),
                    torch.nextafter(mid, torch.full_like(mid, 1e9))])
    xs = torch.cat([xs, -xs])
    got = round_to_e4m3_signed(xs).float()
    assert torch.equal(got, e4m3_rne_reference(xs))
    # a midpoint goes to the neighbour with an even code (mantissa bit 0)
    codes = round_to_e4m3_signed(mid).view(torch.uint8)
    assert bool((codes % 2 == 0).all())


def test_random_magnitudes_match_the_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 16, generator=g) * torch.exp2(torch.randint(-14, 12, (1 << 16,),
                                                                      generator=g).float())
    assert torch.equal(round_to_e4m3_signed(x).float(), e4m3_rne_reference(x))


def _block_reference(w: torch.Tensor):
    """Per-block loop: scale = amax / 448 (1 for zeros), values rounded by the
    arithmetic definition. Returns (values fp32 [N, K], scales [nb, kb])."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    vals, scales = torch.empty(n, k), torch.empty(nb, kb)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = blk.abs().max()
            s = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scales[i, j] = s
            vals[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = e4m3_rne_reference(blk / s)
    return vals, scales


SHAPES = [(128, 128), (130, 200), (1, 5), (257, 384), (3, 129, 131)]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_block_quantize_matches_the_per_block_loop(shape):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 8
    w = w.bfloat16()
    q = quantize_fp8_block(w)
    nb, kb = -(-shape[-2] // 128), -(-shape[-1] // 128)
    assert q.weight.shape == shape and q.scale.shape == (*shape[:-2], nb, kb)
    flat_w = w.reshape(-1, *shape[-2:])
    flat_v = q.weight.float().reshape(-1, *shape[-2:])
    flat_s = q.scale.reshape(-1, nb, kb)
    for b in range(flat_w.shape[0]):
        vals, scales = _block_reference(flat_w[b])
        assert torch.equal(flat_s[b], scales)
        assert torch.equal(flat_v[b], vals)
    # every block's largest magnitude lands on 448; value = fp8 * scale exactly
    assert q.weight.float().abs().amax() == 448.0
    d = dequantize_fp8_block(q)
    s_full = q.scale.repeat_interleave(128, -2).repeat_interleave(128, -1)
    assert torch.equal(d, q.weight.float() * s_full[..., :shape[-2], :shape[-1]])
    err = (d - w.float()).norm() / w.float().norm()
    assert err < 0.04  # E4M3: 3 mantissa bits, <= 2**-4 relative per element


def test_zero_block_gets_scale_one_and_zero_values():
    w = torch.zeros(130, 256)
    w[129, 200] = 3.0
    q = quantize_fp8_block(w)
    assert torch.equal(q.scale, torch.tensor([[1.0, 1.0], [1.0, 3.0 / 448.0]]))  # fp32 3/448
    assert torch.equal(dequantize_fp8_block(q), w)


def test_activation_groups_match_the_definition():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 384, generator=g) * 3).bfloat16()
    x[1, 128:256] = 0  # a zero group: scale ACT_AMIN / 448, values 0
    q, s = quantize_fp8_groups(x)
    grp = x.float().reshape(5, 3, 128)
    want_s = grp.abs().amax(-1).clamp(min=ACT_AMIN) / 448.0
    assert torch.equal(s, want_s)
    want_q = e4m3_rne_reference(grp * (1.0 / want_s)[..., None])
    assert torch.equal(q.float().reshape(5, 3, 128), want_q)
    assert not q.float()[1, 128:256].any()
    err = (dequantize_fp8_groups(q, s) - x.float()).norm() / x.float().norm()
    assert err < 0.04
    with pytest.raises(ShapeError, match="multiple of 128"):
        quantize_fp8_groups(torch.ones(2, 100))


def test_from_checkpoint_accepts_bits_and_bf16_scales():
    q = quantize_fp8_block(torch.randn(2, 256, 130))
    t = from_checkpoint(q.weight.view(torch.uint8), q.scale.bfloat16())
    assert isinstance(t, FP8BlockTensor) and t.shape == (2, 256, 130)
    assert torch.equal(t.weight.view(torch.uint8), q.weight.view(torch.uint8))
    assert t.scale.dtype == torch.float32


REJECT = [
    ("missing-scale", lambda q: (q.weight, None), CheckpointError, "no weight_scale_inv"),
    ("weight-dtype", lambda q: (q.weight.float(), q.scale), DTypeError, "weight dtype"),
    ("scale-dtype", lambda q: (q.weight, q.scale.double()), DTypeError, "scale dtype"),
    ("scale-shape", lambda q: (q.weight, q.scale[:, :1]), ShapeError,
     r"expected \(2, 2, 2\)"),
    ("scale-per-tensor", lambda q: (q.weight, torch.ones(2)), ShapeError, "does not match"),
    ("weight-1d", lambda q: (q.weight[0, 0], q.scale[0, 0]), ShapeError, r"need \[\.\.\., N, K\]"),
]


@pytest.mark.parametrize("make,err,match", [r[1:] for r in REJECT], ids=[r[0] for r in REJECT])
def test_from_checkpoint_rejects(make, err, match):
    q = quantize_fp8_block(torch.randn(2, 256, 130))
    with pytest.raises(err, match=match):
        from_checkpoint(*make(q))


def test_quantize_rejects_bad_inputs():
    with pytest.raises(DTypeError, match="w dtype torch.int32"):
        quantize_fp8_block(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ShapeError, match=r"w shape \(16,\)"):
        quantize_fp8_block(torch.ones(16))
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_fp8_block(torch.full((4, 16), float("inf")))
