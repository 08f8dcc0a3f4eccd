"""fp32 reference of `decode_attention` (pure torch).

Legend: B batch rows, Q queries per row, Hq query heads, KVH KV heads,
G = Hq / KVH, D head dim, S cache slots, L local positions per slot.
"""

from __future__ import annotations

import torch

__all__ = ["attention_reference"]


def attention_reference(q, k_cache, v_cache, slots, q_pos, *, sm_scale: float, kv_stride: int = 1,
                        kv_offset: int = 0):
    """Causal attention of q over the cache slots, in fp32.

    q: [B, Q, Hq, D]; k_cache, v_cache: [S, L, KVH, D]; slots, q_pos: int [B].
    Query i of row b sits at global position q_pos[b] + i; local cache index j
    holds global position j * kv_stride + kv_offset; a query attends to the keys
    of its slot at global positions <= its own.
    Returns (out [B, Q, Hq, D] fp32, lse [B, Q, Hq] fp32, natural log of the sum
    of exp(sm_scale * q.k)). A query with no key gives out = 0, lse = -inf.
    Allocates (fp32 [B, L, KVH, D] gathers of the slots, [B, Hq, Q, L] scores); no host sync.
    """
    B, Q, Hq, D = q.shape
    L, KVH = k_cache.shape[1], k_cache.shape[2]
    idx = slots.long()
    k = k_cache[idx].float()  # [B, L, KVH, D]
    v = v_cache[idx].float()  # [B, L, KVH, D]
    qg = q.float().view(B, Q, KVH, Hq // KVH, D)  # head h = kv head h // G, member h % G
    s = torch.einsum("bqkgd,blkd->bkgql", qg, k) * sm_scale  # [B, KVH, G, Q, L]
    key_pos = torch.arange(L, device=q.device) * kv_stride + kv_offset  # [L]
    q_abs = q_pos.long()[:, None] + torch.arange(Q, device=q.device)[None, :]  # [B, Q]
    allowed = key_pos[None, None, :] <= q_abs[:, :, None]  # [B, Q, L]
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, KVH, G, Q]
    p = torch.exp(s - torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("bkgql,blkd->bqkgd", p, v).reshape(B, Q, Hq, D)
    return out, lse.permute(0, 3, 1, 2).reshape(B, Q, Hq)
