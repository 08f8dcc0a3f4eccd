"""Every kernel family through the Triton interpreter against the fp32 reference.

Small shapes (H 64, I 32, E 4..8, T <= 20): the interpreter is slow.
NVFP4 layers are compared with the reference on their dequantized weights.
"""

import pytest
import torch

from sparkinfer.errors import CapacityError, ShapeError
from sparkinfer.moe import (
    MoECaps,
    MoESpec,
    allocate_scratch,
    bind,
    check_topk_ids,
    moe_reference,
    plan,
    prepare_weights,
    run,
)
from sparkinfer.moe.routing import route_reference
from tests.moe._util import assert_moe_close, random_layer, run_case

CASES = [
    # id, spec kwargs, T, E, K
    ("bf16-silu-micro", dict(), 3, 8, 2),
    ("bf16-silu-grouped", dict(), 20, 8, 2),
    ("nvfp4-silu-micro", dict(weight_format="nvfp4"), 4, 8, 2),
    ("nvfp4-silu-grouped", dict(weight_format="nvfp4"), 18, 4, 2),
    ("nvfp4-silu-grouped-bn1-128", dict(weight_format="nvfp4"), 40, 4, 2),  # 20 rows: BM 64, BN1 128
    ("bf16-relu2-micro", dict(activation="relu2"), 2, 4, 1),
    ("nvfp4-relu2-grouped", dict(weight_format="nvfp4", activation="relu2"), 17, 8, 3),
    ("bf16-swiglu-interleaved-micro", dict(activation="swiglu_oai", gate_up_order="interleaved"),
     5, 8, 2),
    ("bf16-upgate-before-grouped", dict(gate_up_order="up_gate", router_weight_after_fc2=False),
     20, 4, 2),
    ("nvfp4-before-micro", dict(weight_format="nvfp4", router_weight_after_fc2=False), 1, 4, 2),
    ("bf16-sigmoid-grouped-routing-micro",
     dict(routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5), 3, 8, 2),
]


@pytest.mark.parametrize("kw,t,e,k", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_layer_matches_reference(kw, t, e, k):
    spec = MoESpec(**kw)
    b, ref = run_case(spec, t, e, k, max_tokens=max(32, t))
    assert b.config.family == ("micro" if t <= 16 else "grouped")
    if t * k / e > 16 and spec.weight_format == "nvfp4":  # the case runs what its id says
        assert (b.config.block_m, b.config.block_n1) == (64, 128)
    assert torch.isfinite(b.out.float()).all()
    assert_moe_close(b.out, ref)


@pytest.mark.parametrize("act,t", [("silu", 3), ("silu", 18), ("relu2", 2)],
                         ids=["gated-micro", "gated-grouped", "relu2-micro"])
def test_nvfp4_rows_not_a_multiple_of_the_tile(act, t):
    """H 160 (FC2 rows pad to 192), I 96 (gate and up rows share a 64-row tile;
    relu2's 96 FC1 rows pad to 128), chunk 32: five FC1 chunks per row."""
    spec = MoESpec(weight_format="nvfp4", activation=act)
    b, ref = run_case(spec, t, 4, 2, h=160, i=96)
    assert b.plan.chunk == 32 and b.weights.w2.shape[1:3] == (3, 3)
    assert torch.isfinite(b.out.float()).all()
    assert_moe_close(b.out, ref)


SPLITS = [  # id, format, T, num_sms: 132 SMs split tiny micro GEMMs, 1 SM does not
    ("bf16-split", "bf16", 2, 132), ("bf16-unsplit", "bf16", 2, 1),
    ("nvfp4-split", "nvfp4", 5, 132), ("nvfp4-unsplit", "nvfp4", 5, 1),
]


@pytest.mark.parametrize("fmt,t,sms", [c[1:] for c in SPLITS], ids=[c[0] for c in SPLITS])
def test_micro_with_and_without_reduction_splits(fmt, t, sms):
    spec = MoESpec(weight_format=fmt, router_weight_after_fc2=False, activation="swiglu_oai")
    b, ref = run_case(spec, t, 8, 2, num_sms=sms, batch_invariant=False)
    assert (b.config.split1 > 1) == (sms > 1)  # FC2's I = 32 is one chunk: never split
    assert_moe_close(b.out, ref)


@pytest.mark.parametrize("fmt,t", [("bf16", 3), ("nvfp4", 19)], ids=["micro", "grouped"])
def test_deterministic_bitwise_across_repeats(fmt, t):
    spec = MoESpec(weight_format=fmt)
    b, _ = run_case(spec, t, 8, 2)
    first = b.out.clone()
    for _ in range(2):
        b.out.fill_(float("nan"))
        run(b)
        assert torch.equal(b.out, first)


MIXTRAL = dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336)


