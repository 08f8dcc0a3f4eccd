"""Helpers shared by the MoE tests: random layers and meta-device weights."""

import torch

from sparkinfer.moe import MoEWeights, allocate_scratch, plan, prepare_weights
from sparkinfer.moe.weights import nvfp4_shapes
from sparkinfer.quant import quantize_fp8_block, quantize_nvfp4


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(),
                                                 dim=0).item()


def random_layer(caps, spec, seed=None):
    """(plan, prepared weights, source weights (w1, w2), scratch) with fresh random weights."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    e, h, i = caps.num_experts, caps.hidden, caps.intermediate * caps.tp_size
    n1 = (2 if spec.gated else 1) * i
    w1 = torch.randn(e, n1, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    if spec.weight_format == "nvfp4":
        w1, w2 = quantize_nvfp4(w1), quantize_nvfp4(w2)
    elif spec.weight_format == "fp8_block":
        w1, w2 = quantize_fp8_block(w1), quantize_fp8_block(w2)
    else:
        w1, w2 = w1.bfloat16(), w2.bfloat16()
    p = plan(caps, spec)
    return p, prepare_weights(p, w1, w2), (w1, w2), allocate_scratch(p, "cpu")


def meta_weights(p):
    """Prepared-weight record of the right shapes on the meta device (no memory)."""
    c = p.caps
    e, h, i = c.num_experts, c.hidden, c.intermediate
    n1 = (2 if p.spec.gated else 1) * i

    def m(*s, dt):
        return torch.empty(*s, dtype=dt, device="meta")

    if p.spec.weight_format == "bf16":
        return MoEWeights("bf16", p.chunk, m(e, n1, h, dt=torch.bfloat16),
                          m(e, h, i, dt=torch.bfloat16))
    if p.spec.weight_format == "fp8_block":
        f8, f32 = torch.float8_e4m3fn, torch.float32
        return MoEWeights("fp8_block", p.chunk, m(e, n1, h, dt=f8), m(e, h, i, dt=f8),
                          m(e, n1 // 128, h // 128, dt=f32), m(e, h // 128, i // 128, dt=f32))
    u8 = torch.uint8
    (w1, s1), (w2, s2) = nvfp4_shapes(e, n1, h, p.chunk), nvfp4_shapes(e, h, i, p.chunk)
    return MoEWeights("nvfp4", p.chunk, m(*w1, dt=u8), m(*w2, dt=u8), m(*s1, dt=u8),
                      m(*s2, dt=u8), m(e, dt=torch.float32), m(e, dt=torch.float32))
