"""The decoder's kernels written with torch ops: the baseline the decode benchmark
runs beside ours (same model code, same weights), and a second opinion in tests.

Legend: B rows, Q queries per row, T = B * Q tokens, Hq / KVH heads, D head dim,
L cache positions, E experts, K top-k, H hidden.

Attention is `scaled_dot_product_attention` over the gathered cache slots with a
causal position mask; RMSNorm and rotary are elementwise torch; the MoE routes
with torch (the transformers formulas) and runs `torch._grouped_mm` on a GPU
(a per-expert loop on the CPU); all-reduces go through NCCL
(`algorithm="nccl"`) followed by the torch norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparkinfer.rope.reference import rope_qk_cache_reference

__all__ = ["TorchOps"]


def _route(logits, spec, bias):
    """(weights fp32 [T, K], ids int64 [T, K]) as transformers routes."""
    if spec.routing == "softmax":
        p = torch.softmax(logits.float(), dim=-1)
        w, ids = p.topk(spec.top_k, dim=-1)
        if spec.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, ids
    s = logits.float().sigmoid()
    choice = s + bias
    t, e = s.shape
    g = choice.view(t, spec.n_group, e // spec.n_group).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros_like(g).scatter_(1, g.topk(spec.topk_group, dim=-1)[1], 1.0)
    choice = choice.masked_fill(~keep.repeat_interleave(e // spec.n_group, dim=1).bool(), float("-inf"))
    ids = choice.topk(spec.top_k, dim=-1)[1]
    w = s.gather(1, ids)
    if spec.renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * spec.routed_scaling_factor, ids


class TorchOps:
    """The torch implementations of the decoder's hooks (see `Decoder(ops="torch")`)."""

    def __init__(self, spec, comm=None):
        self.spec, self.comm = spec, comm

    def norm(self, partial, residual, weight, eps):
        if self.comm is not None:
            return self.comm.all_reduce_add_rms_norm(partial, residual, weight, eps, algorithm="nccl")
        res = (partial.float() + residual.float()).to(residual.dtype)
        r = res.float()
        return (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(res.dtype), res

    def rope_qk_cache(self, qkv, positions, slots, table, caches, heads, *, norms, eps, kv_stride, kv_offset):
        q, k, _ = rope_qk_cache_reference(qkv, positions, heads, (table.cos, table.sin), norms, eps)
        q, k = q.to(qkv.dtype), k.to(qkv.dtype)
        hq, kvh, d = heads
        v = qkv[:, (hq + kvh) * d:].view(qkv.shape[0], kvh, d)
        pos = positions.long()
        own = (pos % kv_stride) == kv_offset
        local = torch.where(own, pos // kv_stride, 0)
        row = torch.where(own, slots.long(), caches[0].shape[0] - 1)  # not ours: the padding slot
        caches[0][row, local] = k
        caches[1][row, local] = v
        return q

    def attention(self, q, k_cache, v_cache, row_slots, q_pos, *, sm_scale, kv_stride=1, kv_offset=0):
        b, nq, hq, d = q.shape
        k = k_cache.index_select(0, row_slots)  # [B, L, KVH, D]
        v = v_cache.index_select(0, row_slots)
        kpos = torch.arange(k.shape[1], device=q.device) * kv_stride + kv_offset
        qpos = q_pos[:, None] + torch.arange(nq, device=q.device)  # [B, Q]
        mask = kpos[None, None, :] <= qpos[:, :, None]
        if kv_stride > 1:  # DCP: this rank's token share, and the log-sum-exp the merge needs
            return _attention_lse(q, k, v, mask, sm_scale)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask[:, None], scale=sm_scale, enable_gqa=True)
        return out.transpose(1, 2), None

    def moe(self, x, logits, w, bias, out):
        """Routed experts: w an `ExpertWeights` with bf16 w1 [E, 2I, H], w2 [E, H, I]."""
        wts, ids = _route(logits, self.spec, bias)
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        tok = order // k
        if x.is_cuda:
            # scatter_add, not bincount: bincount sizes its output on the host (a sync)
            counts = torch.zeros(w.w1.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
                0, flat, torch.ones_like(flat))
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h1 = torch._grouped_mm(x[tok], w.w1.transpose(1, 2), offs=offs)
            g, u = h1.chunk(2, dim=-1)
            h2 = torch._grouped_mm(F.silu(g) * u, w.w2.transpose(1, 2), offs=offs)
        else:
            xs, es = x[tok], flat[order]
            h2 = torch.empty(xs.shape, dtype=x.dtype)
            for e in es.unique().tolist():
                m = es == e
                g, u = F.linear(xs[m], w.w1[e]).chunk(2, dim=-1)
                h2[m] = F.linear(F.silu(g) * u, w.w2[e])
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        acc.index_add_(0, tok, h2.float() * wts.flatten()[order][:, None])
        out.copy_(acc)
        return out


def _attention_lse(q, k, v, mask, sm_scale):
    """(out [B, Q, Hq, D] bf16, lse [B, Q, Hq] fp32, natural log) of q over k, v [B, L, KVH, D]
    where mask [B, Q, L] allows; fp32 softmax. SDPA returns no log-sum-exp, so the
    decode-context-parallel baseline spells it out (a row with no allowed key: lse -inf, out 0)."""
    g = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(g, dim=2)
    vf = v.float().repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,blhd->bhql", q.float(), kf) * sm_scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Hq, Q]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhql,blhd->bqhd", p, vf)
    return out.to(q.dtype), lse.transpose(1, 2).contiguous()
