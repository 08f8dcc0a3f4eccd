"""`RouteSum`: a MoE layer's top-k sum run inside the residual add + RMSNorm after it
(`moe_reduce_norm_kernel`) gives bitwise what moe_reduce_kernel then
`sparkinfer.norm.add_rms_norm` give (with a shared expert's output, the torch add
between them too), one launch fewer: micro with split FC2 partials, micro with the
router weight before FC2, grouped; poisoned outputs, every element compared.

Interpreted here, where the extra term is the layer's own output (a sum of equal bf16
values is exact: the interpreter truncates where a GPU and torch round to nearest);
tests/moe/test_gpu.py runs `check` compiled with a random extra term.
"""

import pytest
import torch

from sparkinfer.errors import ShapeError
from sparkinfer.moe import MoECaps, MoELayer, MoESpec, RouteSum
from sparkinfer.norm import add_rms_norm

H, I = 64, 256  # I: two K steps of 128, so the heuristic micro plan can split FC2
CASES = [  # id, spec kwargs, T, batch_invariant (False: the heuristic plan splits micro FC2)
    ("micro-split", dict(), 3, False),
    ("micro-weight-before", dict(router_weight_after_fc2=False), 2, True),
    ("grouped", dict(), 20, True),
]


def check(spec, t, batch_invariant, device, exact_extra, seed=0):
    """Run one random layer both ways on `device`; assert the folded sum's bits, return its plan family."""
    g = torch.Generator().manual_seed(seed)
    caps = MoECaps(max_tokens=32, num_experts=8, top_k=2, hidden=H, intermediate=I, num_sms=132,
                   batch_invariant=batch_invariant)
    w1 = (torch.randn(8, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(8, H, I, generator=g) / I ** 0.5).bfloat16()
    layer = MoELayer(caps, spec, (w1, w2), device=device)
    x, logits = torch.randn(t, H, generator=g).bfloat16(), torch.randn(t, 8, generator=g)
    residual, weight = torch.randn(t, H, generator=g).bfloat16(), (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    x, logits, residual, weight = (v.to(device) for v in (x, logits, residual, weight))
    routed = layer(x, logits, out=torch.full((t, H), float("nan"), dtype=torch.bfloat16, device=device))
    extra = routed.clone() if exact_extra else torch.randn(t, H, generator=g).bfloat16().to(device)
    for shared in (None, extra):
        want = add_rms_norm(routed if shared is None else routed + shared, residual, weight, 1e-6)
        s = layer(x, logits, out=torch.empty_like(routed), reduce=False)
        assert isinstance(s, RouteSum)
        s = s if shared is None else s + shared
        nan = [torch.full_like(residual, float("nan")) for _ in range(2)]
        got = s.add_rms_norm(residual, weight, 1e-6, out=nan[0], residual_out=nan[1])
        assert got[0] is nan[0] and got[1] is nan[1]
        for name, a, b in zip(("out", "residual_out"), got, want):
            assert torch.equal(a, b), f"{name} (extra: {shared is not None}) differs from reduce + norm"
    return layer.plan.config_for(t)


@pytest.mark.parametrize("kw,t,invariant", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_folded_top_k_sum_gives_the_bits_of_reduce_then_norm(kw, t, invariant):
    cfg = check(MoESpec(**kw), t, invariant, "cpu", exact_extra=True)
    assert cfg.family == ("micro" if t <= 16 else "grouped")
    if not invariant:
        assert cfg.split2 > 1, "the case meant to sum FC2 partials does not split FC2"


def test_rejects_a_second_extra_term_another_residual_dtype_and_extra_rows():
    caps = MoECaps(max_tokens=4, num_experts=4, top_k=1, hidden=H, intermediate=32, num_sms=8)
    w1, w2 = torch.randn(4, 64, H).bfloat16(), torch.randn(4, H, 32).bfloat16()
    layer = MoELayer(caps, MoESpec(), (w1, w2), device="cpu")
    s = layer(torch.randn(2, H).bfloat16(), torch.randn(2, 4), out=torch.empty(2, H, dtype=torch.bfloat16),
              reduce=False)
    with pytest.raises(ShapeError, match="one extra term"):
        (s + torch.zeros(2, H, dtype=torch.bfloat16)) + torch.zeros(2, H, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match="the sum is"):
        s.add_rms_norm(torch.randn(2, H), torch.ones(H), 1e-6)
    with pytest.raises(ShapeError, match=r"extra \(3, 64\)"):
        (s + torch.zeros(3, H, dtype=torch.bfloat16)).add_rms_norm(torch.randn(2, H).bfloat16(), torch.ones(H), 1e-6)
