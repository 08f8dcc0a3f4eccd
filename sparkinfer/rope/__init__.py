"""Per-head q/k RMSNorm + rotary embedding + KV-cache write, one kernel.

Legend: T tokens, Hq query heads, KVH key/value heads (this rank's), D head dim,
R rotary dims (the first R of each head; R = D unless the rotary is partial),
S cache slots, L cache positions per slot, P table positions.
"""

from sparkinfer.rope.launch import RotaryTable, rope_qk_cache, rotary_table

__all__ = ["RotaryTable", "rotary_table", "rope_qk_cache"]
