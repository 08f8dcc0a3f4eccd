"""Attention over a slot-indexed KV cache for decode, speculative verify and
small prefill, with the log-sum-exp that decode-context parallelism merges.

Legend: B batch rows, Q queries per row, Hq query heads, KVH KV heads,
D head dim, S cache slots, L local positions per slot, W DCP ranks.

    out, lse = decode_attention(q, k_cache, v_cache, slots, q_pos, sm_scale=D ** -0.5,
                                kv_stride=W, kv_offset=rank, out=out, lse=lse)
    o = comm.dcp_merge(out.view(B * Q, Hq, D), lse.view(B * Q, Hq), lse_base="e")

Nothing runs at import.
"""

from sparkinfer.attention.config import AttentionConfig, attention_config, num_splits_heuristic
from sparkinfer.attention.launch import attention_workspace, decode_attention, plan_call
from sparkinfer.attention.reference import attention_reference

__all__ = ["decode_attention", "attention_workspace", "plan_call", "AttentionConfig", "attention_config",
           "num_splits_heuristic", "attention_reference"]
