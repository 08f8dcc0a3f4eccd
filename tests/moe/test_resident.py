"""The `resident` family (one cooperative kernel) through the Triton interpreter.

The interpreter runs one program (programs run one after another there, so
waits between programs could not be served); the GPU tests run the full grid.
The resident kernel does the micro family's tiles, splits and sums in the same
order, so its output is bitwise the micro family's.
"""

import dataclasses

import pytest
import torch

from sparkinfer.errors import KernelWaitTimeout, PlanError
from sparkinfer.moe import (
    MoECaps,
    MoESpec,
    allocate_scratch,
    bind,
    moe_reference,
    plan_supports_aux_stream_overlap,
    resident_status,
    run,
)
from sparkinfer.moe.routing import route_reference
from tests.moe._util import cosine, random_layer

CASES = [
    # id, spec kwargs, T, E, K, H, I, num_sms (132 splits FC1, 1 does not)
    ("bf16-silu-split", dict(), 3, 8, 2, 64, 32, 132),
    ("nvfp4-silu-unsplit", dict(weight_format="nvfp4"), 4, 8, 2, 64, 32, 1),
    ("nvfp4-swiglu-before-split", dict(weight_format="nvfp4", activation="swiglu_oai",
                                       router_weight_after_fc2=False), 2, 4, 2, 64, 32, 132),
    ("nvfp4-relu2-odd-rows", dict(weight_format="nvfp4", activation="relu2"), 3, 4, 2, 160, 96, 132),
    ("bf16-silu-odd-rows-split", dict(), 1, 4, 2, 160, 96, 132),
]


def _layer(kw, t, e, k, h, i, sms):
    spec = MoESpec(**kw)
    caps = MoECaps(max_tokens=16, num_experts=e, top_k=k, hidden=h, intermediate=i, num_sms=sms)
    p, w, src, _ = random_layer(caps, spec)
    cfg = p.config_for(t)
    assert cfg.family == "micro"
    pr = p.forced(dataclasses.replace(cfg, family="resident", grid_per_sm=2, prefetch=1))
    x = torch.randn(t, h).bfloat16()
    logits = torch.randn(t, e)
    return spec, p, pr, w, src, x, logits


def _run(p, w, x, logits, scratch=None):
    scratch = scratch if scratch is not None else allocate_scratch(p, "cpu")
    out = torch.full((x.shape[0], p.caps.hidden), float("nan"), dtype=torch.bfloat16)
    run(bind(p, scratch, w, x=x, out=out, logits=logits))
    return out, scratch


@pytest.mark.parametrize("kw,t,e,k,h,i,sms", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_resident_is_bitwise_micro_and_matches_reference(kw, t, e, k, h, i, sms):
    spec, p, pr, w, src, x, logits = _layer(kw, t, e, k, h, i, sms)
    assert (pr.config_for(t).split1 > 1) == (sms > 1 and t * k * -(-i // 64) < 66)
    out_micro, _ = _run(p, w, x, logits)
    out, scratch = _run(pr, w, x, logits)
    ref = moe_reference(x, src, route_reference(logits, spec, k), spec=spec)
    assert torch.isfinite(out.float()).all()
    assert cosine(out, ref) >= 0.9999
    assert torch.equal(out.view(torch.int16), out_micro.view(torch.int16))
    assert not scratch["resident_sync"].any(), "counters must be zero when the kernel ends"
    resident_status(scratch)
    # the same scratch again (as a replay would): same bits
    x.copy_(torch.randn_like(x.float()).bfloat16())
    out2, _ = _run(pr, w, x, logits, scratch)
    out2_micro, _ = _run(p, w, x, logits)
    assert torch.equal(out2.view(torch.int16), out2_micro.view(torch.int16))


def test_wait_that_never_completes_times_out_and_is_reported():
    spec, p, pr, w, src, x, logits = _layer(dict(), 2, 8, 2, 64, 32, 132)
    assert pr.config_for(2).split1 > 1
    scratch = allocate_scratch(pr, "cpu")
    rm, nb1 = scratch["fc1_act"].shape[0], 1
    scratch["resident_sync"][4 + rm:4 + rm + rm * nb1] = 100  # split counters never reach "last"
    _run(pr, w, x, logits, scratch)
    with pytest.raises(KernelWaitTimeout, match="route slot 0") as ei:
        resident_status(scratch)
    assert ei.value.slot == 0


def test_resident_plans_are_not_overlap_safe_and_reject_large_batches():
    spec, p, pr, w, src, x, logits = _layer(dict(), 2, 8, 2, 64, 32, 132)
    assert plan_supports_aux_stream_overlap(p)
    assert not plan_supports_aux_stream_overlap(pr)
    big = torch.randn(16 + 1, 64).bfloat16()
    caps = dataclasses.replace(p.caps, max_tokens=32)
    pr32 = dataclasses.replace(pr, caps=caps, buckets=((32, pr.buckets[0][1]),))
    with pytest.raises(PlanError, match="resident family serves T <= block_m=16"):
        bind(pr32, allocate_scratch(pr32, "cpu"), w, x=big, logits=torch.randn(17, 8))
