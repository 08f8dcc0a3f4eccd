"""GPU checks (skipped without CUDA or under the interpreter): every family and
weight format against the fp32 reference (its own routing; cosine, relative
error norm and worst element, `tests/moe/_util.check_moe`) at a mid-size shape, PTX and arithmetic
NVFP4 decodes bitwise equal, CUDA-graph replay bitwise equal to eager; the
Mixtral micro case repeated and replayed bitwise with both decodes; fp8_block
at the four benchmark shapes (format reference, repeats and replays bitwise);
the NVFP4 dequantized path against the NVFP4 kernels; the top-k sum folded into the
norm after the layer (test_route_sum.py) bitwise against reduce then norm."""

import os

import pytest
import torch

from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, moe_reference, plan, prepare_weights, run
from sparkinfer.moe.routing import route_reference
from sparkinfer.moe.tuning import _other_nvfp4_path
from sparkinfer.quant import FP8BlockTensor, NVFP4Tensor
from tests.moe import test_route_sum
from tests.moe._util import assert_moe_close, poison_scratch, random_layer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset)")

# fp8_block once missed these bounds on the H200 (rel_norm 1.0-1.7e-2, 1d96f7d) while the
# interpreter met them: the REFERENCE was wrong on CUDA, not the kernels. quantize_fp8_groups
# wrote its scale as `amax / 448.0`, which torch on CUDA computes as amax * fl32(1/448): 1 fp32
# ulp off for about half the groups, so x codes at rounding ties differed from the kernels'
# div.rn ones and the reference's own E4M3 rounding of FC2's input amplified that to ~1.4e-2
# (tests/moe/test_fp8_layer.py emulates CUDA's division on the CPU). Fixed by dividing tensor by
# tensor in sparkinfer/quant/fp8.py.
# At 0467373 dsv3_tp8-T1 (and once fp8_block-T1) failed only after other test files had run
# in the process: the inputs came from the global RNG those files had advanced. That draw,
# replayed alone, gives the same rel_norm 1.60e-2; the GPU reference equals the CPU one
# (4.8e-7), and FC2 run on the kernel's own FC2 input matches its output to 1.6e-3, so the
# whole excess is FC2's E4M3 input: Hopper's e4m3 accumulation (FC1 off by 1.8e-4) flips 32
# of 2048 codes, as for any draw, but here one of the 3 in the top-weighted route sits on a
# large element (a coarse E4M3 step). One token has no other rows to average that over (an
# unrecorded diagnostic: other draws stayed under 1e-2). Hence `_seeded` below, and
# scratch poisoned before each first run (no stale memory can matter either; initcheck clean).


@pytest.fixture(autouse=True)
def _seeded():
    """Each case draws its inputs from one seed, whatever ran before it in the process."""
    torch.manual_seed(0)


CASES = [pytest.param(fmt, t, id=f"{fmt}-T{t}")
         for fmt in ("nvfp4", "bf16", "fp8_block") for t in (1, 5, 16, 40, 300)]


def _cuda(w):
    if isinstance(w, NVFP4Tensor):
        return NVFP4Tensor(w.packed.cuda(), w.scales.cuda(), w.global_scale.cuda())
    return w.cuda() if isinstance(w, torch.Tensor) else w.to("cuda")


