"""Every scratch buffer a MoE call reads, the call wrote first: the output is bitwise
the same whether the scratch starts zeroed or poisoned (`_util.poison_scratch`:
NaN floats, NaN E4M3 codes, a valid but wrong id in int buffers). `allocate_scratch` returns
torch.empty memory, which on the GPU holds whatever earlier work left in the
caching allocator, so a read of an unwritten element would make a layer's
result depend on what ran before it (and NaN would spread to the output).

Each format micro with split reductions (T 1: partial buffers, the act kernel
between FC1 and FC2) and grouped (T 20: sort buffers, FP8's x quantization);
fp8_block micro unsplit too (T 3 on one SM: FC1's epilogue quantizes); and the
NVFP4 dequantized path (bf16 copies of a chunk of experts in w_bf16).
tests/moe/test_gpu.py poisons the scratch of its compiled runs the same way."""

import pytest
import torch

from sparkinfer.moe import MoECaps, MoESpec, TileConfig, allocate_scratch, bind, run
from tests.moe._util import poison_scratch, random_layer


def _outputs(p, w, x, logits, bias, scratch):
    """out of one bound call with scratch zeroed, then poisoned."""
    outs = []
    for poison in (False, True):
        if poison:
            poison_scratch(scratch)
        else:
            for v in scratch.values():
                v.view(torch.uint8).zero_()
        out = torch.full((x.shape[0], x.shape[1]), float("nan"), dtype=torch.bfloat16)
        run(bind(p, scratch, w, x=x, out=out, logits=logits, bias=bias))
        outs.append(out)
    return outs


# shape -> (T, SMs, H = I): micro with both reductions split (two 128-chunks each way),
# micro unsplit (fp8_block only: there FC1's epilogue quantizes; the other formats' unsplit
# epilogue stores bf16 rows as the split path's act kernel does), grouped
SHAPES = {"split": (1, 132, 256), "unsplit": (3, 1, 128), "grouped": (20, 132, 128)}
CASES = [(f, s) for f in ("bf16", "nvfp4", "fp8_block") for s in SHAPES
         if s != "unsplit" or f == "fp8_block"]


@pytest.mark.parametrize("fmt,shape", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_output_does_not_depend_on_scratch_contents(fmt, shape):
    t, sms, h = SHAPES[shape]
    spec = MoESpec(weight_format=fmt, routing="sigmoid_grouped", n_group=2, topk_group=1)
    caps = MoECaps(max_tokens=32, num_experts=4, top_k=2, hidden=h, intermediate=h, num_sms=sms,
                   batch_invariant=shape != "split")  # the heuristic splits; the others are invariant plans
    p, w, _, _ = random_layer(caps, spec, seed=t)
    cfg = p.config_for(t)
    assert cfg.family == ("micro" if t < 16 else "grouped")
    # the act kernel (and FC2's partials) run exactly when split
    assert (cfg.split1 > 1 and cfg.split2 > 1) == (shape == "split")
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).bfloat16()
    logits, bias = torch.randn(t, 4, generator=g), torch.randn(4, generator=g) * 0.1
    clean, poisoned = _outputs(p, w, x, logits, bias, allocate_scratch(p, "cpu"))
    assert torch.isfinite(clean.float()).all()
    assert torch.equal(poisoned, clean)


def test_nvfp4_dequantized_path_does_not_depend_on_scratch_contents():
    spec = MoESpec(weight_format="nvfp4")
    caps = MoECaps(max_tokens=32, num_experts=4, top_k=2, hidden=128, intermediate=64)
    p, w, _, _ = random_layer(caps, spec, seed=3)
    p = p.forced(TileConfig("grouped", 16, 64, 128, dequant_experts=3, block_k=64))
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(20, 128, generator=g).bfloat16(), torch.randn(20, 4, generator=g)
    clean, poisoned = _outputs(p, w, x, logits, None, allocate_scratch(p, "cpu"))
    assert torch.isfinite(clean.float()).all()
    assert torch.equal(poisoned, clean)
