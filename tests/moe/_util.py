"""Helpers shared by the MoE tests: random layers and meta-device weights."""

import torch

from sparkinfer.moe import MoECaps, MoEWeights, allocate_scratch, bind, moe_reference, plan, prepare_weights, run
from sparkinfer.moe.reference import Comparison, compare_to_reference
from sparkinfer.moe.routing import route_reference
from sparkinfer.moe.weights import nvfp4_shapes
from sparkinfer.quant import quantize_fp8_block, quantize_nvfp4


def check_moe(out, ref, weight_format: str = "bf16") -> Comparison:
    """The suite's one MoE output check: cosine, relative error norm and worst
    element against the fp32 reference (computed with its own routing), bounds
    from `sparkinfer.moe.reference.TOLERANCES` (the row for out's device).
    tests/moe/test_mutations.py asserts that it flags a scaled output, a dropped
    route and two swapped experts."""
    return compare_to_reference(out, ref, weight_format=weight_format)


def assert_moe_close(out, ref, weight_format: str = "bf16") -> None:
    c = check_moe(out, ref, weight_format)
    assert c.ok, f"MoE output vs fp32 reference: {c}"


POISON_ID = 1  # an expert / route / count that exists: a stale read adds wrong rows, no crash


def poison_scratch(scratch: dict) -> None:
    """Fill every scratch buffer with what a read before the call's own write
    would show: NaN floats, NaN E4M3 codes (0x7F), POISON_ID in int buffers.
    `allocate_scratch` returns torch.empty memory, which on a GPU holds whatever
    earlier work left in the caching allocator."""
    for v in scratch.values():
        if v.dtype == torch.float8_e4m3fn:
            v.view(torch.uint8).fill_(0x7F)
        elif v.dtype.is_floating_point:
            v.fill_(float("nan"))
        else:
            v.fill_(POISON_ID)


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


def run_case(spec, t, e, k, max_tokens=32, num_sms=132, h=64, i=32, batch_invariant=True):
    """One random layer run on T tokens routed from random logits: (binding, fp32
    reference computed with the reference's own routing). batch_invariant=False:
    the heuristic plan, whose micro reductions split on many SMs."""
    caps = MoECaps(max_tokens=max_tokens, num_experts=e, top_k=k, hidden=h, intermediate=i,
                   num_sms=num_sms, batch_invariant=batch_invariant)
    p, w, src, scratch = random_layer(caps, spec)
    x = torch.randn(t, h).bfloat16()
    logits = torch.randn(t, e)
    bias = torch.randn(e) if spec.routing == "sigmoid_grouped" else None
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16)
    b = bind(p, scratch, w, x=x, out=out, logits=logits, bias=bias)
    run(b)
    ref = moe_reference(x, src, route_reference(logits, spec, k, bias=bias), spec=spec)
    return b, ref


def meta_weights(p):
    """Prepared-weight record of the right shapes on the meta device (no memory)."""
    c = p.caps
    e, h, i = c.num_experts, c.hidden, p.intermediate  # as the kernels run it (padded)
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