@pytest.mark.parametrize("fmt,t", CASES)
def test_gpu_layer_matches_reference_and_replays_bitwise(fmt, t):
    spec = MoESpec(weight_format=fmt, routing="sigmoid_grouped", n_group=4, topk_group=2)
    caps = MoECaps(max_tokens=512, num_experts=32, top_k=4, hidden=1024, intermediate=512)
    p, _, src, _ = random_layer(caps, spec)
    src = tuple(_cuda(s) for s in src)
    w = prepare_weights(p, *src)
    scratch = allocate_scratch(p, "cuda")
    poison_scratch(scratch)
    x = torch.randn(t, 1024, device="cuda").bfloat16()
    logits = torch.randn(t, 32, device="cuda")
    bias = torch.randn(32, device="cuda") * 0.1
    out = torch.full((t, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    b = bind(p, scratch, w, x=x, out=out, logits=logits, bias=bias)
    run(b)
    eager = out.clone()
    # the reference routes by itself: a routing bug shows as an error here
    ref = moe_reference(x, src, route_reference(logits, spec, 4, bias=bias), spec=spec)
    assert_moe_close(eager, ref, fmt)
    if fmt == "nvfp4":  # both decodes are exact: same bits (the plan's is arith)
        pa = p.with_changes(decode="ptx")
        out.fill_(float("nan"))
        run(bind(pa, scratch, w, x=x, out=out, logits=logits, bias=bias))
        assert torch.equal(out, eager)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(b)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)



def _repeats_and_replays_bitwise(b, out, first, *, repeats: int, replays: int) -> None:
    """run(b) `repeats` times eagerly, then a CUDA graph of it `replays` times, each into a
    poisoned `out`: every result must equal `first` bitwise."""
    for _ in range(repeats):
        out.fill_(float("nan"))
        run(b)
        assert torch.equal(out, first)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(b)
    for _ in range(replays):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)

MIXTRAL = dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336)


