"""FP8 block-scaled checkpoints through the loader: config, routed experts as
stored per rank, dense linears dequantized, quantize-at-load from bf16.

Needs the model loader (sparkinfer.models.checkpoint / experts / config, on the
loader branch) with the fp8_block hooks into `fp8_io`; skipped where the
loader is absent."""

import json
import shutil

import pytest
import torch

pytest.importorskip("sparkinfer.models.checkpoint")
pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

from sparkinfer.errors import ShapeError  # noqa: E402
from sparkinfer.models import Checkpoint, Sharding, load_spec, load_weights  # noqa: E402
from sparkinfer.models.experts import load_routed  # noqa: E402
from sparkinfer.quant import dequantize_fp8_block, quantize_fp8_block  # noqa: E402
from sparkinfer.quant.fp8 import FP8BlockTensor  # noqa: E402

# H 128 and I 256: whole 128-blocks for 1 and 2 ranks
DIMS = dict(hidden_size=128, moe_intermediate_size=256, intermediate_size=256)


def _fp8_dir(src, dst):
    """src's checkpoint with every projection weight as E4M3 + weight_scale_inv and
    config.json's quantization_config, as the published FP8 checkpoints store them."""
    shutil.copytree(src, dst)
    out = {}
    with Checkpoint(src) as ckpt:
        for name in ckpt.names:
            t = ckpt.read(name)
            if name.endswith("proj.weight") or name.split(".")[-2] in ("w1", "w2", "w3"):
                q = quantize_fp8_block(t)
                out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q.weight, q.scale
            else:
                out[name] = t
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def dirs(ckpt_dir, tmp_path_factory):
    bf = ckpt_dir("qwen3_moe-tiny", **DIMS)
    return bf, _fp8_dir(bf, tmp_path_factory.mktemp("fp8") / "qwen3-fp8")


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_experts_load_as_stored_per_rank(dirs, world):
    bf, fp8 = dirs
    spec, ckpt = load_spec(fp8), Checkpoint(fp8)
    assert spec.quant == "fp8_block"
    il = 256 // world
    for r in range(world):
        got = load_routed(ckpt, spec, Sharding(r, world), 2, moe_format="fp8_block")
        assert isinstance(got.w1, FP8BlockTensor) and got.w1.shape == (8, 2 * il, 128)
        for x in range(spec.num_experts):
            p = f"model.layers.2.mlp.experts.{x}"
            gate, up, down = (FP8BlockTensor(ckpt.read(f"{p}.{n}.weight"),
                                             ckpt.read(f"{p}.{n}.weight_scale_inv"))
                              for n in ("gate_proj", "up_proj", "down_proj"))
            rows = slice(r * il, (r + 1) * il)
            d1 = dequantize_fp8_block(got.w1)[x]
            assert torch.equal(d1, torch.cat([dequantize_fp8_block(gate)[rows],
                                              dequantize_fp8_block(up)[rows]]))
            assert torch.equal(dequantize_fp8_block(got.w2)[x], dequantize_fp8_block(down)[:, rows])
        as_bf16 = load_routed(ckpt, spec, Sharding(r, world), 2)
        assert torch.equal(as_bf16.w1, dequantize_fp8_block(got.w1, torch.bfloat16))


def test_fp8_experts_read_as_bf16_at_any_slice(dirs):
    """256 / 4 = 64 per rank cuts the 128-blocks: read as bf16, the
    rank's rows and columns are the dequantized checkpoint's, whatever blocks they cut."""
    _, fp8 = dirs
    spec, ckpt = load_spec(fp8), Checkpoint(fp8)
    p = "model.layers.2.mlp.experts.5"
    gate, up, down = (dequantize_fp8_block(FP8BlockTensor(ckpt.read(f"{p}.{n}.weight"),
                                                          ckpt.read(f"{p}.{n}.weight_scale_inv")), torch.bfloat16)
                      for n in ("gate_proj", "up_proj", "down_proj"))
    got = load_routed(ckpt, spec, Sharding(3, 4), 2)
    assert torch.equal(got.w1[5], torch.cat([gate[192:], up[192:]]))
    assert torch.equal(got.w2[5], down[:, 192:])


def test_bf16_checkpoint_quantizes_at_load(dirs):
    bf, _ = dirs
    spec, ckpt = load_spec(bf), Checkpoint(bf)
    plain = load_routed(ckpt, spec, Sharding(1, 2), 1)
    q = load_routed(ckpt, spec, Sharding(1, 2), 1, moe_format="fp8_block")
    want = quantize_fp8_block(plain.w1)
    assert torch.equal(q.w1.weight.view(torch.uint8), want.weight.view(torch.uint8))
    assert torch.equal(q.w1.scale, want.scale)


def test_whole_model_loads_with_dense_linears_dequantized(dirs):
    bf, fp8 = dirs
    spec = load_spec(fp8)
    w = load_weights(Checkpoint(fp8), spec, Sharding(0, 2), moe_format="fp8_block")
    ref = load_weights(Checkpoint(bf), load_spec(bf), Sharding(0, 2))
    qkv, qkv_ref = w.layers[0].attn.qkv.float(), ref.layers[0].attn.qkv.float()
    assert qkv.dtype == torch.float32 and (qkv - qkv_ref).norm() / qkv_ref.norm() < 0.05
    assert isinstance(w.layers[2].mlp.w1, FP8BlockTensor)


def test_rank_slices_must_be_whole_blocks(dirs):
    _, fp8 = dirs
    spec, ckpt = load_spec(fp8), Checkpoint(fp8)
    with pytest.raises(ShapeError, match=r"moe_intermediate_size \(256 / 4 = 64\)"):
        load_routed(ckpt, spec, Sharding(0, 4), 2, moe_format="fp8_block")
