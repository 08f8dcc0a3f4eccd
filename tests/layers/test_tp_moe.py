"""The tensor-parallel MoE block on 2, 4 and 8 CPU ranks: every rank runs the
interpreted MoE kernels on its shard of I, then the fused all-reduce + residual
+ RMSNorm; the result matches the unsharded fp32 reference and is bitwise the
same on every rank. Both outputs are checked by the MoE suite's one check
(`sparkinfer.moe.reference.compare_to_reference`), which sees magnitude."""

import pytest
import torch

from sparkinfer.runtime import run_ranks

H, I_FULL, E, K, T = 64, 256, 4, 2, 3


def _block(world, fmt):
    from sparkinfer.comm import Communicator
    from sparkinfer.layers import TPMoEBlock
    from sparkinfer.moe import MoECaps, MoESpec, moe_reference
    from sparkinfer.moe.reference import compare_to_reference
    from sparkinfer.moe.routing import route_reference
    from sparkinfer.quant import quantize_nvfp4

    W = world.world_size
    g = torch.Generator().manual_seed(1234)  # same weights and inputs on every rank
    w1 = torch.randn(E, 2 * I_FULL, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I_FULL, generator=g) / I_FULL ** 0.5
    x = torch.randn(T, H, generator=g).bfloat16()
    logits = torch.randn(T, E, generator=g)
    residual = torch.randn(T, H, generator=g).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    if fmt == "nvfp4":
        w1, w2 = quantize_nvfp4(w1), quantize_nvfp4(w2)
    else:
        w1, w2 = w1.bfloat16(), w2.bfloat16()
    spec = MoESpec(weight_format=fmt)
    comm = Communicator(capacity_bytes=1 << 16, timeout_s=300)
    caps = MoECaps(max_tokens=8, num_experts=E, top_k=K, hidden=H, intermediate=I_FULL // W)
    block = TPMoEBlock(comm, caps, spec, (w1, w2), norm_w, eps=1e-5)
    out, res_out = block(x, logits, residual)
    # fp32 reference of the whole (unsharded) layer
    moe = moe_reference(x, (w1, w2), route_reference(logits, spec, K), spec=spec)
    r_ref = residual.float() + moe
    o_ref = r_ref * torch.rsqrt(r_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()
    comm.close()
    # the MoE suite's check (cosine, relative error norm, worst element; bounds
    # in sparkinfer.moe.reference.TOLERANCES) on residual + MoE and on the norm
    c_r, c_o = compare_to_reference(res_out, r_ref), compare_to_reference(out, o_ref)
    return str(c_r) if not c_r.ok else "", str(c_o) if not c_o.ok else "", \
        out.view(torch.int16).tolist(), res_out.view(torch.int16).tolist()


@pytest.mark.parametrize("world,fmt", [(2, "bf16"), (4, "nvfp4"), (8, "bf16")], ids=["2r-bf16", "4r-nvfp4", "8r-bf16"])
def test_tp_moe_block_matches_unsharded_reference(world, fmt):
    res = run_ranks(_block, world, backend="cpu", args=(fmt,), timeout_s=1200)
    for bad_r, bad_o, _, _ in res:  # "" when the check passed, else what it saw
        assert not bad_r and not bad_o, f"residual + MoE: {bad_r or 'ok'}; normed: {bad_o or 'ok'}"
    assert all(r[2] == res[0][2] and r[3] == res[0][3] for r in res)  # bitwise the same on every rank
