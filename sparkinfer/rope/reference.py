"""fp32 reference of `rope_qk_cache` (pure torch, the transformers formulation:
RMSNorm over the head, then rotate_half rotary on the first R dims)."""

import torch


def rms_head(x, w, eps):
    """x: [T, N, D] -> RMSNorm over D with weight w [D]; the stored bf16 rounding
    of transformers' norm (normalize, round, scale, round) is kept."""
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w.float() * n.float()).to(x.dtype)


def rope(x, cos, sin):
    """x: [T, N, D]; cos, sin: [T, R/2] fp32 -> rotate_half rotary of x[..., :R], in fp32."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def rope_qk_cache_reference(qkv, positions, heads, table, norms=None, eps=1e-6):
    """qkv: [T, (Hq + 2 KVH) D]; heads = (Hq, KVH, D); table = (cos, sin) [P, R/2];
    norms = (q_norm, k_norm) or None -> (q, k, v) [T, N, D] fp32 (q, k rotated)."""
    hq, kvh, d = heads
    t = qkv.shape[0]
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + kvh) * d].view(t, kvh, d)
    v = qkv[:, (hq + kvh) * d:].view(t, kvh, d)
    if norms is not None:
        q, k = rms_head(q, norms[0], eps), rms_head(k, norms[1], eps)
    cos, sin = table[0][positions.long()], table[1][positions.long()]
    return rope(q, cos, sin), rope(k, cos, sin), v.float()