@pytest.mark.parametrize("decode", ["arith", "ptx"])
def test_mixtral_micro_tiling_repeats_bitwise(decode):
    """The launch config the Mixtral shape gets at T 4 (micro, BK 128, BN 64,
    no splits, E 8 / K 2 so tokens share experts), forced on H 256 / I 384 so each
    program loops over several chunks: 3 repeats bitwise equal, the reference
    met, and the ptx config (arith math under the interpreter) the same bits.
    The GPU twin at the real dims is in test_gpu.py."""
    spec = MoESpec(weight_format="nvfp4")
    caps = MoECaps(max_tokens=16, num_experts=8, top_k=2, hidden=256, intermediate=384,
                   num_sms=1)
    p, w, src, scratch = random_layer(caps, spec, seed=5)
    real = plan(MoECaps(max_tokens=16, **MIXTRAL), spec).with_changes(decode=decode)
    p = p.forced(real.config_for(4))  # the small shape's own grid sizes pick other tiles
    assert p.chunk == real.chunk == 128 and p.config_for(4).family == "micro"
    x = torch.randn(4, 256).bfloat16()
    ids = torch.tensor([[3, 5], [5, 3], [0, 3], [5, 7]], dtype=torch.int32)
    tw = torch.rand(4, 2)
    out = torch.full((4, 256), float("nan"), dtype=torch.bfloat16)
    b = bind(p, scratch, w, x=x, out=out, topk_ids=ids, topk_weights=tw)
    run(b)
    first = out.clone()
    assert_moe_close(first, moe_reference(x, src, (ids, tw), spec=spec))
    for _ in range(2):
        out.fill_(float("nan"))
        run(b)
        assert torch.equal(out, first)


def test_out_of_range_ids_contribute_nothing_and_are_rejected_eagerly():
    spec = MoESpec()
    caps = MoECaps(max_tokens=32, num_experts=4, top_k=2, hidden=64, intermediate=32)
    p, w, src, scratch = random_layer(caps, spec)
    for t in (3, 20):  # micro and grouped
        x = torch.randn(t, 64).bfloat16()
        first = torch.randint(0, 4, (t,))
        ids = torch.stack([first, (first + torch.randint(1, 4, (t,))) % 4], 1).to(torch.int32)
        ids[0, 1], ids[1, 0] = 7, -1  # outside [0, 4)
        tw = torch.rand(t, 2)
        out = torch.full((t, 64), float("nan"), dtype=torch.bfloat16)
        run(bind(p, scratch, w, x=x, out=out, topk_ids=ids, topk_weights=tw))
        ref = moe_reference(x, src, (ids, tw), spec=spec)
        assert_moe_close(out, ref)
        with pytest.raises(CapacityError, match=r"outside \[0, E=4\)"):
            check_topk_ids(ids, 4)
    check_topk_ids(torch.tensor([[0, 3], [2, 1]], dtype=torch.int32), 4)
    with pytest.raises(ShapeError, match="row 1 names an expert twice"):
        check_topk_ids(torch.tensor([[0, 3], [2, 2]], dtype=torch.int32), 4)


