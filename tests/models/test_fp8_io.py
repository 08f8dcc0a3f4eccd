"""FP8 block-scaled checkpoints: per-rank expert slices as stored, dense reads
of any slice, the quantization_config check, and every rejection.

The checkpoint is an in-memory stand-in with `Checkpoint`'s lookup and read
methods; per-expert linears are quantized one by one, as the published FP8
checkpoints store them."""

import pytest
import torch

from sparkinfer.errors import CheckpointError, ShapeError, UnsupportedModelError
from sparkinfer.models.fp8_io import fp8_quant_config, is_fp8, read_dense_fp8, read_experts_fp8, read_fp8
from sparkinfer.moe import MoECaps, MoESpec, plan, prepare_weights
from sparkinfer.quant import dequantize_fp8_block, quantize_fp8_block


class MemoryCheckpoint:
    """name -> tensor, with the lookups and sliced reads of `Checkpoint`."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def has(self, name):
        return name in self.tensors

    def file_of(self, name):
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name!r} is missing from <memory>")
        return "<memory>"

    def shape(self, name):
        self.file_of(name)
        return tuple(self.tensors[name].shape)

    def dtype(self, name):
        self.file_of(name)
        return self.tensors[name].dtype

    def expect(self, name, shape, dtypes, *, what=""):
        if self.shape(name) != tuple(shape) or self.dtype(name) not in dtypes:
            raise CheckpointError(f"tensor {name!r} has shape {self.shape(name)}, dtype "
                                  f"{self.dtype(name)}; expected {tuple(shape)} ({what})")

    def read(self, name, *, dim=0, span=None, dtype=None, device="cpu"):
        self.file_of(name)
        t = self.tensors[name]
        if span is not None:
            t = t.narrow(dim, span[0], span[1] - span[0])
        return (t if dtype is None else t.to(dtype)).to(device).contiguous()


E, H, I = 3, 256, 384  # I: 3 scale blocks, so 3 ranks get one each


def _checkpoint(seed=0):
    """(checkpoint, per expert {proj: FP8BlockTensor}) with gate/up [I, H], down [H, I]."""
    g = torch.Generator().manual_seed(seed)
    tensors, experts = {}, []
    for x in range(E):
        lin = {p: quantize_fp8_block(torch.randn(*s, generator=g).bfloat16())
               for p, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
        for p, q in lin.items():
            tensors[f"mlp.experts.{x}.{p}.weight"] = q.weight
            tensors[f"mlp.experts.{x}.{p}.weight_scale_inv"] = q.scale
        experts.append(lin)
    return MemoryCheckpoint(tensors), experts


def _names(x):
    return tuple(f"mlp.experts.{x}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize("world", [1, 3])
def test_rank_slices_are_the_stored_blocks(world):
    ckpt, experts = _checkpoint()
    il = I // world
    for r in range(world):
        a, b = r * il, (r + 1) * il
        w1, w2 = read_experts_fp8(ckpt, _names, (E, H, I), (a, b))
        assert w1.shape == (E, 2 * il, H) and w2.shape == (E, H, il)
        assert w1.scale.shape == (E, 2 * il // 128, 2) and w2.scale.shape == (E, 2, il // 128)
        for x, lin in enumerate(experts):
            gate, up, down = (dequantize_fp8_block(lin[p]) for p in ("gate_proj", "up_proj",
                                                                    "down_proj"))
            d1, d2 = dequantize_fp8_block(w1)[x], dequantize_fp8_block(w2)[x]
            assert torch.equal(d1, torch.cat([gate[a:b], up[a:b]]))
            assert torch.equal(d2, down[:, a:b])
            assert torch.equal(w1.weight[x, :il].view(torch.uint8),
                               lin["gate_proj"].weight[a:b].view(torch.uint8))


def test_loaded_shard_prepares_like_the_full_tensor_sliced_by_the_plan():
    ckpt, experts = _checkpoint()
    full1, full2 = read_experts_fp8(ckpt, _names, (E, H, I), (0, I))
    spec = MoESpec(weight_format="fp8_block")
    for r in range(3):
        p = plan(MoECaps(max_tokens=4, num_experts=E, top_k=2, hidden=H, intermediate=128,
                         tp_rank=r, tp_size=3), spec)
        a = prepare_weights(p, *read_experts_fp8(ckpt, _names, (E, H, I), (128 * r, 128 * r + 128)))
        b = prepare_weights(p, full1, full2)
        for f in ("w1", "w2", "s1", "s2"):
            x, y = getattr(a, f), getattr(b, f)
            assert torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                               y.view(torch.uint8) if y.dtype != torch.float32 else y), f


def test_dense_reads_of_any_slice_dequantize_the_enclosing_blocks():
    ckpt, experts = _checkpoint()
    prefix = _names(1)[2]  # down_proj [H, I]
    full = dequantize_fp8_block(experts[1]["down_proj"])
    assert is_fp8(ckpt, prefix) and not is_fp8(ckpt, "mlp.experts.9.down_proj")
    got = read_dense_fp8(ckpt, prefix, (H, I), dim=1, span=(100, 300), dtype=torch.float32)
    assert torch.equal(got, full[:, 100:300])
    got = read_dense_fp8(ckpt, prefix, (H, I), dim=0, span=(5, 250), dtype=torch.float32)
    assert torch.equal(got, full[5:250])
    assert torch.equal(read_dense_fp8(ckpt, prefix, (H, I), dtype=torch.float32), full)


def test_rejections():
    ckpt, _ = _checkpoint()
    with pytest.raises(ShapeError, match=r"per-rank moe_intermediate_size \(96 of 384\)"):
        read_experts_fp8(ckpt, _names, (E, H, I), (96, 192))  # 4 ranks: 96 each
    with pytest.raises(ShapeError, match=r"slice \[64, 192\) of the output axis"):
        read_fp8(ckpt, _names(0)[0], (I, H), dim=0, span=(64, 192))
    missing = MemoryCheckpoint({k: v for k, v in ckpt.tensors.items()
                                if k != "mlp.experts.0.up_proj.weight_scale_inv"})
    with pytest.raises(CheckpointError, match="weight_scale_inv' is missing"):
        read_experts_fp8(missing, _names, (E, H, I), (0, I))
    bad = MemoryCheckpoint(dict(ckpt.tensors, **{
        "mlp.experts.0.gate_proj.weight_scale_inv": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=r"expected \(3, 2\)"):
        read_experts_fp8(bad, _names, (E, H, I), (0, I))


DEEPSEEK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128]}
QUANT_REJECT = [
    ("per-channel", dict(weight_block_size=[1, 128]), "weight_block_size=\\[1, 128\\]"),
    ("no-blocks", dict(weight_block_size=None), "weight_block_size=None"),
    ("static", dict(activation_scheme="static"), "activation_scheme='static'"),
    ("e5m2", dict(fmt="e5m2"), "fmt='e5m2'"),
]


def test_quantization_config_of_the_published_checkpoints():
    assert fp8_quant_config(DEEPSEEK, "config.json") == "fp8_block"
    assert fp8_quant_config({"quant_method": "fp8", "weight_block_size": [128, 128]}, "c") == \
        "fp8_block"


@pytest.mark.parametrize("edit,match", [r[1:] for r in QUANT_REJECT],
                         ids=[r[0] for r in QUANT_REJECT])
def test_quantization_config_rejects(edit, match):
    with pytest.raises(UnsupportedModelError, match=match):
        fp8_quant_config(dict(DEEPSEEK, **edit), "config.json")
