"""The loaded weights, read with the maths `ModelSpec` documents (rotate_half rotary
on the leading rotary_dim of each head, q/k norm before rotary, routing by
`route_reference`), reproduce transformers' fp32 logits: the contract means what
the decoder will assume it means.

Legend: T tokens, D head dim, K top-k.
"""

import pytest
import torch
import transformers

from sparkinfer.models import Checkpoint, DenseMLPWeights, Sharding, load_spec, load_weights
from sparkinfer.models.config import rope_inv_freq
from sparkinfer.moe.routing.reference import route_reference
from sparkinfer.moe.spec import MoESpec
from tests.models.conftest import PRESETS


def rms(x, w, eps):
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, spec):  # x [T, heads, D]
    rd = spec.rotary_dim
    angles = torch.arange(x.shape[0])[:, None].float() * rope_inv_freq(spec)  # [T, rd/2]
    emb = torch.cat([angles, angles], -1)[:, None]
    xr, xp = x[..., :rd], x[..., rd:]
    rotated = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
    return torch.cat([xr * emb.cos() + rotated * emb.sin(), xp], -1)


def gated(x, gate_up, down):
    g, u = (x @ gate_up.float().T).chunk(2, -1)
    return (torch.nn.functional.silu(g) * u) @ down.float().T


def reference_forward(w, spec, ids):
    t, d = ids.shape[0], spec.head_dim
    h = w.embed.float()[ids]
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    for layer in w.layers:
        a = layer.attn
        x = rms(h, layer.input_norm, spec.rms_eps)
        qkv = x @ a.qkv.float().T + (a.qkv_bias.float() if a.qkv_bias is not None else 0)
        q, k, v = (z.view(t, -1, d) for z in qkv.split(
            [spec.num_heads * d, a.kv_heads * d, a.kv_heads * d], -1))
        if spec.qk_norm:
            q, k = rms(q, a.q_norm, spec.rms_eps), rms(k, a.k_norm, spec.rms_eps)
        q, k = rope(q, spec), rope(k, spec)
        group = spec.num_heads // spec.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("thd,shd->hts", q, k) * spec.attn_scale
        o = torch.einsum("hts,shd->thd", s.masked_fill(causal, float("-inf")).softmax(-1), v)
        h = h + o.reshape(t, -1) @ a.o.float().T
        x = rms(h, layer.post_attn_norm, spec.rms_eps)
        m = layer.mlp
        if isinstance(m, DenseMLPWeights):
            h = h + gated(x, m.gate_up, m.down)
            continue
        moe = MoESpec(routing=spec.routing, renormalize=spec.renormalize, n_group=spec.n_group,
                      topk_group=spec.topk_group,
                      routed_scaling_factor=spec.routed_scaling_factor)
        ids_k, wts = route_reference(x @ m.router.float().T, moe, spec.top_k,
                                     bias=m.correction_bias)  # [T, K]
        y = torch.stack([sum(wts[i, j] * gated(x[i], m.w1[ids_k[i, j]], m.w2[ids_k[i, j]])
                             for j in range(spec.top_k)) for i in range(t)])
        if m.shared is not None:
            y = y + gated(x, m.shared.gate_up, m.shared.down)
        h = h + y
    return rms(h, w.final_norm, spec.rms_eps) @ w.lm_head.float().T


CASES = [(p, {}) for p in PRESETS] + [("glm4_moe-tiny", {"use_qk_norm": True})]


@pytest.mark.parametrize("preset,over", CASES, ids=[*PRESETS, "glm4_moe-tiny-qk_norm"])
def test_documented_maths_reproduce_transformers(preset, over, ckpt_dir):
    path = ckpt_dir(preset, **over)
    spec = load_spec(path)
    weights = load_weights(Checkpoint(path), spec, Sharding())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(0))
    want = hf(ids[None]).logits[0]
    got = reference_forward(weights, spec, ids)[:, :spec.vocab_size]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # fp32 both; seen: 4e-6
    assert torch.equal(got.argmax(-1), want.argmax(-1))