def _random_nvfp4(e, n, r, gen):
    """Random codes, E4M3 scales in [0.5, 1.875], global ~ 1/(3 sqrt(r)) (as `sparkinfer bench moe`)."""
    dev = dict(device="cuda", generator=gen)
    packed = torch.randint(0, 256, (e, n, r // 2), dtype=torch.uint8, **dev)
    scales = torch.randint(0x30, 0x40, (e, n, r // 16), dtype=torch.uint8, **dev)
    gs = torch.full((e,), 1.0 / (3.0 * r ** 0.5), dtype=torch.float32, device="cuda")
    return NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), gs)


@pytest.mark.parametrize("decode", ["arith", "ptx"])
def test_gpu_mixtral_micro_nvfp4_repeats_bitwise(decode):
    """Mixtral dims, T 4 (micro, no splits): the H200 run at adb4721 saw the ptx
    decode give different bits on repeats here. 20 repeats and 5 replays must
    equal the first run bit for bit, and ptx must equal arith."""
    caps = MoECaps(max_tokens=16, **MIXTRAL)
    spec = MoESpec(weight_format="nvfp4")
    p = plan(caps, spec).with_changes(decode=decode)
    e, h, i = MIXTRAL["num_experts"], MIXTRAL["hidden"], MIXTRAL["intermediate"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = (_random_nvfp4(e, 2 * i, h, gen), _random_nvfp4(e, h, i, gen))
    w = prepare_weights(p, *src)
    scratch = allocate_scratch(p, "cuda")
    poison_scratch(scratch)
    x = torch.randn(4, h, device="cuda").bfloat16()
    logits = torch.randn(4, e, device="cuda")
    out = torch.full((4, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    b = bind(p, scratch, w, x=x, out=out, logits=logits)
    assert b.config.family == "micro" and (b.config.split1, b.config.split2) == (1, 1)
    run(b)
    first = out.clone()
    assert_moe_close(first, moe_reference(x, src, route_reference(logits, spec, 2), spec=spec))
    _repeats_and_replays_bitwise(b, out, first, repeats=20, replays=5)
    out.fill_(float("nan"))
    run(bind(p.with_changes(decode="arith"), scratch, w, x=x, out=out, logits=logits))
    assert torch.equal(out, first)


SHAPES = {
    "dsv3": dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048),
    "qwen3": dict(num_experts=128, top_k=8, hidden=2048, intermediate=768),
    "mixtral": dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336),
    "dsv3_tp8": dict(num_experts=256, top_k=8, hidden=7168, intermediate=256),
}
FP8_CASES = [(s, t) for s in SHAPES for t in (1, 8, 64, 1024)]


def _random_fp8(e, n, r, gen):
    """E4M3 codes of magnitude 2**-3..2**3 (exponent fields 4..10, any
    mantissa and sign) and block scales ~ 1/(4 sqrt(r)): weights of about the
    size a trained layer has, no NaN codes."""
    dev = dict(device=gen.device, generator=gen)
    # in place, two code-sized tensors at most: DeepSeek-V3's fc1 codes are 7 GiB, and
    # out-of-place shifts and ors peaked near six of them, which ran an 80 GB H100 out of
    # memory beside three other test workers (gpu_tests_h100.json)
    codes = torch.randint(0, 2, (e, n, r), dtype=torch.uint8, **dev).bitwise_left_shift_(7)
    codes |= torch.randint(4, 11, (e, n, r), dtype=torch.uint8, **dev).bitwise_left_shift_(3)
    codes |= torch.randint(0, 8, (e, n, r), dtype=torch.uint8, **dev)
    nb, kb = -(-n // 128), -(-r // 128)
    scale = (torch.rand(e, nb, kb, **dev) + 0.5) / (4.0 * r ** 0.5)
    return FP8BlockTensor(codes.view(torch.float8_e4m3fn), scale)


@pytest.mark.parametrize("shape,t", FP8_CASES, ids=[f"{s}-T{t}" for s, t in FP8_CASES])
def test_gpu_fp8_bench_shapes(shape, t):
    """fp8_block at the benchmark shapes against the format's reference
    (dequantized weights, E4M3 activations per 128; `assert_moe_close`), 3
    repeats and 3 graph replays bitwise equal."""
    dims = SHAPES[shape]
    spec = MoESpec(weight_format="fp8_block")
    p = plan(MoECaps(max_tokens=1024, **dims), spec)
    e, h, i = dims["num_experts"], dims["hidden"], dims["intermediate"]
    gen = torch.Generator(device="cuda").manual_seed(t)
    src = (_random_fp8(e, 2 * i, h, gen), _random_fp8(e, h, i, gen))
    w = prepare_weights(p, *src)
    scratch = allocate_scratch(p, "cuda")
    poison_scratch(scratch)
    x = torch.randn(t, h, device="cuda").bfloat16()
    logits = torch.randn(t, e, device="cuda")
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    b = bind(p, scratch, w, x=x, out=out, logits=logits)
    run(b)
    first = out.clone()
    # the reference routes by itself: a routing bug shows as an error here
    ref = moe_reference(x, src, route_reference(logits, spec, dims["top_k"]), spec=spec)
    assert_moe_close(first, ref, "fp8_block")
    _repeats_and_replays_bitwise(b, out, first, repeats=3, replays=3)


def test_gpu_nvfp4_dequantized_path_matches_the_kernels():
    """Qwen3 dims at T 4096 (256 rows per expert): the path that decodes to bf16 in chunks
    of 85 experts (the sweep's "dequant", planned from 2,048 rows) against the planned
    NVFP4 grouped kernels (BN1 128): the same bits (the copies keep the kernels' K
    order), both against the reference; graph replay bitwise."""
    dims = SHAPES["qwen3"]
    spec = MoESpec(weight_format="nvfp4")
    off = plan(MoECaps(max_tokens=4096, **dims), spec)
    name, cfg = _other_nvfp4_path(off, 4096)
    p = off.forced(cfg)
    assert name == "dequant" and cfg.dequant_experts == 85 and not off.config_for(4096).dequant_experts
    assert off.config_for(4096).block_n1 == 128
    e, h, i = dims["num_experts"], dims["hidden"], dims["intermediate"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    src = (_random_nvfp4(e, 2 * i, h, gen), _random_nvfp4(e, h, i, gen))
    x = torch.randn(4096, h, device="cuda").bfloat16()
    logits = torch.randn(4096, e, device="cuda")
    outs = []
    for pp in (p, off):
        out = torch.full((4096, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        b = bind(pp, allocate_scratch(pp, "cuda"), prepare_weights(pp, *src), x=x, out=out,
                 logits=logits)
        run(b)
        outs.append(out.clone())
        ref = moe_reference(x, src, route_reference(logits, spec, dims["top_k"]), spec=spec)
        assert_moe_close(out, ref)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run(b)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, outs[-1])
    assert torch.equal(outs[0], outs[1])


GLM_AIR_TP8 = dict(num_experts=128, top_k=8, hidden=4096)  # I = 1408 / 8 = 176 per rank
PADDED = [(fmt, i, t) for fmt, sizes in (("bf16", (16, 24, 48, 176)), ("nvfp4", (16, 48, 176)))
          for i in sizes for t in (1, 8, 64, 512)]


@pytest.mark.parametrize("fmt,i,t", PADDED, ids=[f"{f}-I{i}-T{t}" for f, i, t in PADDED])
def test_gpu_padded_intermediate_matches_reference(fmt, i, t):
    """Per-rank I that no chunk divides, at GLM-4.5-Air's E, K, H (its TP 8 shard is I 176;
    Qwen3-30B-A3B's TP 16 shard 48): the layer runs I padded to a multiple of 32 with zero
    weights, against the fp32 reference of the unpadded weights, micro (T 1, 8) and grouped
    (T 64, 512); a CUDA-graph replay bitwise equal to eager."""
    spec = MoESpec(weight_format=fmt)
    p = plan(MoECaps(max_tokens=512, intermediate=i, **GLM_AIR_TP8), spec)
    assert p.intermediate == -(-i // 32) * 32 > i
    e, h = GLM_AIR_TP8["num_experts"], GLM_AIR_TP8["hidden"]
    gen = torch.Generator(device="cuda").manual_seed(i * 1000 + t)
    if fmt == "nvfp4":
        src = (_random_nvfp4(e, 2 * i, h, gen), _random_nvfp4(e, h, i, gen))
    else:
        src = (torch.randn(e, 2 * i, h, device="cuda", generator=gen).mul_(h ** -0.5).bfloat16(),
               torch.randn(e, h, i, device="cuda", generator=gen).mul_(i ** -0.5).bfloat16())
    _padded_case(p, src, t, spec)


def test_gpu_padded_nvfp4_dequantized_path():
    """The NVFP4 path that decodes experts to bf16 (8 experts, top-2, T 1024: 256 rows per
    expert, forced: planned from 2,048) at I 176, padded to 192, against the reference."""
    spec = MoESpec(weight_format="nvfp4")
    p = plan(MoECaps(max_tokens=1024, num_experts=8, top_k=2, hidden=4096, intermediate=176,
                     batch_invariant=False), spec)
    p = p.forced(_other_nvfp4_path(p, 1024)[1])
    assert p.config_for(1024).dequant_experts > 0 and p.intermediate == 192
    gen = torch.Generator(device="cuda").manual_seed(7)
    _padded_case(p, (_random_nvfp4(8, 352, 4096, gen), _random_nvfp4(8, 4096, 176, gen)), 1024, spec)


def _padded_case(p, src, t, spec):
    e, h = p.caps.num_experts, p.caps.hidden
    scratch = allocate_scratch(p, "cuda")
    poison_scratch(scratch)
    x = torch.randn(t, h, device="cuda").bfloat16()
    logits = torch.randn(t, e, device="cuda")
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    b = bind(p, scratch, prepare_weights(p, *src), x=x, out=out, logits=logits)
    run(b)
    first = out.clone()
    ref = moe_reference(x, src, route_reference(logits, spec, p.caps.top_k), spec=spec)
    assert_moe_close(first, ref, spec.weight_format)
    _repeats_and_replays_bitwise(b, out, first, repeats=1, replays=2)


@pytest.mark.parametrize("case", [c[0] for c in test_route_sum.CASES])
def test_gpu_the_folded_top_k_sum_gives_the_bits_of_reduce_then_norm(case):
    """tests/moe/test_route_sum.py compiled, with a random shared-expert term (rounded to nearest)."""
    _, kw, t, invariant = next(c for c in test_route_sum.CASES if c[0] == case)
    test_route_sum.check(MoESpec(**kw), t, invariant, "cuda", exact_extra=False, seed=3)
