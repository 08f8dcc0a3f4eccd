"""Per-rank intermediate sizes that no kernel chunk divides (GLM-4.5-Air at TP 8:
1408 / 8 = 176; Qwen3-30B-A3B at TP 16: 48): the planner pads I to a multiple of
32, `prepare_weights` appends zero weights, and the output is the unpadded layer's.

Interpreted cases are tiny (H 64, E 4, T <= 20). Each compares with the fp32
reference on the unpadded weights, and with a layer of the padded I whose extra
weights were written as zeros by hand: equal bits, which is the padding adding
exactly nothing (the same plan runs both).
"""

import pytest
import torch

from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, moe_reference, plan, prepare_weights, run
from sparkinfer.moe.plan import PAD_MULTIPLE
from sparkinfer.moe.routing import route_reference
from sparkinfer.quant import NVFP4Tensor, quantize_nvfp4
from tests.moe._util import assert_moe_close, poison_scratch

QWEN3 = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)


def test_planner_accepts_every_intermediate_from_8_to_4096():
    """Pure planning, 8,178 plans in about a second. A multiple of 32 is not padded, so
    those shapes plan as before (test_plan.py's decision table pins their tiles)."""
    for fmt in ("bf16", "nvfp4"):
        for i in range(8, 4097):
            p = plan(MoECaps(max_tokens=256, **dict(QWEN3, intermediate=i)), MoESpec(weight_format=fmt))
            assert p.intermediate % p.chunk == 0 and 0 <= p.intermediate - i < PAD_MULTIPLE, (fmt, i)
            assert p.intermediate == i or i % PAD_MULTIPLE
    # GLM-4.5-Air at TP 8 pads 176 to 192 (chunk 64), not to 256 (chunk 128): 9% more bytes, not 45%
    glm = plan(MoECaps(max_tokens=16, num_experts=128, top_k=8, hidden=4096, intermediate=176), MoESpec())
    assert (glm.intermediate, glm.chunk) == (192, 64)


def _zero_padded(w1, w2, i: int, i_pad: int, gated: bool):
    """bf16 (w1 [E, N1, H], w2 [E, H, I]) with zero gate rows, up rows and FC2 columns up to i_pad."""
    e, _, h = w1.shape
    z1 = torch.zeros(e, i_pad - i, h, dtype=w1.dtype)
    halves = w1.split(i, dim=1) if gated else (w1,)
    w1p = torch.cat([t for half in halves for t in (half, z1)], dim=1)
    return w1p, torch.cat([w2, torch.zeros(e, h, i_pad - i, dtype=w2.dtype)], dim=2)


def _layer_out(caps, spec, weights, x, logits):
    p = plan(caps, spec)
    scratch = allocate_scratch(p, "cpu")
    poison_scratch(scratch)
    out = torch.full((x.shape[0], caps.hidden), float("nan"), dtype=torch.bfloat16)
    b = bind(p, scratch, prepare_weights(p, *weights), x=x, out=out, logits=logits)
    run(b)
    return p, b.config.family, out


CASES = [  # id, weight format, activation, I, T
    ("bf16-I24-micro", "bf16", "silu", 24, 3),
    ("bf16-I176-grouped", "bf16", "silu", 176, 20),
    ("bf16-relu2-I40-micro", "bf16", "relu2", 40, 2),
    ("nvfp4-I48-micro", "nvfp4", "silu", 48, 4),
    ("nvfp4-I16-grouped", "nvfp4", "silu", 16, 18),
]


@pytest.mark.parametrize("fmt,act,i,t", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_padded_layer_matches_reference_and_the_zero_padded_layer(fmt, act, i, t):
    spec = MoESpec(weight_format=fmt, activation=act)
    e, h = 4, 64
    caps = MoECaps(max_tokens=32, num_experts=e, top_k=2, hidden=h, intermediate=i)
    n1 = (2 if spec.gated else 1) * i
    w1 = (torch.randn(e, n1, h) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, i) / i ** 0.5).bfloat16()
    x, logits = torch.randn(t, h).bfloat16(), torch.randn(t, e)
    src = (quantize_nvfp4(w1), quantize_nvfp4(w2)) if fmt == "nvfp4" else (w1, w2)
    p, family, out = _layer_out(caps, spec, src, x, logits)
    assert p.intermediate == -(-i // 32) * 32 > i and family == ("micro" if t <= 16 else "grouped")
    assert_moe_close(out, moe_reference(x, src, route_reference(logits, spec, 2), spec=spec))
    if fmt == "nvfp4":  # the same codes and scales, padded by hand: zero codes under zero scales
        w1p, w2p = _nvfp4_padded(src, i, p.intermediate, spec.gated)
    else:
        w1p, w2p = _zero_padded(w1, w2, i, p.intermediate, spec.gated)
    padded = MoECaps(max_tokens=32, num_experts=e, top_k=2, hidden=h, intermediate=p.intermediate)
    assert torch.equal(_layer_out(padded, spec, (w1p, w2p), x, logits)[2], out)


def _nvfp4_padded(src, i: int, i_pad: int, gated: bool):
    """NVFP4 (w1, w2) with zero codes and zero scales in the padded rows / columns."""
    w1, w2 = src
    e = w1.shape[0]

    def rows(t, width):  # [E, N1, width] -> gate and up halves each followed by zero rows
        z = t.new_zeros(e, i_pad - i, width)
        halves = t.split(i, dim=1) if gated else (t,)
        return torch.cat([u for half in halves for u in (half, z)], dim=1)

    p1 = NVFP4Tensor(rows(w1.packed, w1.packed.shape[-1]), rows(w1.scales, w1.scales.shape[-1]), w1.global_scale)
    cols = i_pad - i
    p2 = NVFP4Tensor(torch.cat([w2.packed, w2.packed.new_zeros(*w2.packed.shape[:-1], cols // 2)], dim=-1),
                     torch.cat([w2.scales, w2.scales.new_zeros(*w2.scales.shape[:-1], cols // 16)], dim=-1),
                     w2.global_scale)
    return p1, p2


def test_tensor_parallel_padded_shards_sum_to_full_layer():
    """I = 48 over 2 ranks: each rank slices 24 from the full weights and pads to 32."""
    spec = MoESpec()
    e, h, i = 4, 64, 48
    w1 = (torch.randn(e, 2 * i, h) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, i) / i ** 0.5).bfloat16()
    x, logits = torch.randn(3, h).bfloat16(), torch.randn(3, e)
    ref = moe_reference(x, (w1, w2), route_reference(logits, spec, 2), spec=spec)
    total = torch.zeros(3, h)
    for rank in range(2):
        caps = MoECaps(max_tokens=8, num_experts=e, top_k=2, hidden=h, intermediate=i // 2,
                       tp_rank=rank, tp_size=2)
        p, _, out = _layer_out(caps, spec, (w1, w2), x, logits)
        assert p.intermediate == 32
        total += out.float()
    assert_moe_close(total, ref)
