"""GPU checks (skipped without CUDA or under the interpreter): every family and
weight format against the reference at a mid-size shape, PTX and arithmetic
NVFP4 decodes bitwise equal, CUDA-graph replay bitwise equal to eager."""

import os

import pytest
import torch

from sparkinfer.moe import (MoECaps, MoESpec, allocate_scratch, bind, moe_reference,
                            prepare_weights, run)
from sparkinfer.quant import NVFP4Tensor

from tests.moe._util import cosine, random_layer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset)")

CASES = [(fmt, t) for fmt in ("nvfp4", "bf16") for t in (1, 5, 16, 40, 300)]


@pytest.mark.parametrize("fmt,t", CASES, ids=[f"{f}-T{t}" for f, t in CASES])
def test_gpu_layer_matches_reference_and_replays_bitwise(fmt, t):
    spec = MoESpec(weight_format=fmt, routing="sigmoid_grouped", n_group=4, topk_group=2)
    caps = MoECaps(max_tokens=512, num_experts=32, top_k=4, hidden=1024, intermediate=512)
    p, _, src, _ = random_layer(caps, spec)
    src = tuple(s.cuda() if isinstance(s, torch.Tensor) else NVFP4Tensor(
        s.packed.cuda(), s.scales.cuda(), s.global_scale.cuda()) for s in src)
    w = prepare_weights(p, *src)
    scratch = allocate_scratch(p, "cuda")
    x = torch.randn(t, 1024, device="cuda").bfloat16()
    logits = torch.randn(t, 32, device="cuda")
    bias = torch.randn(32, device="cuda") * 0.1
    out = torch.full((t, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    b = bind(p, scratch, w, x=x, out=out, logits=logits, bias=bias)
    run(b)
    eager = out.clone()
    ref = moe_reference(x, src, (b.topk_ids, b.topk_weights), spec=spec)
    assert cosine(eager, ref) >= 0.9999
    if fmt == "nvfp4":  # both decodes are exact: same bits
        pa = p.with_changes(decode="arith")
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