def test_tensor_parallel_shards_sum_to_full_layer():
    spec = MoESpec()
    full = MoECaps(max_tokens=8, num_experts=4, top_k=2, hidden=64, intermediate=64)
    p, w, src, scratch = random_layer(full, spec)
    x = torch.randn(3, 64).bfloat16()
    logits = torch.randn(3, 4)
    ref = moe_reference(x, src, route_reference(logits, spec, 2), spec=spec)
    total = torch.zeros(3, 64)
    for rank in range(2):
        caps = MoECaps(max_tokens=8, num_experts=4, top_k=2, hidden=64, intermediate=32,
                       tp_rank=rank, tp_size=2)
        pr = plan(caps, spec)
        b = bind(pr, allocate_scratch(pr, "cpu"), prepare_weights(pr, *src), x=x, logits=logits)
        run(b)
        total += b.out.float()
    assert_moe_close(total, ref)


def test_moe_layer_wrapper_eager_and_with_out():
    from sparkinfer.moe import MoELayer
    from sparkinfer.moe.routing.launch import route

    spec = MoESpec(weight_format="nvfp4", routing="sigmoid_grouped", n_group=2, topk_group=1)
    caps = MoECaps(max_tokens=8, num_experts=4, top_k=2, hidden=64, intermediate=32)
    _, _, src, _ = random_layer(caps, spec)
    bias = torch.randn(4)
    layer = MoELayer(caps, spec, src, device="cpu", bias=bias)
    x, logits = torch.randn(2, 64).bfloat16(), torch.randn(2, 4)
    got = layer(x, logits)
    ref = moe_reference(x, src, route_reference(logits, spec, 2, bias=bias), spec=spec)
    assert_moe_close(got, ref)
    out = torch.full((2, 64), float("nan"), dtype=torch.bfloat16)
    assert layer(x, logits, out=out) is out and torch.equal(out, got)
    # the kernels' own routing: the reference's weights may differ from it in the last bit
    ids, tw = torch.empty(2, 2, dtype=torch.int32), torch.empty(2, 2)
    route(logits, spec, (ids, tw), bias=bias)
    assert torch.equal(layer.forward_topk(x, (ids, tw)), got)


@pytest.mark.parametrize("kw", [dict(), dict(routing="sigmoid_grouped", n_group=4, topk_group=2)],
                         ids=["softmax", "sigmoid-grouped"])
def test_nan_logit_gives_a_nan_row(kw):
    """A token with a NaN router logit: its output row is NaN (the reference's),
    never silent zeros from an out-of-range expert id; other rows are exact to the reference."""
    spec = MoESpec(**kw)
    t, e, k, h = 3, 8, 2, 64
    caps = MoECaps(max_tokens=32, num_experts=e, top_k=k, hidden=h, intermediate=32, num_sms=132)
    p, w, src, scratch = random_layer(caps, spec)
    x = torch.randn(t, h).bfloat16()
    logits = torch.randn(t, e)
    logits[1, 3] = float("nan")
    bias = torch.randn(e) if spec.routing == "sigmoid_grouped" else None
    out = torch.full((t, h), 7.0, dtype=torch.bfloat16)
    b = bind(p, scratch, w, x=x, out=out, logits=logits, bias=bias)
    run(b)
    ref = moe_reference(x, src, route_reference(logits, spec, k, bias=bias), spec=spec)
    assert b.out[1].isnan().all() and ref[1].isnan().all()
    assert_moe_close(b.out[[0, 2]], ref[[0, 2]])


def test_moe_layer_rejects_three_weights():
    from sparkinfer.moe import MoELayer

    caps = MoECaps(max_tokens=8, num_experts=4, top_k=2, hidden=64, intermediate=32)
    w = torch.zeros(4, 64, 64)
    with pytest.raises(ShapeError, match=r"weights must be \(w1, w2\).*got 3 tensors"):
        MoELayer(caps, MoESpec(), (w, w, w), device="cpu")
