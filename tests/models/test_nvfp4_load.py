"""NVFP4 experts: quantized at load, or read from a ModelOpt checkpoint as stored."""

import warnings

import pytest
import torch
from safetensors.torch import save_file

from sparkinfer.errors import PlanError, ShapeError
from sparkinfer.models import Checkpoint, Sharding, load_spec, load_weights
from sparkinfer.models.experts import expert_layout, load_routed
from sparkinfer.models.nvfp4_io import join_gate_up, read_dense, read_nvfp4
from sparkinfer.quant import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from tests.models.conftest import PRESETS


def u8(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_quantize_at_load_is_quantize_of_the_rank_slice(world, ckpt_dir):
    path = ckpt_dir("qwen3_moe-tiny")
    spec, ckpt = load_spec(path), Checkpoint(path)
    for r in range(world):
        bf = load_routed(ckpt, spec, Sharding(r, world), 2)
        fp4 = load_routed(ckpt, spec, Sharding(r, world), 2, moe_format="nvfp4")
        for got, src in ((fp4.w1, bf.w1), (fp4.w2, bf.w2)):
            want = quantize_nvfp4(src)
            assert isinstance(got, NVFP4Tensor) and got.global_scale.shape == (spec.num_experts,)
            assert torch.equal(got.packed, want.packed)
            assert torch.equal(u8(got.scales), u8(want.scales))
            assert torch.equal(got.global_scale, want.global_scale)


def file_nvfp4(ckpt, prefix, shape):
    return read_nvfp4(ckpt, prefix, shape)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("preset", PRESETS)
def test_modelopt_checkpoint_loads_stored_bytes(preset, world, nvfp4_dir):
    path = nvfp4_dir(preset, shared=True)
    spec, ckpt = load_spec(path), Checkpoint(path)
    assert spec.quant == "nvfp4"
    e, h, i = spec.num_experts, spec.hidden, spec.moe_intermediate
    layer = spec.num_layers - 1
    lay = expert_layout(ckpt, spec, layer)
    il = i // world
    files = [[file_nvfp4(ckpt, lay.expert(x, p), shape)
              for p, shape in ((lay.gate, (i, h)), (lay.up, (i, h)), (lay.down, (h, i)))]
             for x in range(e)]
    for r in range(world):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # shared scales: nothing to fold, nothing to warn
            w = load_weights(ckpt, spec, Sharding(r, world), moe_format="nvfp4")
        w1, w2 = w.layers[layer].mlp.w1, w.layers[layer].mlp.w2
        deq1, deq2 = dequantize_nvfp4(w1), dequantize_nvfp4(w2)
        rows = slice(r * il, (r + 1) * il)
        for x, (gate, up, down) in enumerate(files):
            assert torch.equal(w1.packed[x], torch.cat([gate.packed[rows], up.packed[rows]]))
            scales = torch.cat([u8(gate.scales[rows]), u8(up.scales[rows])])
            assert torch.equal(u8(w1.scales[x]), scales)
            assert w1.global_scale[x] == gate.global_scale == up.global_scale
            assert torch.equal(w2.packed[x], down.packed[:, r * il // 2:(r + 1) * il // 2])
            assert w2.global_scale[x] == down.global_scale
            assert torch.equal(deq1[x, :il], dequantize_nvfp4(gate)[rows])
            assert torch.equal(deq1[x, il:], dequantize_nvfp4(up)[rows])
            assert torch.equal(deq2[x], dequantize_nvfp4(down)[:, rows])


def test_modelopt_checkpoint_as_bf16_is_its_dequantization(nvfp4_dir):
    path = nvfp4_dir("mixtral-tiny", shared=True)
    spec, ckpt = load_spec(path), Checkpoint(path)
    as_fp4 = load_routed(ckpt, spec, Sharding(1, 2), 0, moe_format="nvfp4")
    as_bf16 = load_routed(ckpt, spec, Sharding(1, 2), 0, moe_format="bf16")
    assert as_bf16.w1.dtype == torch.bfloat16
    assert torch.equal(as_bf16.w1, dequantize_nvfp4(as_fp4.w1, torch.bfloat16))
    assert torch.equal(as_bf16.w2, dequantize_nvfp4(as_fp4.w2, torch.bfloat16))


def test_different_gate_up_scales_fold_into_block_scales_and_warn_once(nvfp4_dir):
    path = nvfp4_dir("glm4_moe-tiny", shared=False)
    spec, ckpt = load_spec(path), Checkpoint(path)
    with pytest.warns(UserWarning, match=r"different weight_scale_2.*rounded to nearest") as rec:
        w = load_weights(ckpt, spec, Sharding(0, 2), moe_format="nvfp4")
    assert len([m for m in rec if "weight_scale_2" in str(m.message)]) == 1
    lay = expert_layout(ckpt, spec, 2)
    i, h = spec.moe_intermediate, spec.hidden
    deq = dequantize_nvfp4(w.layers[2].mlp.w1)  # [E, 2 I_l, H]
    for x in range(spec.num_experts):
        src = torch.cat([dequantize_nvfp4(file_nvfp4(ckpt, lay.expert(x, p), (i, h)))[:i // 2]
                         for p in (lay.gate, lay.up)])
        err = (deq[x] - src).abs()
        assert (err <= 2.0 ** -4 * src.abs() + 1e-12).all()  # one E4M3 rounding of the scale


def test_join_gate_up_is_exact_for_a_power_of_two_ratio():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (2, 4, 8), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(2, 4, 1, generator=gen) * 400 + 8).to(torch.float8_e4m3fn)
    gate = NVFP4Tensor(codes, scales, torch.tensor([1.0, 3.0]))
    for up_gs, exact in (([0.5, 12.0], True), ([0.3, 3.0], False)):
        up = NVFP4Tensor(codes.flip(1), u8(scales).flip(1).view(torch.float8_e4m3fn),
                         torch.tensor(up_gs))
        joined, stats = join_gate_up(gate, up)
        assert torch.equal(joined.global_scale, torch.maximum(gate.global_scale, up.global_scale))
        want = torch.cat([dequantize_nvfp4(gate), dequantize_nvfp4(up)], dim=1)
        assert (stats.inexact == 0) == exact
        assert torch.equal(dequantize_nvfp4(joined), want) == exact


def test_stored_nvfp4_needs_16_aligned_shards_and_quantize_at_load_pads(ckpt_dir, nvfp4_dir):
    """192 / 8 = 24 per rank: a ModelOpt checkpoint's down_proj scale groups would be cut
    (ShapeError); a bf16 checkpoint quantized at load pads I_l to 32 with zero gate and up
    rows and zero down columns first, which quantize to zero codes."""
    path = nvfp4_dir("glm4_moe-tiny")
    with pytest.raises(ShapeError, match=r"read as stored, the per-rank moe_intermediate_size "
                                         r"\(192 / 8 = 24\) to be multiples of 16"):
        load_routed(Checkpoint(path), load_spec(path), Sharding(0, 8), 1, moe_format="nvfp4")
    path = ckpt_dir("glm4_moe-tiny")
    spec, ckpt = load_spec(path), Checkpoint(path)
    bf = load_routed(ckpt, spec, Sharding(3, 8), 1)
    fp4 = load_routed(ckpt, spec, Sharding(3, 8), 1, moe_format="nvfp4")
    e, h = spec.num_experts, spec.hidden
    z = torch.zeros(e, 8, h, dtype=torch.bfloat16)
    gate, up = bf.w1.chunk(2, dim=1)
    want1 = quantize_nvfp4(torch.cat([gate, z, up, z], dim=1))
    want2 = quantize_nvfp4(torch.cat([bf.w2, z.transpose(1, 2)], dim=2))
    for got, want in ((fp4.w1, want1), (fp4.w2, want2)):
        assert torch.equal(got.packed, want.packed) and torch.equal(u8(got.scales), u8(want.scales))
        assert torch.equal(got.global_scale, want.global_scale)
    assert fp4.w1.shape == (e, 64, h) and not dequantize_nvfp4(fp4.w2)[..., 24:].any()


def test_unknown_moe_format(ckpt_dir):
    path = ckpt_dir("mixtral-tiny")
    with pytest.raises(PlanError, match="moe_format='int4'"):
        load_weights(Checkpoint(path), load_spec(path), Sharding(), moe_format="int4")


def test_quantized_dense_linear_is_dequantized_by_slices(tmp_path):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    q = quantize_nvfp4(w)
    save_file({"x.weight": q.packed, "x.weight_scale": q.scales,
               "x.weight_scale_2": q.global_scale.reshape(()),
               "y.weight": w.to(torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    ckpt, full = Checkpoint(tmp_path), dequantize_nvfp4(q, torch.bfloat16)
    assert torch.equal(read_dense(ckpt, "x", (8, 64), dim=1, span=(8, 40)), full[:, 8:40])
    assert torch.equal(read_dense(ckpt, "x", (8, 64), dim=1, span=(16, 48)), full[:, 16:48])
    assert torch.equal(read_dense(ckpt, "x", (8, 64), dim=0, span=(2, 5)), full[2:5])
    plain = read_dense(ckpt, "y", (8, 64), dim=1, span=(3, 7))
    assert torch.equal(plain, w.to(torch.bfloat16)[:, 3:7])
