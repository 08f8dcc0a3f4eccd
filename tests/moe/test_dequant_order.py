"""The NVFP4 dequantized path sums in the NVFP4 kernels' K order, so a
batch-invariant plan may switch between the two with T (plan.py,
NVFP4_DEQUANT_MIN_ROWS).

The interpreter's dots are fp32 matmuls whose results are then rounded to bf16,
so a layer's outputs compared bitwise (tests/moe/test_fp8_layer.py) hardly ever
see a change of summation order. The order itself is checked here, exactly: the
copies hold each chunk of the weights in `k_order`; FC1's bf16 steps gather x at
`step_k_order`, which walks a chunk in `k_order` whatever the step's BK, and store
FC2's input at `k_position` (its inverse), which FC2 reads in natural order. On
the GPU, tests/moe/test_gpu.py compares the two paths' outputs bitwise at
Qwen3-30B-A3B's dims (T 4096).
"""

import pytest
import torch
import triton
import triton.language as tl

from sparkinfer.moe import MoECaps, MoESpec, TileConfig, allocate_scratch, bind, run
from sparkinfer.moe.kernels.common import k_position, step_k_order
from sparkinfer.quant.nvfp4 import unpack_codes
from sparkinfer.quant.reference import e2m1_codes_to_float
from tests.moe._util import poison_scratch, random_layer


def kernel_order(ch: int) -> list[int]:
    """`k_order` of the NVFP4 kernels in plain Python: the element of a CH chunk
    that logical k reads (k = q0 + 2c + 8 j0 + 16 j1 + 32 u -> (CH/4) c + 8u +
    4 j1 + 2 j0 + q0)."""
    out = []
    for k in range(ch):
        q0, c, j0, j1, u = k % 2, (k // 2) % 4, (k // 8) % 2, (k // 16) % 2, k // 32
        out.append((ch // 4) * c + 8 * u + 4 * j1 + 2 * j0 + q0)
    return out


@triton.jit
def _step_offsets_kernel(p_out, BK: tl.constexpr, CH: tl.constexpr):
    c = tl.program_id(0)
    o_k = tl.arange(0, BK)
    tl.store(p_out + c * BK + o_k, c * BK + step_k_order(o_k, c, BK, CH))


@pytest.mark.parametrize("ch,bk", [(32, 32), (64, 32), (64, 64), (128, 32), (128, 64), (128, 128)])
def test_step_k_order_walks_each_chunk_in_the_kernels_order(ch, bk):
    """Steps of BK over two chunks of CH read, in order, exactly the elements the
    NVFP4 kernels' one CH step reads; CH 0 reads in natural order."""
    out = torch.full((2 * ch,), -1, dtype=torch.int32)
    _step_offsets_kernel[(2 * ch // bk,)](out, BK=bk, CH=ch)
    assert out.tolist() == kernel_order(ch) + [ch + e for e in kernel_order(ch)]
    _step_offsets_kernel[(2 * ch // bk,)](out, BK=bk, CH=0)
    assert out.tolist() == list(range(2 * ch))


@triton.jit
def _positions_kernel(p_el, p_out, N: tl.constexpr, CH: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(p_out + o, k_position(tl.load(p_el + o), CH))


@pytest.mark.parametrize("ch", [32, 64, 128])
def test_k_position_inverts_the_kernels_order(ch):
    """Column j goes to the logical k that reads it: over two chunks, the element read
    at k is stored at k."""
    el = torch.tensor(kernel_order(ch) + [ch + e for e in kernel_order(ch)], dtype=torch.int32)
    out = torch.full((2 * ch,), -1, dtype=torch.int32)
    _positions_kernel[(1,)](el, out, N=2 * ch, CH=ch)
    assert out.tolist() == list(range(2 * ch))


@pytest.mark.parametrize("h,i", [(256, 128), (160, 96)])
def test_dequantized_copies_hold_each_chunk_in_the_kernels_order(h, i):
    """After a call on the dequantized path (all experts in one chunk), the bf16
    scratch holds FC2's copies: code * block scale * 2**-8, exactly, each chunk
    of the plan's K in `k_order` (H 160 / I 96: chunk 32)."""
    caps = MoECaps(max_tokens=32, num_experts=3, top_k=2, hidden=h, intermediate=i)
    p, w, (_, w2), _ = random_layer(caps, MoESpec(weight_format="nvfp4"), seed=5)
    pf = p.forced(TileConfig("grouped", 16, 64, 128, dequant_experts=3, block_k=32))
    scratch = allocate_scratch(pf, "cpu")
    poison_scratch(scratch)
    x, logits = torch.randn(20, h).bfloat16(), torch.randn(20, 3)
    run(bind(pf, scratch, w, x=x, out=torch.empty(20, h, dtype=torch.bfloat16), logits=logits))
    vals = e2m1_codes_to_float(unpack_codes(w2.packed)).reshape(3, h, i // 16, 16)
    natural = (vals * w2.scales.float().unsqueeze(-1) * 2.0 ** -8).reshape(3, h, i)
    ch = p.chunk
    perm = torch.tensor([c * ch + e for c in range(i // ch) for e in kernel_order(ch)])
    copies = scratch["w_bf16"][: 3 * h * i].reshape(3, h, i)
    assert torch.equal(copies.float(), natural[:, :, perm])
